#include <algorithm>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "partition/partition.h"

namespace trident {
namespace {

// Node ranges [first, last] that read the parameters of a leaf module: no cut
// inside (a cut before node p is inside when first < p <= last).
std::vector<std::pair<int64_t, int64_t>> LeafRanges(const ModelGraph& graph,
                                                    const std::vector<std::string>& leaf_modules) {
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (const std::string& prefix : leaf_modules) {
    int64_t first = -1, last = -1;
    for (int64_t i = 0; i < static_cast<int64_t>(graph.nodes().size()); ++i) {
      for (const std::string& name : graph.nodes()[i].parameters) {
        if (name.rfind(prefix + ".", 0) == 0 || name == prefix) {
          if (first < 0) first = i;
          last = i;
        }
      }
    }
    if (first >= 0) ranges.emplace_back(first, last);
  }
  return ranges;
}

// Positions where the graph can be cut, with the number of tensors crossing each.
std::vector<std::pair<int64_t, int>> CutCandidates(const ModelGraph& graph,
                                                   const std::vector<std::string>& leaf_modules) {
  const auto leaves = LeafRanges(graph, leaf_modules);
  std::vector<std::pair<int64_t, int>> candidates;
  for (int64_t p = 1; p < static_cast<int64_t>(graph.nodes().size()); ++p) {
    const bool inside =
        std::any_of(leaves.begin(), leaves.end(), [p](const auto& r) { return r.first < p && p <= r.second; });
    if (inside) continue;
    if (auto crossing = graph.CrossingTensors(p)) candidates.emplace_back(p, *crossing);
  }
  return candidates;
}

std::vector<int64_t> FarthestMinDeps(const ModelGraph& graph, int shard_count,
                                     const std::vector<std::string>& leaf_modules) {
  const auto& nodes = graph.nodes();
  double total = 0;
  for (const GraphNode& n : nodes) total += n.parameter_bytes;
  const double budget = total / shard_count;
  // Cheapest cut seen so far: a shard closes at the first candidate after its
  // budget is reached whose crossing count is no larger than the least seen
  // since the previous cut plus one (a "hub" such as a mask may ride along);
  // otherwise it grows (merges back) until such a cut comes.
  std::vector<int64_t> bounds = {0};
  std::map<int64_t, int> crossing;
  for (const auto& [p, c] : CutCandidates(graph, leaf_modules)) crossing[p] = c;
  double shard = 0;
  int least = 1 << 30;
  bool embedding = false;  // the shard holds an embedding lookup: close it at the next cut
  for (int64_t p = 1; p < static_cast<int64_t>(nodes.size()); ++p) {
    shard += nodes[p - 1].parameter_bytes;
    embedding |= nodes[p - 1].kind == "aten::embedding";
    auto it = crossing.find(p);
    if (it == crossing.end()) continue;
    least = std::min(least, it->second);
    if (embedding || (shard >= budget && it->second <= least + 1)) {
      embedding = false;
      bounds.push_back(p);
      shard = 0;
      least = 1 << 30;
    }
  }
  bounds.push_back(static_cast<int64_t>(nodes.size()));
  return bounds;
}

TRIDENT_REGISTER(SplitMethodRegistry, "farthest_min_deps", FarthestMinDeps);

std::vector<int64_t> NearestMinDeps(const ModelGraph& graph, int shard_count,
                                    const std::vector<std::string>& leaf_modules) {
  const auto& nodes = graph.nodes();
  std::vector<std::pair<int64_t, int>> cuts = CutCandidates(graph, leaf_modules);
  std::vector<double> prefix(nodes.size() + 1, 0);
  for (size_t i = 0; i < nodes.size(); ++i) prefix[i + 1] = prefix[i] + nodes[i].parameter_bytes;
  // Greedy merge: remove the cut carrying the most tensors (ties: the one whose
  // merged neighbours are lightest) until shard_count shards remain.
  while (static_cast<int>(cuts.size()) + 1 > shard_count) {
    size_t worst = 0;
    int worst_crossing = -1;
    double worst_weight = 0;
    for (size_t i = 0; i < cuts.size(); ++i) {
      const int64_t left = i == 0 ? 0 : cuts[i - 1].first;
      const int64_t right = i + 1 == cuts.size() ? static_cast<int64_t>(nodes.size()) : cuts[i + 1].first;
      const double merged = prefix[right] - prefix[left];
      if (cuts[i].second > worst_crossing || (cuts[i].second == worst_crossing && merged < worst_weight)) {
        worst = i;
        worst_crossing = cuts[i].second;
        worst_weight = merged;
      }
    }
    cuts.erase(cuts.begin() + static_cast<std::ptrdiff_t>(worst));
  }
  std::vector<int64_t> bounds = {0};
  for (const auto& [p, c] : cuts) bounds.push_back(p);
  bounds.push_back(static_cast<int64_t>(nodes.size()));
  return bounds;
}

TRIDENT_REGISTER(SplitMethodRegistry, "nearest_min_deps", NearestMinDeps);

}  // namespace

std::vector<LayerProfile> ShardProfiles(const ModelGraph& graph, const std::vector<int64_t>& shards) {
  std::map<std::string, int64_t> numel;
  for (size_t i = 0; i < graph.parameters().size(); ++i) {
    numel[graph.parameter_names()[i]] = graph.parameters()[i].numel();
  }
  std::vector<LayerProfile> profile;
  const std::vector<TensorFlow> flows = graph.Flows(shards);
  for (size_t s = 0; s + 1 < shards.size(); ++s) {
    LayerProfile p;
    p.name = absl::StrCat("shard", s);
    std::set<std::string> seen;
    for (int64_t i = shards[s]; i < shards[s + 1]; ++i) {
      const GraphNode& node = graph.nodes()[i];
      p.forward_flops += node.forward_flops;
      for (const std::string& name : node.parameters) {
        if (!seen.insert(name).second) continue;
        p.parameter_names.push_back(name);
        p.parameters += numel[name];
      }
      p.parameter_bytes += node.parameter_bytes;
    }
    for (const TensorFlow& flow : flows) {
      if (flow.from_stage == static_cast<int>(s)) p.activation_bytes += flow.bytes;
    }
    profile.push_back(std::move(p));
  }
  return profile;
}

absl::StatusOr<std::vector<int64_t>> SplitIntoShards(const ModelGraph& graph, const std::string& split_method,
                                                     int shard_count, const std::vector<std::string>& leaf_modules) {
  if (shard_count < 1) {
    return absl::InvalidArgumentError(absl::StrCat("shard_count=", shard_count, " must be positive"));
  }
  absl::StatusOr<SplitMethod> split = SplitMethodRegistry().Find(split_method);
  if (!split.ok()) {
    return absl::Status(split.status().code(), absl::StrCat(split.status().message(),
                                                            " (layer_split cuts a LayerSequence, not a traced graph)"));
  }
  return (*split)(graph, shard_count, leaf_modules);
}

Registry<SplitMethod>& SplitMethodRegistry() {
  static auto* registry = new Registry<SplitMethod>("split_method");
  return *registry;
}

int DefaultShardCount(const ModelGraph& graph) {
  // Layers: the distinct numbers that follow a name in the parameter names
  // ("transformer.h.7.attn.c_attn.weight" -> 7).
  std::set<std::string> layers;
  for (const std::string& name : graph.parameter_names()) {
    size_t start = 0;
    while (start < name.size()) {
      size_t end = name.find('.', start);
      if (end == std::string::npos) end = name.size();
      const std::string part = name.substr(start, end - start);
      if (!part.empty() && std::all_of(part.begin(), part.end(), ::isdigit)) {
        layers.insert(name.substr(0, end));
        break;
      }
      start = end + 1;
    }
  }
  return 2 * static_cast<int>(layers.size()) + 4;
}

absl::StatusOr<Plan> PlanGraphStages(const ModelGraph& graph, const GraphPartitionOptions& options) {
  const int shard_count = options.shard_count > 0 ? options.shard_count : DefaultShardCount(graph);
  TRIDENT_ASSIGN_OR_RETURN(std::vector<int64_t> shards,
                           SplitIntoShards(graph, options.split_method, shard_count, options.leaf_modules));
  const auto& nodes = graph.nodes();
  std::vector<double> weights;
  for (size_t s = 0; s + 1 < shards.size(); ++s) {
    double w = 0;
    for (int64_t i = shards[s]; i < shards[s + 1]; ++i) {
      w += options.partition_method == "parameters" ? nodes[i].parameter_bytes : nodes[i].forward_flops;
    }
    weights.push_back(w);
  }
  if (static_cast<int>(weights.size()) < options.num_stages) {
    return absl::InvalidArgumentError(absl::StrCat("the graph split into ", weights.size(), " shards, fewer than the ",
                                                   options.num_stages,
                                                   " stages asked for; raise shard_count or use fewer stages"));
  }
  TRIDENT_ASSIGN_OR_RETURN(std::vector<int64_t> grouped,
                           PartitionLayers(options.partition_method, weights, options.num_stages));
  Plan plan;
  plan.set_split_method(options.split_method);
  plan.set_partition_method(options.partition_method);
  plan.set_num_stages(options.num_stages);
  for (int64_t g : grouped) plan.add_boundaries(shards[g]);
  for (int s = 0; s < options.num_stages; ++s) {
    StagePlan* stage = plan.add_stages();
    stage->set_stage(s);
    stage->set_first_layer(shards[grouped[s]]);
    stage->set_end_layer(shards[grouped[s + 1]]);
    std::set<std::string> seen;
    double flops = 0;
    int64_t bytes = 0;
    for (int64_t i = stage->first_layer(); i < stage->end_layer(); ++i) {
      stage->add_layer_names(nodes[i].kind);
      for (const std::string& p : nodes[i].parameters) {
        if (seen.insert(p).second) stage->add_parameter_names(p);
      }
      flops += nodes[i].forward_flops;
      bytes += nodes[i].parameter_bytes;
    }
    stage->set_forward_flops(flops);
    stage->set_parameter_bytes(bytes);
  }
  for (const TensorFlow& flow : graph.Flows({plan.boundaries().begin(), plan.boundaries().end()})) {
    StageTensorFlow* f = plan.add_flows();
    f->set_value_id(flow.value_id);
    f->set_from_stage(flow.from_stage);
    for (int to : flow.to_stages) f->add_to_stages(to);
    for (int64_t d : flow.shape) f->add_shape(d);
    f->set_dtype(flow.dtype);
    StagePlan* sender = plan.mutable_stages(flow.from_stage);
    sender->set_activation_bytes(sender->activation_bytes() + flow.bytes);
  }
  return plan;
}

}  // namespace trident
