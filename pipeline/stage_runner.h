// Runs one pipeline stage's instruction list for a training step: forwards and
// backwards of its layers for every micro-batch (recomputing checkpointed
// layers), and the activations and gradients exchanged with the neighbouring
// stages over the pipeline group.
// Boundary shapes are fixed up front, so ranks never negotiate shapes.
#ifndef TRIDENT_PIPELINE_STAGE_RUNNER_H_
#define TRIDENT_PIPELINE_STAGE_RUNNER_H_

#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "graph/graph.h"
#include "pipeline/pipeline.h"
#include "topology/topology.h"

namespace trident {

struct StageRunnerOptions {
  int64_t first_layer = 0;  // this stage runs layers [first_layer, end_layer) of `layers`
  int64_t end_layer = 0;
  // Shape and dtype of the activation every stage boundary carries for one micro-batch.
  std::vector<int64_t> boundary_shape;
  at::ScalarType boundary_dtype = at::kFloat;
  // Activation checkpointing: the first `checkpointed_layers` layers of the stage
  // keep only their input in forward and run again in backward, in segments of
  // `checkpoint_num_layers` layers (0: none checkpointed).
  int64_t checkpointed_layers = 0;
  int64_t checkpoint_num_layers = 1;
  // Called for kReduceTiedGrads, kReduceDataParallelGrads and kOptimizerStep.
  std::function<absl::Status()> reduce_tied_grads, reduce_data_parallel_grads, optimizer_step;
};

class PipelineStageRunner {
 public:
  // `pipeline` is the pipeline group: its rank is this stage's index.
  PipelineStageRunner(LayerSequence& layers, const ProcessGroup& pipeline,
                      const PipelineSchedule& schedule, StageRunnerOptions options);

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
  const std::vector<TimelineEvent>& timeline() const { return timeline_; }
  // The most micro-batches whose activations were alive at once in the last
  // RunStep (forward done, backward not yet).
  int peak_live_activations() const { return peak_live_; }

 private:
  // A checkpointed segment of one micro-batch: layers [first, end) ran on
  // `input` without gradients; `after` is the leaf later layers saw.
  struct Checkpointed {
    int64_t first, end;
    at::Tensor input, after, rng;
    at::Tensor recomputed;  // the segment's output rerun with gradients, once recomputed
  };
  absl::StatusOr<at::Tensor> Forward(int m, const at::Tensor& input);
  // Reruns micro-batch m's checkpointed segments (once; Backward calls it too).
  absl::Status Recompute(int m);
  absl::Status Backward(int m);
  static at::Tensor RngState();
  static void SetRngState(const at::Tensor& state);

  LayerSequence& layers_;
  const ProcessGroup& pipeline_;
  const PipelineSchedule& schedule_;
  StageRunnerOptions options_;
  int stage_, stages_;
  // Per micro-batch: the stage's input leaf (to read its gradient), its output,
  // and the received gradient of that output.
  std::vector<at::Tensor> inputs_, outputs_, grads_, received_activations_;
  std::vector<at::Tensor> targets_;
  std::vector<std::vector<Checkpointed>> checkpoints_;  // per micro-batch
  std::vector<PendingWork> posted_;  // started by kPostSendActivationRecvGrad
  double loss_sum_ = 0;
  std::vector<TimelineEvent> timeline_;
  int peak_live_ = 0;
};

// Sums the gradients of parameters that the first and the last stage both hold
// (GPT's tied token embedding), so both copies take the same optimizer step.
// `tied` maps each such parameter's name to its tensor on this stage; a no-op on
// middle stages and with one stage.
absl::Status ReduceTiedGradients(const std::vector<std::pair<std::string, at::Tensor>>& tied,
                                 const ProcessGroup& pipeline);

}  // namespace trident

#endif  // TRIDENT_PIPELINE_STAGE_RUNNER_H_
