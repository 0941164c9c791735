// The automatic strategy search's models of a plan on a profiled model: each
// rank's memory (state bytes exactly as the optimizer lays them out,
// activations by the schedule's in-flight micro-batches, transient buffers)
// and the step time (stage times from the profile, the pipeline simulator,
// data-parallel and ZeRO collectives from the measured curves). Private to
// //strategy.
#ifndef TRIDENT_STRATEGY_INTERNAL_COST_MODEL_H_
#define TRIDENT_STRATEGY_INTERNAL_COST_MODEL_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "parallel/parallel.h"
#include "strategy/profile.pb.h"

namespace trident {
namespace internal {

struct MemoryPrediction {
  // Per pipeline rank (tensor- and data-parallel rank 0).
  std::vector<MemoryReport> state;   // what ParallelModel::Memory() reports
  std::vector<int64_t> activations;  // peak bytes kept for backward, at once
  // Backward scratch, buckets, gathered layers; under ZeRO-3 with one
  // micro-batch less the chunk gradients not yet made while activations
  // peak (so it may be negative).
  std::vector<int64_t> transient;
  std::vector<int64_t> tensor_peak;  // the three together
  int64_t max_tensor_peak = 0;       // of the worst rank
  // Plus the process's own memory, and what building the model left with
  // the allocator (ZeRO-3's unsharded copies).
  int64_t max_resident = 0;
};
absl::StatusOr<MemoryPrediction> PredictMemory(const ModelProfile& profile, const ParallelPlan& plan);

struct TimePrediction {
  double step_seconds = 0;
  double pipeline_seconds = 0;   // forward, backward and messages of every micro-batch
  double reduction_seconds = 0;  // gradient reductions and gathers outside the pipeline
  double optimizer_seconds = 0;
  double message_seconds = 0;  // one pipeline message's flight (part of pipeline_seconds)
  double compute_seconds = 0;  // the busiest rank's forward and backward (part of pipeline_seconds)
};
absl::StatusOr<TimePrediction> PredictStepTime(const ModelProfile& profile, const ParallelPlan& plan);

// The first layer of each virtual stage and the end of the last (what
// Parallelize's partition of `plan` gives on this profile).
absl::StatusOr<std::vector<int64_t>> StageBoundaries(const ModelProfile& profile, const ParallelPlan& plan);

}  // namespace internal
}  // namespace trident

#endif  // TRIDENT_STRATEGY_INTERNAL_COST_MODEL_H_
