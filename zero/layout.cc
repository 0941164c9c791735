// ZeRO's bucket layout from parameter sizes, and the bytes it leaves a rank.
#include <algorithm>
#include <map>

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/gradient_hooks.h"
#include "base/module_names.h"
#include "zero/zero.h"

namespace trident {

int64_t ZeroBucketBytes(const ZeroSpec& spec) {
  if (spec.stage() < 3 || spec.gather_bucket_bytes() <= 0) return spec.reduce_bucket_bytes();
  return std::min(spec.reduce_bucket_bytes(), spec.gather_bucket_bytes());
}

absl::StatusOr<ZeroLayout> PlanZeroBuckets(const std::vector<ZeroParameter>& parameters, int stage,
                                           int64_t bucket_bytes, int group_size,
                                           const std::vector<std::pair<int64_t, std::vector<int>>>& layer_reads) {
  ZeroLayout layout;
  auto open = [&](int group, bool keep) {
    ZeroBucket bucket;
    bucket.group = group;
    bucket.keep_full = keep;
    bucket.sharded = stage == 3 && !keep;
    layout.buckets.push_back(bucket);
    return static_cast<int>(layout.buckets.size()) - 1;
  };
  if (stage < 3) {
    int groups = 0;
    for (const ZeroParameter& p : parameters) groups = std::max(groups, p.group + 1);
    for (int g = 0; g < groups; ++g) {
      std::vector<int> members;
      std::vector<int64_t> bytes;
      std::vector<int> kinds;
      for (int i = 0; i < static_cast<int>(parameters.size()); ++i) {
        if (parameters[i].group != g) continue;
        members.push_back(i);
        bytes.push_back(parameters[i].numel * parameters[i].element_size);
        kinds.push_back(parameters[i].keep_full ? 1 : 0);
      }
      for (const std::vector<int>& bucket : BucketIndicesInBackwardOrder(bytes, bucket_bytes, kinds)) {
        const int b = open(g, parameters[members[bucket.front()]].keep_full);
        for (int k : bucket) layout.buckets[b].parameters.push_back(members[k]);
      }
    }
  } else {
    std::vector<int> bucket_of(parameters.size(), -1);
    for (const auto& [layer, reads] : layer_reads) {
      // The unit's new parameters by kind (group, keep), in buckets of at most
      // bucket_bytes in backward order, so a bucket's gradient is
      // reduced, and its values released, while backward goes on in the unit.
      std::vector<std::pair<std::pair<int, bool>, std::vector<int>>> kinds;
      for (int i : reads) {
        if (bucket_of[i] >= 0) continue;
        const auto key = std::make_pair(parameters[i].group, parameters[i].keep_full);
        auto kind = std::find_if(kinds.begin(), kinds.end(), [&](const auto& k) { return k.first == key; });
        if (kind == kinds.end()) kind = kinds.insert(kinds.end(), {key, {}});
        kind->second.push_back(i);
        bucket_of[i] = -2;  // placed below
      }
      for (const auto& [key, members] : kinds) {
        std::vector<int64_t> bytes;
        for (int i : members) bytes.push_back(parameters[i].numel * parameters[i].element_size);
        for (const std::vector<int>& bucket : BucketIndicesInBackwardOrder(bytes, bucket_bytes)) {
          const int b = open(key.first, key.second);
          for (int k : bucket) {
            bucket_of[members[k]] = b;
            layout.buckets[b].parameters.push_back(members[k]);
          }
        }
      }
    }
    if (std::count(bucket_of.begin(), bucket_of.end(), -1) > 0) {
      return absl::InvalidArgumentError(
          "ZeRO stage 3: a parameter is read by none of the given layers; list every layer "
          "this rank holds in ZeroOptions::layer_indices");
    }
    for (const auto& [layer, reads] : layer_reads) {
      std::vector<int>& needed = layout.layer_buckets[layer];
      for (int i : reads) {
        if (std::find(needed.begin(), needed.end(), bucket_of[i]) == needed.end()) needed.push_back(bucket_of[i]);
      }
    }
  }
  for (ZeroBucket& bucket : layout.buckets) {
    for (int i : bucket.parameters) bucket.numel += parameters[i].numel;
    bucket.numel = (bucket.numel + group_size - 1) / group_size * group_size;
    bucket.element_size = parameters[bucket.parameters.front()].element_size;
  }
  return layout;
}

ZeroGatherUnits PlanGatherUnits(const ZeroSpec& spec,
                                const std::vector<std::pair<int64_t, std::vector<int>>>& layer_reads,
                                const std::vector<std::string>& names, const std::vector<int64_t>& numels) {
  // The wrap name every parameter of a layer lies under ("" for none or several).
  auto wrapped_by = [&](const std::vector<int>& reads) -> std::string {
    std::string common;
    for (int i : reads) {
      auto under = std::find_if(spec.wrap().begin(), spec.wrap().end(),
                                [&](const std::string& module) { return IsUnderModule(names[i], module); });
      if (under == spec.wrap().end() || (!common.empty() && common != *under)) return "";
      common = *under;
    }
    return common;
  };
  ZeroGatherUnits units;
  std::vector<std::string> unit_wrap;
  std::vector<int64_t> unit_numel;
  for (const auto& [layer, reads] : layer_reads) {
    const std::string wrap = wrapped_by(reads);
    const bool adjacent = !units.layers.empty() && units.layers.back().back() + 1 == layer;
    if (!adjacent || !(reads.empty() || (!wrap.empty() && wrap == unit_wrap.back()))) {
      units.layers.emplace_back();
      units.reads.emplace_back(layer, std::vector<int>());
      unit_wrap.push_back(wrap);
      unit_numel.push_back(0);
    }
    units.layers.back().push_back(layer);
    for (int i : reads) {
      units.reads.back().second.push_back(i);
      unit_numel.back() += numels[i];
    }
  }
  if (spec.min_num_params() <= 0) return units;
  ZeroGatherUnits merged;
  int64_t merged_numel = 0;
  for (size_t u = 0; u < units.layers.size(); ++u) {
    const bool adjacent = !merged.layers.empty() && merged.layers.back().back() + 1 == units.layers[u].front();
    if (adjacent && merged_numel < spec.min_num_params()) {
      merged.layers.back().insert(merged.layers.back().end(), units.layers[u].begin(), units.layers[u].end());
      std::vector<int>& reads = merged.reads.back().second;
      reads.insert(reads.end(), units.reads[u].second.begin(), units.reads[u].second.end());
      merged_numel += unit_numel[u];
    } else {
      merged.layers.push_back(units.layers[u]);
      merged.reads.push_back(units.reads[u]);
      merged_numel = unit_numel[u];
    }
  }
  return merged;
}

int ZeroPrefetchDepth(const ZeroSpec& spec) {
  return spec.limit_all_gathers() ? std::min(1, spec.prefetch_layers()) : spec.prefetch_layers();
}

MemoryReport ZeroLayoutMemory(const ZeroLayout& layout, int group_size, int state_per_element) {
  MemoryReport report;
  int64_t largest_scratch = 0, chunk_bytes = 0;
  for (const ZeroBucket& bucket : layout.buckets) {
    const int64_t full = bucket.numel * bucket.element_size, chunk = full / group_size;
    report.parameter_bytes += bucket.sharded ? chunk : full;
    report.gradient_bytes += bucket.keep_full ? full : chunk;  // a kept gradient holds its chunk
    if (!bucket.keep_full) largest_scratch = std::max(largest_scratch, full);
    chunk_bytes += chunk;
  }
  report.gradient_bytes += largest_scratch;  // one stage-2 bucket fills at a time
  report.gradient_scratch_bytes = largest_scratch;
  report.optimizer_bytes = state_per_element * chunk_bytes;
  return report;
}

std::string MemoryReport::ToString() const {
  auto on_disk = [](int64_t bytes) { return bytes > 0 ? absl::StrFormat(" (%.1f MB on disk)", bytes / 1e6) : ""; };
  return absl::StrFormat("parameters %.1f MB%s, gradients %.1f MB, optimizer state %.1f MB%s", parameter_bytes / 1e6,
                         on_disk(offloaded_parameter_bytes), gradient_bytes / 1e6, optimizer_bytes / 1e6,
                         on_disk(offloaded_optimizer_bytes));
}

bool ZeroKeepsWhole(const ZeroSpec& spec, const std::string& name) {
  for (const std::string& ignored : spec.ignored()) {
    if (IsUnderModule(name, ignored)) return true;
  }
  return false;
}

absl::StatusOr<int> ZeroShardGroupSize(const ZeroSpec& spec, int data_parallel_size) {
  const int dp = std::max(1, data_parallel_size);
  auto refuse = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("zero shard_group_size=", spec.shard_group_size(),
                                                   " num_shard_groups=", spec.num_shard_groups(), " with dp=", dp, ": ",
                                                   why));
  };
  if (spec.shard_group_size() < 0 || spec.num_shard_groups() < 0) return refuse("they must not be negative");
  int size = dp;
  if (spec.num_shard_groups() > 0) {
    if (dp % spec.num_shard_groups() != 0) return refuse("the groups must divide the data-parallel ranks");
    size = dp / spec.num_shard_groups();
  }
  if (spec.shard_group_size() > 0) {
    if (dp % spec.shard_group_size() != 0) return refuse("the group size must divide the data-parallel ranks");
    if (spec.num_shard_groups() > 0 && spec.shard_group_size() != size) return refuse("give one of them");
    size = spec.shard_group_size();
  }
  return size;
}

}  // namespace trident
