// A ParallelModel's parameters and optimizer state as slices of the
// single-process tensors: what layout-free checkpoints write and read.
#include <set>
#include <unordered_map>

#include <c10/core/GradMode.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "parallel/internal/parallel_model_impl.h"
#include "parallel/internal/transfer.h"

namespace trident {
namespace {

constexpr char kOptimizer[] = "optimizer/";
constexpr char kSerializedOptimizer[] = "optimizer/serialized/";

std::string StateName(const std::string& parameter, const std::string& state) {
  return absl::StrCat(kOptimizer, parameter, "/", state);
}

}  // namespace

namespace internal {

// How a rank's parameters relate to the single-process tensors.
class PieceIndex {
 public:
  PieceIndex(const NamedTensors& parameters, const std::map<std::string, ShardSpec>& shards, const NamedTensors& tied,
             const std::vector<std::vector<int>>& tied_holders, int stage, const ProcessGroup* tp,
             const ProcessGroup* dp, const ProcessGroup* zero_replicas)
      : shards_(shards), tp_(tp), dp_(dp), zero_replicas_(zero_replicas) {
    for (const auto& [name, p] : parameters) name_of_[p.unsafeGetTensorImpl()] = name;
    for (size_t i = 0; i < tied.size(); ++i) {
      if (tied_holders[i].front() != stage) tied_copies_.insert(tied[i].first);
    }
  }
  const std::string& Name(const at::Tensor& p) const { return name_of_.at(p.unsafeGetTensorImpl()); }
  // The slice of the single-process tensor `name` that this rank's whole
  // parameter of shape `local` is.
  TensorSlice ParameterSlice(const std::string& name, const std::vector<int64_t>& local) const {
    auto shard = shards_.find(name);
    if (shard == shards_.end()) return TensorSlice::Whole(local);
    const ShardSpec& spec = shard->second;
    std::vector<int64_t> full = local;
    full[spec.dim] *= spec.parts;
    return TensorSlice::BlockShard(full, spec.dim, spec.blocks, spec.index, spec.parts);
  }
  TensorSlice PartSlice(const std::string& name, const ParameterPart& part) const {
    TensorSlice slice = ParameterSlice(name, part.shape);
    const int64_t numel = c10::multiply_integers(part.shape);
    return part.begin == 0 && part.end == numel ? slice : slice.FlatRange(part.begin, part.end);
  }
  // Whether another rank writes the same values (when deduplicating); `zero`:
  // the data-parallel ranks of a shard group hold disjoint parts (and its
  // replicas the same ones).
  bool WrittenElsewhere(const std::string& name, bool zero) const {
    if (tied_copies_.count(name)) return true;
    if (tp_ != nullptr && tp_->rank() > 0 && shards_.count(name) == 0) return true;
    const ProcessGroup* copies = zero ? zero_replicas_ : dp_;
    return copies != nullptr && copies->rank() > 0;
  }

