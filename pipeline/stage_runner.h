// Runs one pipeline rank's instruction list for a training step: forwards and
// backwards of its layers for every micro-batch (recomputing checkpointed
// layers, splitting backward into input and weight gradients where the schedule
// asks), and the activations and gradients exchanged with the neighbouring
// ranks over the pipeline group. The layers are any LayerSequence: the zoo's
// layer ranges, or the shards of a traced graph (GraphLayers), whose stage
// boundaries carry several tensors, integer and floating-point alike. Sends are
// asynchronous (completed by the end of the step); receives block. Boundary
// shapes are fixed up front (ForwardThroughStages finds them once), so ranks
// never negotiate shapes during a step.
#ifndef TRIDENT_PIPELINE_STAGE_RUNNER_H_
#define TRIDENT_PIPELINE_STAGE_RUNNER_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "graph/graph.h"
#include "pipeline/pipeline.h"
#include "topology/topology.h"

namespace trident {

// Shape, dtype and whether a gradient flows back, of one tensor a stage
// boundary carries for one micro-batch.
struct TensorSpec {
  std::vector<int64_t> shape;
  at::ScalarType dtype = at::kFloat;
  bool requires_grad = false;
  bool operator==(const TensorSpec& other) const {
    return shape == other.shape && dtype == other.dtype && requires_grad == other.requires_grad;
  }
};

// A model chunk of a pipeline rank: layers [first_layer, end_layer) of the
// LayerSequence. Activation checkpointing: its first `checkpointed_layers`
// layers keep only their inputs in forward and run again in backward (0:
// none), or, when `recomputed` is not empty, the layers it marks
// (recomputed[i] for layer first_layer + i).
struct StageChunk {
  int64_t first_layer = 0;
  int64_t end_layer = 0;
  int64_t checkpointed_layers = 0;
  std::vector<bool> recomputed;
  bool Recomputes(int64_t layer) const {
    return recomputed.empty() ? layer < first_layer + checkpointed_layers : recomputed[layer - first_layer];
  }
  // What the chunk receives from the virtual stage before it (empty for the
  // first) and sends to the one after it (empty for the last), per micro-batch.
  std::vector<TensorSpec> received, sent;
};

// The scalar loss of a micro-batch from the last layer's outputs.
using StageLoss = std::function<at::Tensor(const Values& outputs, const Batch& batch)>;

struct StageRunnerOptions {
  // One chunk, or the schedule's num_chunks() for interleaved schedules (chunk
  // c of rank s is virtual stage c * S + s).
  std::vector<StageChunk> chunks;
  // The loss on the last virtual stage (unset: LayerSequence::Loss).
  StageLoss loss;
  // Checkpointed layers rerun in segments of this many layers.
  int64_t checkpoint_num_layers = 1;
  // Merak's dealloc_pipeoutput: once an activation is sent to the next stage
  // this stage keeps only its autograd node, not its values (backward needs
  // the node and the gradient received for it). The values go when the send
  // completes: with one chunk per rank each activation send first completes
  // the earlier sends (Gloo reports completion only when waited for).
  bool dealloc_sent_outputs = false;
  // Multiplies the loss before backward (mixed-precision loss scaling); the
  // returned losses are unscaled. Unset: 1.
  std::function<double()> loss_scale;
  // Called before every backward instruction; `last` for the last one of the
  // step that produces parameter gradients (gradient reducers start then).
  std::function<void(bool last)> before_backward;
  // Called for kReduceTiedGrads, kReduceDataParallelGrads and kOptimizerStep.
  std::function<absl::Status()> reduce_tied_grads, reduce_data_parallel_grads, optimizer_step;
};

class PipelineStageRunner {
 public:
  // `pipeline` is the pipeline group: its rank is this stage's index (nullptr:
  // one stage). `layers` holds (at least) the chunks' layers.
  PipelineStageRunner(LayerSequence& layers, const ProcessGroup* pipeline, const PipelineSchedule& schedule,
                      StageRunnerOptions options);
  ~PipelineStageRunner();

  // One training step over micro-batches `batches[m]` (ranks whose layers read
  // no batch field and that hold no loss may pass empty batches). Micro-batch
  // m's loss is multiplied by `loss_weights[m]` before backward, so gradients
  // are those of the weighted sum (1/M each: the mean). Returns each
  // micro-batch's loss, unweighted, on the rank of the last virtual stage and
  // nothing elsewhere.
  absl::StatusOr<std::vector<double>> RunStep(const std::vector<Batch>& batches,
                                              const std::vector<double>& loss_weights);
  // Forwards only, without gradients (evaluation): the losses as RunStep.
  absl::StatusOr<std::vector<double>> RunForward(const std::vector<Batch>& batches);
  // The instructions of the last RunStep with their start and end, in seconds
  // from the step's start (stage = this stage's index).
  const std::vector<TimelineEvent>& timeline() const;
  // The most micro-batches whose activations were alive at once in the last
  // RunStep (forward done, backward not yet), over all chunks.
  int peak_live_activations() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

// What ForwardThroughStages found on this rank.
struct StagePass {
  // Per chunk of this rank: the specs it received and sent (requires_grad as
  // the tensors had it: run with gradients enabled to learn which need them).
  std::vector<std::vector<TensorSpec>> received, sent;
  // The last layer's outputs, on the rank of the last virtual stage.
  Values outputs;
};

// Runs `batch` forward once through every virtual stage (chunk c of rank s is
// virtual stage c * S + s), each boundary's specs travelling ahead of its
// tensors, so nothing about the shapes need be known beforehand. Fills in
// `chunks`' received and sent specs. For finding the boundary shapes before
// training, and for inference whose shapes change from call to call. A stage
// that fails tells the stages after it, so none waits: each returns an error.
absl::StatusOr<StagePass> ForwardThroughStages(LayerSequence& layers, std::vector<StageChunk>& chunks,
                                               const ProcessGroup* pipeline, const Batch& batch);

// Sums the gradients of parameters that several pipeline stages hold (GPT's
// tied token embedding on the first and last stage), so every copy takes the
// same optimizer step. `tied[i]` is such a parameter on this stage and
// `holders[i]` the stages that hold it (ascending, this one among them; every
// holder lists the same names in the same order). Sums run in stage order.
absl::Status ReduceTiedGradients(const NamedTensors& tied, const std::vector<std::vector<int>>& holders,
                                 const ProcessGroup& pipeline);

}  // namespace trident

#endif  // TRIDENT_PIPELINE_STAGE_RUNNER_H_
