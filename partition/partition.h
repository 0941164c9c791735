// partition: cutting a model into S pipeline stages.
//
// Module-level path: the layers of a LayerSequence are grouped into contiguous
// stages by one of the reference design's partition methods, or cut at named
// layers (`layer_split` with `custom_split_points`). The result is a Plan
// protobuf that can be saved, edited and loaded.
//
//   TRIDENT_ASSIGN_OR_RETURN(auto profile, ProfileLayers(*model, example_tokens));
//   PartitionOptions options;
//   options.num_stages = 4;
//   options.partition_method = "parameters";
//   TRIDENT_ASSIGN_OR_RETURN(Plan plan, PlanStages(profile, options));
//   // plan.stages(s).first_layer() .. end_layer(), parameter_names(), ...
#ifndef TRIDENT_PARTITION_PARTITION_H_
#define TRIDENT_PARTITION_PARTITION_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/registry.h"
#include "graph/graph.h"
#include "partition/plan.pb.h"

namespace trident {

// Boundaries b_0 = 0 < b_1 < ... < b_S = weights.size() (stage s holds layers
// [b_s, b_{s+1})) chosen by `method` from per-layer `weights`:
//   uniform        layer counts differ by at most one, extra layers on the first stages
//   uniform_floor  floor(L/S) layers per stage, the remainder on the last stage
//   parameters     the smallest possible largest stage weight (binary search on
//                  the bottleneck with a greedy probe); weights are parameter counts
//   cost           the same objective by the linear-partition dynamic program;
//                  weights are estimated or measured times
// Errors when S < 1 or S exceeds the number of layers.
// Methods are registered by name; a user's own registers a PartitionMethod
// with PartitionMethodRegistry() at static initialisation ("parameters" is fed
// parameter counts, any other method the FLOPs or measured times).
absl::StatusOr<std::vector<int64_t>> PartitionLayers(absl::string_view method, const std::vector<double>& weights,
                                                     int num_stages);
using PartitionMethod =
    std::function<absl::StatusOr<std::vector<int64_t>>(const std::vector<double>& weights, int num_stages)>;
Registry<PartitionMethod>& PartitionMethodRegistry();

struct PartitionOptions {
  int num_stages = 1;
  // uniform, uniform_floor, parameters, cost or custom.
  std::string partition_method = "uniform";
  // custom: the S + 1 boundaries themselves.
  std::vector<int64_t> custom_boundaries;
  // When set, the stages start at these layers (by LayerSequence name), S - 1 of
  // them in order: the reference design's layer_split with custom_split_points.
  std::vector<std::string> custom_split_points;
  // cost: "flops" (the profile's estimate) or "measured" (its forward times).
  std::string cost_source = "flops";
};

// The plan for `profile` (see ProfileLayers) under `options`.
absl::StatusOr<Plan> PlanStages(const std::vector<LayerProfile>& profile, const PartitionOptions& options);

// Graph path: a traced ModelGraph is first cut into shards at positions where
// only tensors cross, then the shards are grouped into stages.
//   farthest_min_deps  walk the nodes in order and close a shard once it holds its
//                      share of the parameters, at a cut that carries no more tensors
//                      than the cheapest seen since the last one (plus one hub tensor,
//                      such as a mask); otherwise keep growing it (merge back). An
//                      embedding lookup closes its shard at the next cut, so
//                      embeddings get shards of their own.
//   nearest_min_deps   start from every possible cut and merge neighbours, dropping
//                      the cut that carries the most tensors first
// Returns shard boundaries over graph.nodes().
// `leaf_modules` are parameter-name prefixes of submodules kept whole: no cut
// between the first and the last node that reads their parameters.
// Split methods are registered by name, as partition methods are.
using SplitMethod = std::function<absl::StatusOr<std::vector<int64_t>>(const ModelGraph& graph, int shard_count,
                                                                       const std::vector<std::string>& leaf_modules)>;
Registry<SplitMethod>& SplitMethodRegistry();
absl::StatusOr<std::vector<int64_t>> SplitIntoShards(const ModelGraph& graph, const std::string& split_method,
                                                     int shard_count,
                                                     const std::vector<std::string>& leaf_modules = {});

// 2 * layers + 4, layers read off the numbered parameter names
// ("transformer.h.7." is layer 7): the reference design's default shard count.
int DefaultShardCount(const ModelGraph& graph);

struct GraphPartitionOptions {
  std::string split_method = "farthest_min_deps";
  // Shards before grouping; 0: 2 * num_layers + 4 as in the reference design (so
  // attention and MLP land in separate shards), num_layers read off the numbered
  // parameter names ("transformer.h.7.").
  int shard_count = 0;
  int num_stages = 1;
  // uniform, uniform_floor, parameters (shard parameter bytes) or cost (shard FLOPs).
  std::string partition_method = "uniform";
  std::vector<std::string> leaf_modules;  // see SplitIntoShards
};

// One LayerProfile per shard of `graph` cut at `shards` (parameters read, FLOPs
// and the bytes crossing its end), so PlanStages groups shards as it groups layers.
std::vector<LayerProfile> ShardProfiles(const ModelGraph& graph, const std::vector<int64_t>& shards);

// The plan for a traced graph: stage boundaries over graph.nodes() (the
// StagePlan first_layer/end_layer fields hold node indices), to be passed to
// ModelGraph::Split.
absl::StatusOr<Plan> PlanGraphStages(const ModelGraph& graph, const GraphPartitionOptions& options);

absl::Status SavePlan(const Plan& plan, const std::string& path);
absl::StatusOr<Plan> LoadPlan(const std::string& path);

}  // namespace trident

#endif  // TRIDENT_PARTITION_PARTITION_H_