 private:
  const std::map<std::string, ShardSpec>& shards_;
  const ProcessGroup *tp_, *dp_, *zero_replicas_;
  std::unordered_map<const c10::TensorImpl*, std::string> name_of_;
  std::set<std::string> tied_copies_;
};

// Elements [offset, offset + n) of `t`'s flattening (a view).
at::Tensor FlatPart(const at::Tensor& t, int64_t offset, int64_t n) { return t.view({-1}).narrow(0, offset, n); }

}  // namespace internal

std::string ParallelModel::Layout() const {
  const ParallelPlan& p = impl_->plan;
  return absl::StrCat("dp", p.dp(), "_tp", p.tp(), p.tensor_parallel().sequence_parallel() ? "sp" : "", "_pp", p.pp(),
                      "x", p.virtual_stages(), "_zero", p.zero().stage(),
                      impl_->zero_shards != nullptr ? absl::StrCat("g", impl_->zero_shards->size()) : "");
}

absl::StatusOr<std::vector<SlicedTensor>> ParallelModel::CheckpointPieces(bool optimizer, bool deduplicate) const {
  const Impl& m = *impl_;
  internal::PieceIndex index(m.parameters, m.shards, m.tied, m.tied_holders, m.stage, m.tp, m.dp, m.zero_replicas);
  const bool zero = m.plan.zero().stage() > 0;
  std::vector<SlicedTensor> pieces;
  c10::NoGradGuard no_grad;
  TRIDENT_RETURN_IF_ERROR(m.update->WaitForUpdatedParameters());  // no all-gather writes them meanwhile
  TRIDENT_ASSIGN_OR_RETURN(std::vector<ParameterPart> parts, m.update->Parts());
  // Values: whole parameters where this rank holds them whole, else its parts.
  std::set<const c10::TensorImpl*> only_chunk;
  for (const ParameterPart& part : parts) {
    if (part.only_chunk) only_chunk.insert(part.parameter.unsafeGetTensorImpl());
  }
  if (zero) {  // ZeRO's parts are disjoint over data parallelism
    for (const ParameterPart& part : parts) {
      const std::string& name = index.Name(part.parameter);
      if (part.begin == part.end || (deduplicate && index.WrittenElsewhere(name, true))) continue;
      pieces.push_back(
          {name, index.PartSlice(name, part), internal::FlatPart(part.values, part.offset, part.end - part.begin)});
    }
  }
  for (const auto& [name, p] : m.parameters) {  // whole: frozen ones (if saved), all without ZeRO
    if (p.requires_grad() ? zero : !m.plan.save_frozen()) continue;
    if (deduplicate && index.WrittenElsewhere(name, false)) continue;
    pieces.push_back({name, index.ParameterSlice(name, p.sizes().vec()), p.detach()});
  }
  if (!optimizer) return pieces;
  torch::optim::Optimizer& opt = m.update->optimizer();
  if (!ElementwiseStateNames(opt).ok()) {  // kept as the optimizer serializes itself, for this layout only
    for (auto& [name, blob] : m.update->State()) {
      pieces.push_back({absl::StrCat(kSerializedOptimizer, Layout(), "/rank_", m.topology->rank()),
                        TensorSlice::Whole(blob.sizes().vec()), blob});
    }
  } else {
    for (const ParameterPart& part : parts) {
      const std::string& name = index.Name(part.parameter);
      if (part.begin == part.end || (deduplicate && index.WrittenElsewhere(name, zero))) continue;
      const TensorSlice slice = index.PartSlice(name, part);
      TRIDENT_ASSIGN_OR_RETURN(auto state_of_part, m.update->OptimizerStateOf(part.updated));
      for (const auto& [state, tensor] : state_of_part) {
        if (tensor.dim() == 0) {  // the step count: by the holder of the first element of the first shard
          const bool first = part.begin == 0 && (m.tp == nullptr || m.tp->rank() == 0 || !m.shards.count(name));
          if (first || !deduplicate) pieces.push_back({StateName(name, state), TensorSlice::Whole({}), tensor});
        } else {
          pieces.push_back(
              {StateName(name, state), slice, internal::FlatPart(tensor, part.offset, part.end - part.begin)});
        }
      }
    }
  }
  if (m.scaler && (!deduplicate || m.topology->rank() == 0)) {
    for (auto& [name, tensor] : m.scaler->State()) {
      pieces.push_back({name, TensorSlice::Whole(tensor.sizes().vec()), tensor});
    }
  }
  return pieces;
}

absl::Status ParallelModel::LoadCheckpointPieces(const CheckpointReader& reader, bool optimizer) {
  Impl& m = *impl_;
  internal::PieceIndex index(m.parameters, m.shards, m.tied, m.tied_holders, m.stage, m.tp, m.dp, m.zero_replicas);
  TRIDENT_RETURN_IF_ERROR(m.update->WaitForUpdatedParameters());  // none overwrites what is read
  TRIDENT_ASSIGN_OR_RETURN(std::vector<ParameterPart> parts, m.update->Parts());
  std::set<const c10::TensorImpl*> only_chunk;
  c10::NoGradGuard no_grad;
  // Reads the slice of `name` into the contiguous `into` (any device).
  auto read = [&](const std::string& name, const TensorSlice& slice, at::Tensor into) -> absl::Status {
    at::Tensor staged = into.device().is_cpu() && into.is_contiguous()
                            ? into
                            : at::empty(into.sizes(), into.options().device(at::kCPU));
    TRIDENT_RETURN_IF_ERROR(reader.Read(name, slice, staged));
    if (!staged.is_same(into)) into.copy_(staged);
    return absl::OkStatus();
  };
  for (const ParameterPart& part : parts) {
    if (!part.only_chunk) continue;
    only_chunk.insert(part.parameter.unsafeGetTensorImpl());
    if (part.begin == part.end) continue;
    const std::string& name = index.Name(part.parameter);
    TRIDENT_RETURN_IF_ERROR(
        read(name, index.PartSlice(name, part), internal::FlatPart(part.values, part.offset, part.end - part.begin)));
  }
  for (auto& [name, p] : m.parameters) {
    if (only_chunk.count(p.unsafeGetTensorImpl())) continue;
    if (!p.requires_grad() && !reader.Contains(name)) continue;  // frozen: as the source built it
    TRIDENT_RETURN_IF_ERROR(read(name, index.ParameterSlice(name, p.sizes().vec()), p.detach()));
  }
  if (!optimizer) return absl::OkStatus();
  torch::optim::Optimizer& opt = m.update->optimizer();
  auto names = ElementwiseStateNames(opt);
  if (!names.ok()) {
    const std::string mine = absl::StrCat(kSerializedOptimizer, Layout(), "/rank_", m.topology->rank());
    if (!reader.Contains(mine)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint ", reader.path(), " has no optimizer state for this layout (", Layout(), ", rank ",
          m.topology->rank(), "); this optimizer's state is not element-wise (", names.status().message(),
          ") so it resumes only in the layout it was saved with; or load the weights alone (no_load_optim)"));
    }
    TRIDENT_ASSIGN_OR_RETURN(at::Tensor blob, reader.ReadWhole(mine));
    TRIDENT_RETURN_IF_ERROR(m.update->LoadState({{"optimizer", blob}}));
  } else {
    // The state of each tensor the optimizer updates, assembled from its parts
    // (consecutive) and set once they all are: one such tensor at a time.
    std::map<const c10::TensorImpl*, std::map<std::string, at::Tensor>> states;
    std::vector<std::string> missing;
    size_t assembled = 0;
    auto set_assembled = [&](size_t end) -> absl::Status {
      for (; assembled < end; ++assembled) {
        auto found = states.find(parts[assembled].updated.unsafeGetTensorImpl());
        if (found == states.end()) continue;
        const bool last =
            assembled + 1 == parts.size() || !parts[assembled + 1].updated.is_same(parts[assembled].updated);
        if (!last) continue;
        TRIDENT_RETURN_IF_ERROR(m.update->SetOptimizerStateOf(parts[assembled].updated, found->second));
        states.erase(found);
      }
      return absl::OkStatus();
    };
    for (size_t i = 0; i < parts.size(); ++i) {
      const ParameterPart& part = parts[i];
      TRIDENT_RETURN_IF_ERROR(set_assembled(i));
      if (part.begin == part.end) continue;
      const std::string& name = index.Name(part.parameter);
      const bool saved =
          reader.Contains(StateName(name, "exp_avg")) || reader.Contains(StateName(name, "momentum_buffer"));
      if (!saved) {  // saved before its first update, or without optimizer state
        if (!names->empty()) missing.push_back(name);
        continue;
      }
      std::map<std::string, at::Tensor>& state = states[part.updated.unsafeGetTensorImpl()];
      for (const std::string& key : *names) {
        if (key == "step") {
          TRIDENT_ASSIGN_OR_RETURN(at::Tensor step, reader.ReadWhole(StateName(name, key)));
          state[key] = step.to(at::kLong);
          continue;
        }
        at::Tensor& whole = state[key];
        if (!whole.defined()) whole = at::zeros_like(part.updated, at::MemoryFormat::Contiguous);
        TRIDENT_RETURN_IF_ERROR(read(StateName(name, key), index.PartSlice(name, part),
                                     internal::FlatPart(whole, part.offset, part.end - part.begin)));
      }
    }
    if (!missing.empty() && missing.size() < parts.size()) {
      return absl::DataLossError(absl::StrCat("checkpoint ", reader.path(),
                                              " holds optimizer state for some parameters but not for ",
                                              absl::StrJoin(missing, ", ")));
    }
    TRIDENT_RETURN_IF_ERROR(set_assembled(parts.size()));
  }
  if (m.scaler && reader.Contains("amp/loss_scale")) {
    NamedTensors state;
    for (const char* name : {"amp/loss_scale", "amp/hysteresis_left", "amp/clean_steps"}) {
      TRIDENT_ASSIGN_OR_RETURN(at::Tensor t, reader.ReadWhole(name));
      state.emplace_back(name, t);
    }
    TRIDENT_RETURN_IF_ERROR(m.scaler->LoadState(state));
  }
  return absl::OkStatus();
}

