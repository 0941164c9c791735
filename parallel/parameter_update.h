// How a step turns gradients into new weights: plain data parallelism
// (gradients all-reduced in buckets that start during backward, then any
// torch::optim optimizer) or ZeRO (sharded gradients and optimizer state).
// ParallelModel and the pipeline runner drive both the same way; one
// OptimizerFactory builds the optimizer for either.
#ifndef TRIDENT_PARALLEL_PARAMETER_UPDATE_H_
#define TRIDENT_PARALLEL_PARAMETER_UPDATE_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "base/host_copy.h"
#include "base/tensors.h"
#include "graph/graph.h"
#include "topology/topology.h"
#include "zero/zero.h"

namespace trident {

class ParameterUpdate {
 public:
  virtual ~ParameterUpdate() = default;
  virtual void ZeroGrad() = 0;
  // Before each backward; `last_micro_batch` lets reductions overlap it.
  virtual void PrepareForBackward(bool last_micro_batch) = 0;
  // After the step's last backward: gradients averaged over data parallelism.
  virtual absl::Status FinishBackward() = 0;
  // Whether this rank holds an inf or NaN gradient (callers agree over ranks).
  virtual bool LocalGradientsNonFinite() const = 0;
  virtual void ScaleGradients(double factor) = 0;
  // The same by a one-element tensor on the gradients' device, not read on
  // the host: the multiplication is by its value rounded to fp32, as the
  // double's is (MultiplyWithoutReading).
  virtual void ScaleGradients(const at::Tensor& factor) = 0;
  // Sums the gradients of `parameters` over the tensor-parallel group
  // (sequence parallelism leaves each rank a part of replicated ones).
  virtual absl::Status SumOverTensorParallel(const std::vector<at::Tensor>& parameters) = 0;
  // The global gradient norm, counting every stored value once; when
  // `max_norm` > 0 and the norm exceeds it, gradients are scaled down to it.
  // Where the gradients are on a GPU the norm and the scaling are queued
  // there, and the norm is read when the caller asks for it.
  absl::StatusOr<PendingScalar> ClipGradNorm(double max_norm);
  virtual absl::Status Step(double lr) = 0;
  // The optimizer's state (its own serialisation), and its restoration into
  // the same layout.
  virtual NamedTensors State() const = 0;
  virtual absl::Status LoadState(const NamedTensors& state) = 0;
  // Where this rank's optimizer keeps each parameter's values and state (for
  // checkpoints in any layout), and the optimizer.
  virtual absl::StatusOr<std::vector<ParameterPart>> Parts() const = 0;
  virtual torch::optim::Optimizer& optimizer() = 0;
  // The element-wise state the optimizer keeps for a part's `updated` tensor
  // (ElementwiseState; offloaded state read where it lies), and its
  // replacement (SetElementwiseState, then offloaded again).
  virtual absl::StatusOr<std::map<std::string, at::Tensor>> OptimizerStateOf(const at::Tensor& updated) {
    return ElementwiseState(optimizer(), updated);
  }
  virtual absl::Status SetOptimizerStateOf(const at::Tensor& updated, const std::map<std::string, at::Tensor>& state) {
    return SetElementwiseState(optimizer(), updated, state);
  }
  // Per-rank bytes of parameters, gradients and optimizer state, for the log.
  virtual MemoryReport Memory() const = 0;
  // ZeRO stage 3 keeps parameters sharded: these give them their full values
  // (to save or export) and shard them again, `keep_changes` keeping values
  // written meanwhile (a load). No-ops otherwise.
  virtual absl::Status GatherFullParameters() { return absl::OkStatus(); }
  // ZeRO 1 and 2's Step leaves its all-gathers to the next forward's layers:
  // this finishes them, for reading or writing parameters otherwise.
  virtual absl::Status WaitForUpdatedParameters() { return absl::OkStatus(); }
  virtual absl::Status ReleaseFullParameters(bool /*keep_changes*/) { return absl::OkStatus(); }

 protected:
  // Squared L2 norm of the gradient values this rank counts (one double
  // value, on the gradients' device or the CPU), and the group whose ranks
  // together count every value once (nullptr: this rank alone).
  virtual at::Tensor LocalSquaredGradNorm() const = 0;
  virtual const ProcessGroup* NormGroup() const = 0;
};

struct ParameterUpdateOptions {
  NamedTensors parameters;                      // stored once each
  std::vector<at::Tensor> counted;              // in the gradient norm (tied copies, tp replicas once)
  std::vector<at::Tensor> keep_full_gradient;   // ZeRO-2: summed between pipeline stages first
  const ProcessGroup* data_parallel = nullptr;  // nullptr: dp = 1
  // Hybrid sharding: ZeRO shards over `zero_shards` (part of data_parallel)
  // and sums over `zero_replicas` (nullptr: over all of data_parallel).
  const ProcessGroup* zero_shards = nullptr;
  const ProcessGroup* zero_replicas = nullptr;
  const ProcessGroup* tensor_parallel = nullptr;  // nullptr: tp = 1
  const ProcessGroup* norm_group = nullptr;       // tensor x pipeline ranks (nullptr: none)
  const ProcessGroup* world = nullptr;            // every rank (ZeRO's norm spans dp too)
  // Plain data parallelism (stage 0) or ZeRO, with their buckets and the
  // gradient predivide factor (the plan's zero).
  ZeroSpec zero;
  // Builds the optimizer: group 0 the parameters of dimension >= 2 (weight
  // decay applies), group 1 the others.
  OptimizerFactory make_optimizer;
  LayerSequence* layers = nullptr;  // ZeRO stage 3: the model and the layers held
  std::vector<int64_t> layer_indices;
};

absl::StatusOr<std::unique_ptr<ParameterUpdate>> MakeParameterUpdate(ParameterUpdateOptions options);

}  // namespace trident

#endif  // TRIDENT_PARALLEL_PARAMETER_UPDATE_H_
