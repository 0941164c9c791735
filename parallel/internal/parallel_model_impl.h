// ParallelModel's state, shared by its files. Private to //parallel.
#ifndef TRIDENT_PARALLEL_INTERNAL_PARALLEL_MODEL_IMPL_H_
#define TRIDENT_PARALLEL_INTERNAL_PARALLEL_MODEL_IMPL_H_

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "amp/amp.h"
#include "base/host_copy.h"
#include "parallel/internal/model_part.h"
#include "parallel/parallel.h"
#include "parallel/parameter_update.h"
#include "pipeline/stage_runner.h"

namespace trident {

class ParallelModel::Impl {
 public:
  ParallelPlan plan;
  Topology* topology = nullptr;
  const ProcessGroup *dp = nullptr, *tp = nullptr, *pp = nullptr, *norm = nullptr;
  // Hybrid sharding (plan.zero.shard_group_size < dp): the data-parallel
  // ranks ZeRO shards over, and those holding the same chunks (else nullptr).
  const ProcessGroup *zero_shards = nullptr, *zero_replicas = nullptr;
  int stage = 0;
  at::Device device{at::kCPU};
  ModelSource source;
  internal::ModelPart part;
  std::unique_ptr<PipelineSchedule> schedule;
  std::unique_ptr<PipelineStageRunner> runner;
  NamedTensors parameters;  // stored, each tensor once
  NamedTensors trainable;   // those that require gradients (the others are frozen)
  std::map<std::string, ShardSpec> shards;
  // Parameters other stages hold too, and which stages hold each (ascending).
  NamedTensors tied;
  std::vector<std::vector<int>> tied_holders;
  std::vector<at::Tensor> replicated;  // trainable, not tensor-parallel: partial gradients under SP
  std::vector<at::Tensor> counted;     // in the gradient norm
  std::unique_ptr<ParameterUpdate> update;
  PrecisionPolicy precision;
  std::optional<LossScaler> scaler;
  int64_t num_parameters = 0;
  double flops_per_sample = 0;
  bool reads_data = false;

  int stages() const { return plan.pp(); }
  bool HoldsLastStage() const {
    return stage == stages() - 1;  // the last virtual stage is chunk V-1 of the last rank
  }
  int DataParallelSize() const { return dp != nullptr ? dp->size() : 1; }
  // The stage loss: a given loss function on the last outputs (or its result,
  // first among them when it ran inside the layers); else the layers' own.
  StageLoss Loss() const {
    if (!source.loss) return StageLoss();
    if (part.loss_inside) return [](const Values& outputs, const Batch&) { return outputs.at(0); };
    return [loss = source.loss](const Values& outputs, const Batch& batch) { return loss(batch, outputs); };
  }
  std::vector<Batch> OnDevice(const std::vector<Batch>& batches) const {
    std::vector<Batch> moved;
    for (const Batch& batch : batches) {
      Batch b;
      for (const at::Tensor& t : batch) b.push_back(ToDeviceWithoutWaiting(t, device));
      moved.push_back(std::move(b));
    }
    return moved;
  }
  // The last stage's `local` value on every rank, reduced over data
  // parallelism. Between GPUs it travels in device memory, behind the queued
  // backward, and is read when the caller asks.
  absl::StatusOr<PendingScalar> Share(double local, ReduceOp over_data) const {
    at::Tensor value = at::full({1}, HoldsLastStage() ? local : 0.0, at::kDouble);
    for (const ProcessGroup* group : {pp, dp}) {
      if (group != nullptr && group->size() > 1) {
        value = ToDeviceWithoutWaiting(value, group->device());
        break;
      }
    }
    if (pp != nullptr) TRIDENT_RETURN_IF_ERROR(pp->Broadcast(value, stages() - 1));
    if (dp != nullptr) TRIDENT_RETURN_IF_ERROR(dp->AllReduce(value, over_data));
    return PendingScalar(value);
  }
  absl::StatusOr<std::vector<double>> LossWeights(const std::vector<Batch>& batches) const;
  absl::Status Setup(OptimizerFactory make_optimizer, const Batch& example);
  absl::Status FindBoundaries(const Batch& example);
  absl::Status CheckModulePatterns();
  absl::Status ClassifyParameters(const Batch& example);
  void PlanRecomputation();
};

}  // namespace trident

#endif  // TRIDENT_PARALLEL_INTERNAL_PARALLEL_MODEL_IMPL_H_