absl::StatusOr<NamedTensors> MergePieces(const ProcessGroup& group, const std::vector<SlicedTensor>& pieces) {
  constexpr char kSeparator = '\t';  // between a name and its slice on the wire
  if (group.rank() != 0) {
    NamedTensors sent;
    for (const SlicedTensor& piece : pieces) {
      sent.emplace_back(absl::StrCat(piece.name, std::string(1, kSeparator), piece.slice.Encode()), piece.data);
    }
    TRIDENT_RETURN_IF_ERROR(internal::SendNamedTensors(group, 0, sent));
    return NamedTensors();
  }
  NamedTensors merged;
  std::map<std::string, size_t> position;
  std::map<std::string, at::Tensor> covered;
  auto add = [&](const SlicedTensor& piece) {
    auto [found, fresh] = position.emplace(piece.name, merged.size());
    if (fresh) {
      merged.emplace_back(piece.name, at::empty(piece.slice.full_shape, piece.data.options().device(at::kCPU)));
      covered[piece.name] = at::zeros({merged.back().second.numel()}, at::kByte);
    }
    at::Tensor flat = merged[found->second].second.view({-1});
    CopyOverlap(piece.slice, piece.data.cpu().reshape({-1}), TensorSlice::Whole(piece.slice.full_shape), flat,
                &covered[piece.name]);
  };
  for (const SlicedTensor& piece : pieces) add(piece);
  for (int rank = 1; rank < group.size(); ++rank) {
    TRIDENT_ASSIGN_OR_RETURN(NamedTensors received, internal::RecvNamedTensors(group, rank));
    for (auto& [label, data] : received) {
      const size_t split = label.find(kSeparator);
      TRIDENT_ASSIGN_OR_RETURN(TensorSlice slice, TensorSlice::Decode(label.substr(split + 1)));
      add({label.substr(0, split), std::move(slice), data});
    }
  }
  for (const auto& [name, mask] : covered) {
    if (mask.min().item<int>() == 0) {
      return absl::InternalError(absl::StrCat("merging the checkpoint: no rank sent all of tensor '", name, "'"));
    }
  }
  return merged;
}

}  // namespace trident
