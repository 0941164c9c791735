// Loading and exporting a ParallelModel's weights by single-process name.
#include <c10/core/GradMode.h>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "parallel/internal/parallel_model_impl.h"
#include "parallel/internal/transfer.h"

namespace trident {

absl::Status ParallelModel::LoadWeights(const SafetensorsContents& weights) {
  Impl& m = *impl_;
  std::map<std::string, std::string> aliases = m.source.aliases;
  aliases.insert(m.part.aliases.begin(), m.part.aliases.end());
  TRIDENT_RETURN_IF_ERROR(GatherFullParameters());
  std::vector<std::string> missing;
  absl::Status loaded = absl::OkStatus();
  {
    c10::NoGradGuard no_grad;
    for (auto& [name, parameter] : m.parameters) {
      absl::StatusOr<at::Tensor> saved = weights.Get(name);
      for (const auto& [alias, stored] : aliases) {
        if (!saved.ok() && stored == name) saved = weights.Get(alias);
      }
      if (!saved.ok()) {
        // A base model's file has no adapters: they keep their initial values.
        if (!m.plan.has_lora() || !IsAdapterParameter(name)) missing.push_back(name);
        continue;
      }
      at::Tensor value = *saved;
      auto shard = m.shards.find(name);
      if (shard != m.shards.end()) {  // the file holds the whole tensor; keep this rank's slice
        auto shape = shard->second.ShardShape(value.sizes().vec());
        if (shape.ok() && at::IntArrayRef(*shape).equals(parameter.sizes())) value = shard->second.Slice(value);
      }
      if (!value.sizes().equals(parameter.sizes())) {
        loaded = absl::InvalidArgumentError(absl::StrCat(
            weights.path, ": tensor '", name, "' has shape ", c10::str(value.sizes()), " but the model's parameter is ",
            c10::str(parameter.sizes()), "; the file is for another model size"));
        break;
      }
      parameter.copy_(value);
    }
  }
  TRIDENT_RETURN_IF_ERROR(ReleaseFullParameters(/*keep_changes=*/true));
  TRIDENT_RETURN_IF_ERROR(loaded);
  if (!missing.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(weights.path, " lacks ", missing.size(),
                                                   " parameter(s) of the model: ", absl::StrJoin(missing, ", ")));
  }
  return absl::OkStatus();
}

absl::StatusOr<NamedTensors> ParallelModel::FullWeights() {
  Impl& m = *impl_;
  TRIDENT_RETURN_IF_ERROR(GatherFullParameters());
  NamedTensors tensors;
  for (const auto& [name, p] : m.parameters) tensors.emplace_back(name, p.detach().cpu().clone());
  TRIDENT_RETURN_IF_ERROR(ReleaseFullParameters(/*keep_changes=*/false));
  if (m.tp != nullptr) {  // join the shards into the single-process tensors
    for (auto& [name, tensor] : tensors) {
      auto shard = m.shards.find(name);
      if (shard == m.shards.end()) continue;
      TRIDENT_ASSIGN_OR_RETURN(at::Tensor gathered, m.tp->AllGather(tensor, shard->second.dim));
      tensor = shard->second.Unslice(gathered.chunk(m.tp->size(), shard->second.dim));
    }
  }
  // Each stage's first data- and tensor-parallel rank holds its part whole;
  // stage 0's (global rank 0) collects the others' through the pipeline group.
  const bool writer = (m.dp == nullptr || m.dp->rank() == 0) && (m.tp == nullptr || m.tp->rank() == 0);
  if (m.pp != nullptr && writer) {
    if (m.stage > 0) {
      TRIDENT_RETURN_IF_ERROR(internal::SendNamedTensors(*m.pp, 0, tensors));
      tensors.clear();
    } else {
      std::set<std::string> seen;
      for (const auto& [name, t] : tensors) seen.insert(name);
      for (int s = 1; s < m.stages(); ++s) {
        TRIDENT_ASSIGN_OR_RETURN(NamedTensors part, internal::RecvNamedTensors(*m.pp, s));
        for (auto& [name, t] : part) {
          if (seen.insert(name).second) tensors.emplace_back(name, t);  // tied: the lowest stage's
        }
      }
    }
  }
  // The rank at the mesh's origin holds them now; under a rank order that is
  // not global rank 0, which gets them from it.
  const DeviceMesh& mesh = m.topology->mesh();
  const int origin = mesh.RankAt(std::vector<int>(mesh.axes().size(), 0));
  if (origin != 0 && m.topology->rank() == origin) {
    TRIDENT_RETURN_IF_ERROR(internal::SendNamedTensors(m.topology->world(), 0, tensors));
  } else if (origin != 0 && m.topology->rank() == 0) {
    TRIDENT_ASSIGN_OR_RETURN(tensors, internal::RecvNamedTensors(m.topology->world(), origin));
  }
  TRIDENT_RETURN_IF_ERROR(m.topology->world().Barrier());
  if (m.topology->rank() != 0) return NamedTensors();
  std::map<std::string, std::string> aliases = m.source.aliases;
  aliases.insert(m.part.aliases.begin(), m.part.aliases.end());
  const size_t stored = tensors.size();
  for (const auto& [alias, owner] : aliases) {
    for (size_t i = 0; i < stored; ++i) {
      if (tensors[i].first == owner) tensors.emplace_back(alias, tensors[i].second);
    }
  }
  return tensors;
}

}  // namespace trident
