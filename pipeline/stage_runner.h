// Runs one pipeline rank's instruction list for a training step: forwards and
// backwards of its layers for every micro-batch (recomputing checkpointed
// layers, splitting backward into input and weight gradients where the schedule
// asks), and the activations and gradients exchanged with the neighbouring
// ranks over the pipeline group. Sends are asynchronous (completed by the end
// of the step); receives block. Boundary shapes are fixed up front, so ranks
// never negotiate shapes.
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

// A model chunk of a pipeline rank: layers [first_layer, end_layer) of the
// LayerSequence. Activation checkpointing: its first `checkpointed_layers`
// layers keep only their input in forward and run again in backward (0: none).
struct StageChunk {
  int64_t first_layer = 0;
  int64_t end_layer = 0;
  int64_t checkpointed_layers = 0;
};

struct StageRunnerOptions {
  // One chunk, or the schedule's num_chunks() for interleaved schedules (chunk
  // c of rank s is virtual stage c * S + s).
  std::vector<StageChunk> chunks;
  // Shape and dtype of the activation every stage boundary carries for one micro-batch.
  std::vector<int64_t> boundary_shape;
  at::ScalarType boundary_dtype = at::kFloat;
  // Checkpointed layers rerun in segments of this many layers.
  int64_t checkpoint_num_layers = 1;
  // Multiplies the loss before backward (mixed-precision loss scaling); the
  // returned losses are unscaled. Unset: 1.
  std::function<double()> loss_scale;
  // Called for kReduceTiedGrads, kReduceDataParallelGrads and kOptimizerStep.
  std::function<absl::Status()> reduce_tied_grads, reduce_data_parallel_grads, optimizer_step;
};

class PipelineStageRunner {
 public:
  // `pipeline` is the pipeline group: its rank is this stage's index. `layers`
  // holds (at least) the chunks' layers.
  PipelineStageRunner(LayerSequence& layers, const ProcessGroup& pipeline,
                      const PipelineSchedule& schedule, StageRunnerOptions options);
  ~PipelineStageRunner();

  // One training step over micro-batches `inputs[m]` / `targets[m]` (read by the
  // first / last stage only; other stages may pass empty tensors). Each
  // micro-batch's loss is divided by the number of micro-batches, so gradients
  // are those of the mean loss. Returns the mean loss on the last stage and NaN
  // elsewhere.
  absl::StatusOr<double> RunStep(const std::vector<at::Tensor>& inputs,
                                 const std::vector<at::Tensor>& targets);
  // Forwards only, without gradients (evaluation): the mean loss on the last
  // stage, NaN elsewhere.
  absl::StatusOr<double> RunForward(const std::vector<at::Tensor>& inputs,
                                    const std::vector<at::Tensor>& targets);
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

// Sums the gradients of parameters that the first and the last stage both hold
// (GPT's tied token embedding), so both copies take the same optimizer step.
// `tied` maps each such parameter's name to its tensor on this stage; a no-op on
// middle stages and with one stage.
absl::Status ReduceTiedGradients(const std::vector<std::pair<std::string, at::Tensor>>& tied,
                                 const ProcessGroup& pipeline);

}  // namespace trident

#endif  // TRIDENT_PIPELINE_STAGE_RUNNER_H_
