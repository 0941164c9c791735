#include "partition/partition.h"

#include <algorithm>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>

#include <google/protobuf/text_format.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"

namespace trident {
namespace {

std::vector<int64_t> Uniform(int64_t layers, int stages, bool floor) {
  const int64_t size = layers / stages, extra = layers % stages;
  std::vector<int64_t> bounds = {0};
  for (int s = 0; s < stages; ++s) {
    const int64_t stage_size = floor ? size : size + (s < extra ? 1 : 0);
    bounds.push_back(bounds.back() + stage_size);
  }
  bounds.back() = layers;  // floor: the remainder joins the last stage
  return bounds;
}

// Stages that greedy filling up to `bottleneck` needs.
int StagesNeeded(const std::vector<double>& w, double bottleneck) {
  int stages = 1;
  double sum = 0;
  for (double x : w) {
    if (sum + x > bottleneck) {
      ++stages;
      sum = 0;
    }
    sum += x;
  }
  return stages;
}

std::vector<int64_t> MinimiseBottleneckBySearch(const std::vector<double>& w, int stages) {
  // The optimum is the sum of some contiguous run: search those values.
  std::vector<double> candidates;
  for (size_t i = 0; i < w.size(); ++i) {
    double sum = 0;
    for (size_t j = i; j < w.size(); ++j) candidates.push_back(sum += w[j]);
  }
  std::sort(candidates.begin(), candidates.end());
  const double largest = *std::max_element(w.begin(), w.end());
  auto first = std::lower_bound(candidates.begin(), candidates.end(), largest);
  auto feasible = std::partition_point(first, candidates.end(), [&](double b) { return StagesNeeded(w, b) > stages; });
  const double bottleneck = feasible == candidates.end() ? candidates.back() : *feasible;
  // Greedy cut under the bottleneck, forced where each remaining stage needs a layer.
  const int64_t layers = static_cast<int64_t>(w.size());
  std::vector<int64_t> bounds = {0};
  double sum = 0;
  for (int64_t i = 0; i < layers; ++i) {
    const int64_t stages_to_start = stages - static_cast<int64_t>(bounds.size());
    if (i > bounds.back() && (sum + w[i] > bottleneck || layers - i == stages_to_start)) {
      bounds.push_back(i);
      sum = 0;
    }
    sum += w[i];
  }
  bounds.push_back(layers);
  return bounds;
}

std::vector<int64_t> MinimiseBottleneckByDynamicProgram(const std::vector<double>& w, int stages) {
  const int64_t n = static_cast<int64_t>(w.size());
  std::vector<double> prefix(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + w[i];
  const double inf = std::numeric_limits<double>::infinity();
  // best[s][i]: smallest bottleneck of the first i layers in s stages; cut[s][i]: last cut.
  std::vector<std::vector<double>> best(stages + 1, std::vector<double>(n + 1, inf));
  std::vector<std::vector<int64_t>> cut(stages + 1, std::vector<int64_t>(n + 1, 0));
  best[0][0] = 0;
  for (int s = 1; s <= stages; ++s) {
    for (int64_t i = s; i <= n; ++i) {
      for (int64_t j = s - 1; j < i; ++j) {
        const double value = std::max(best[s - 1][j], prefix[i] - prefix[j]);
        if (value < best[s][i]) {
          best[s][i] = value;
          cut[s][i] = j;
        }
      }
    }
  }
  std::vector<int64_t> bounds(stages + 1);
  bounds[stages] = n;
  for (int s = stages; s > 0; --s) bounds[s - 1] = cut[s][bounds[s]];
  return bounds;
}

absl::Status CheckBoundaries(const std::vector<int64_t>& bounds, int64_t layers, int stages) {
  bool ok = static_cast<int>(bounds.size()) == stages + 1 && bounds.front() == 0 && bounds.back() == layers;
  for (size_t i = 1; ok && i < bounds.size(); ++i) ok = bounds[i] > bounds[i - 1];
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("custom boundaries [", absl::StrJoin(bounds, ", "), "] do not cut ",
                                                 layers, " layers into ", stages, " stages: give ", stages + 1,
                                                 " increasing layer indices from 0 to ", layers));
}

}  // namespace

absl::StatusOr<std::vector<int64_t>> PartitionLayers(absl::string_view method, const std::vector<double>& weights,
                                                     int num_stages) {
  const int64_t layers = static_cast<int64_t>(weights.size());
  if (num_stages < 1 || num_stages > layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot cut ", layers, " layers into ", num_stages, " stages; use 1 to ", layers, " stages"));
  }
  if (method == "custom") {
    return absl::InvalidArgumentError(
        "partition_method 'custom' takes its boundaries from PartitionOptions::custom_boundaries");
  }
  TRIDENT_ASSIGN_OR_RETURN(PartitionMethod partition, PartitionMethodRegistry().Find(method));
  return partition(weights, num_stages);
}

Registry<PartitionMethod>& PartitionMethodRegistry() {
  static auto* registry = new Registry<PartitionMethod>("partition_method");
  return *registry;
}

namespace {

using Bounds = absl::StatusOr<std::vector<int64_t>>;

TRIDENT_REGISTER(PartitionMethodRegistry, "uniform", [](const std::vector<double>& w, int s) -> Bounds {
  return Uniform(static_cast<int64_t>(w.size()), s, /*floor=*/false);
});
TRIDENT_REGISTER(PartitionMethodRegistry, "uniform_floor", [](const std::vector<double>& w, int s) -> Bounds {
  return Uniform(static_cast<int64_t>(w.size()), s, /*floor=*/true);
});
TRIDENT_REGISTER(PartitionMethodRegistry, "parameters",
                 [](const std::vector<double>& w, int s) -> Bounds { return MinimiseBottleneckBySearch(w, s); });
TRIDENT_REGISTER(PartitionMethodRegistry, "cost", [](const std::vector<double>& w, int s) -> Bounds {
  return MinimiseBottleneckByDynamicProgram(w, s);
});

}  // namespace

absl::StatusOr<Plan> PlanStages(const std::vector<LayerProfile>& profile, const PartitionOptions& options) {
  const int64_t layers = static_cast<int64_t>(profile.size());
  const int stages = options.num_stages;
  std::vector<int64_t> bounds;
  Plan plan;
  plan.set_split_method("layer_split");
  plan.set_partition_method(options.partition_method);
  if (!options.custom_split_points.empty()) {
    if (static_cast<int>(options.custom_split_points.size()) != stages - 1) {
      return absl::InvalidArgumentError(absl::StrCat(options.custom_split_points.size(), " custom_split_points for ",
                                                     stages, " stages; give one per stage after the first"));
    }
    bounds.push_back(0);
    for (const std::string& point : options.custom_split_points) {
      auto it = std::find_if(profile.begin(), profile.end(), [&](const LayerProfile& p) { return p.name == point; });
      if (it == profile.end()) {
        std::vector<std::string> names;
        for (const LayerProfile& p : profile) names.push_back(p.name);
        return absl::InvalidArgumentError(absl::StrCat(
            "custom split point '", point, "' is not a layer; the layers are ", absl::StrJoin(names, ", ")));
      }
      bounds.push_back(it - profile.begin());
    }
    bounds.push_back(layers);
    plan.set_partition_method("custom");
    TRIDENT_RETURN_IF_ERROR(CheckBoundaries(bounds, layers, stages));
  } else if (options.partition_method == "custom") {
    bounds = options.custom_boundaries;
    TRIDENT_RETURN_IF_ERROR(CheckBoundaries(bounds, layers, stages));
  } else {
    std::vector<double> weights;
    for (const LayerProfile& p : profile) {
      if (options.partition_method == "parameters") {
        weights.push_back(static_cast<double>(p.parameters));
      } else if (options.cost_source == "measured") {
        weights.push_back(p.forward_seconds);
      } else {
        weights.push_back(p.forward_flops);
      }
    }
    TRIDENT_ASSIGN_OR_RETURN(bounds, PartitionLayers(options.partition_method, weights, stages));
  }
  plan.set_num_stages(stages);
  for (int64_t b : bounds) plan.add_boundaries(b);
  for (int s = 0; s < stages; ++s) {
    StagePlan* stage = plan.add_stages();
    stage->set_stage(s);
    stage->set_first_layer(bounds[s]);
    stage->set_end_layer(bounds[s + 1]);
    std::set<std::string> seen;
    double flops = 0, seconds = 0;
    int64_t bytes = 0;
    for (int64_t i = bounds[s]; i < bounds[s + 1]; ++i) {
      const LayerProfile& layer = profile[i];
      stage->add_layer_names(layer.name);
      for (const std::string& name : layer.parameter_names) {
        if (seen.insert(name).second) stage->add_parameter_names(name);
      }
      flops += layer.forward_flops;
      seconds += layer.forward_seconds;
      bytes += layer.parameter_bytes;
    }
    stage->set_forward_flops(flops);
    stage->set_forward_seconds(seconds);
    stage->set_parameter_bytes(bytes);
    stage->set_activation_bytes(profile[bounds[s + 1] - 1].activation_bytes);
  }
  return plan;
}

absl::Status SavePlan(const Plan& plan, const std::string& path) {
  std::string text;
  google::protobuf::TextFormat::PrintToString(plan, &text);
  std::ofstream out(path);
  out << text;
  return out ? absl::OkStatus() : absl::InternalError(absl::StrCat("cannot write plan ", path));
}

absl::StatusOr<Plan> LoadPlan(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read plan ", path));
  std::stringstream text;
  text << in.rdbuf();
  Plan plan;
  if (!google::protobuf::TextFormat::ParseFromString(text.str(), &plan)) {
    return absl::InvalidArgumentError(absl::StrCat("plan ", path, " is not a valid Plan"));
  }
  std::vector<int64_t> bounds(plan.boundaries().begin(), plan.boundaries().end());
  const int64_t layers = bounds.empty() ? 0 : bounds.back();
  TRIDENT_RETURN_IF_ERROR(CheckBoundaries(bounds, layers, plan.num_stages()));
  return plan;
}

}  // namespace trident
