// Profiling for the automatic strategy search: what a model's layers cost on
// the real ranks and what the collectives cost on the real groups. Private
// to //strategy.
#ifndef TRIDENT_STRATEGY_INTERNAL_PROFILE_H_
#define TRIDENT_STRATEGY_INTERNAL_PROFILE_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "parallel/parallel.h"
#include "strategy/profile.pb.h"
#include "topology/topology.h"

namespace trident {
namespace internal {

using SourceFactory = std::function<absl::StatusOr<ModelSource>(const ModelContext& context)>;

struct ProfileRequest {
  SourceFactory make_source;
  ParallelPlan plan;  // how Parallelize reads the source (trace and split settings, batch fields)
  Batch batch;        // at least the largest micro-batch size of samples
  OptimizerFactory make_optimizer;
  std::vector<int64_t> micro_batch_sizes;  // two, ascending: the fits go through them
  std::vector<int> tp_degrees;             // to try (1 always works)
  bool bf16 = false;                       // also time tp 1 under bf16 autocast
  int64_t max_collective_bytes = 64 << 20;
  std::string fingerprint;
};

// Profiles on every rank of `topology` at once (all ranks busy, as in
// training), layer by layer (one layer built at a time: memory-light; a
// traced model's shards, as LayersOf cuts it, traced at each micro-batch size), each
// tensor-parallel degree on real groups of that size; the collectives over
// every group size dividing the world. Reshapes `topology` as it goes and
// leaves it with one data axis. Every rank gets rank 0's profile.
absl::StatusOr<ModelProfile> ProfileModel(const ProfileRequest& request, Topology* topology);

// ProfileModel, or the profile cached in `cache_dir` under the request's
// fingerprint (rank 0 reads and writes it; every rank gets it).
absl::StatusOr<ModelProfile> CachedProfile(const ProfileRequest& request, const std::string& cache_dir,
                                           Topology* topology, bool* from_cache);

// Interpolates `curve` piecewise-linearly at `bytes` (linearly beyond its ends).
double CollectiveSeconds(const ModelProfile& profile, const std::string& op, int group_size, double bytes);

// Rows [first, first + count) of every field of `batch` (scalars as they are).
Batch BatchRows(const Batch& batch, int64_t first, int64_t count);

}  // namespace internal
}  // namespace trident

#endif  // TRIDENT_STRATEGY_INTERNAL_PROFILE_H_
