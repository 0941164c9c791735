// Checks of a ParallelPlan and a ModelSource, made before any rank builds anything.
#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "amp/amp.h"
#include "base/status.h"
#include "parallel/parallel.h"
#include "partition/partition.h"
#include "pipeline/pipeline.h"

namespace trident {

std::vector<MeshAxis> PlanMeshAxes(const ParallelPlan& plan) {
  const std::map<std::string, int> sizes = {{"tensor", plan.tp()}, {"pipeline", plan.pp()}, {"data", plan.dp()}};
  std::vector<MeshAxis> axes;
  for (const std::string& name : plan.axis_order().empty() ? std::vector<std::string>{"tensor", "pipeline", "data"}
                                                           : ToVector(plan.axis_order())) {
    auto size = sizes.find(name);
    if (size != sizes.end()) axes.push_back({name, size->second});
  }
  return axes;
}

std::vector<bool> RecomputedLayers(const RecomputeSpec& recompute, int v, int V,
                                   const std::vector<std::string>& layer_names, bool last_stage_recomputes) {
  const int64_t n = static_cast<int64_t>(layer_names.size());
  std::vector<bool> recomputed(n, false);
  if (v == V - 1 && !last_stage_recomputes) return recomputed;
  int64_t first_layers = 0;
  switch (recompute.method()) {
    case RecomputeSpec::none:
      break;
    case RecomputeSpec::full:
      first_layers = n;
      break;
    case RecomputeSpec::selected:
      for (int64_t i = 0; i < n; ++i) {
        for (const std::string& prefix : recompute.layers()) {
          if (absl::StartsWith(layer_names[i], prefix)) recomputed[i] = true;
        }
      }
      break;
    case RecomputeSpec::stage_aware:
      if (v < V - 1) {
        const int s = v + 1;  // 1-based, as the formula is written
        const double fraction = 1.0 - (1.0 - recompute.ratio()) * (V - 1) / (V - s);
        first_layers = std::clamp<int64_t>(std::llround(fraction * n), 0, n);
      }
      break;
  }
  for (int64_t i = 0; i < first_layers; ++i) recomputed[i] = true;
  return recomputed;
}

absl::Status ValidatePlan(const ParallelPlan& p) {
  auto invalid = [](auto... parts) { return absl::InvalidArgumentError(absl::StrCat(parts...)); };
  if (p.dp() < 1 || p.tp() < 1 || p.pp() < 1) {
    return invalid("dp=", p.dp(), ", tp=", p.tp(), ", pp=", p.pp(), ": each must be at least 1");
  }
  if (!p.axis_order().empty()) {
    std::vector<std::string> sorted = ToVector(p.axis_order());
    std::sort(sorted.begin(), sorted.end());
    if (sorted != std::vector<std::string>{"data", "pipeline", "tensor"}) {
      return invalid("axis_order=", absl::StrJoin(p.axis_order(), ","),
                     ": name each of tensor, pipeline and data once, the fastest-varying first");
    }
  }
  if (!p.rank_order().empty()) {
    TRIDENT_RETURN_IF_ERROR(
        DeviceMesh::Create(PlanMeshAxes(p), p.dp() * p.tp() * p.pp(), ToVector(p.rank_order())).status());
  }
  if (p.tensor_parallel().sequence_parallel() && p.tp() == 1) {
    return invalid("sequence_parallel needs tp > 1 (it splits the sequence over the tensor-parallel ranks)");
  }
  if (p.tensor_parallel().overlapping_level() < 0 || p.tensor_parallel().overlapping_level() > 2) {
    return invalid("tp_overlapping_level=", p.tensor_parallel().overlapping_level(),
                   ": 0 (none), 1 (sub-pipelined products inside each parallel layer) and 2 (sub-pipelined "
                   "transformer blocks) are implemented; 3 (overlap between blocks) is not");
  }
  if (p.tensor_parallel().overlapping_level() > 0 && p.tensor_parallel().sequence_parallel()) {
    return invalid("tp_overlapping_level=", p.tensor_parallel().overlapping_level(),
                   " overlaps the all-reduces of tensor parallelism; with sequence_parallel the layers "
                   "all-gather and reduce-scatter instead: set one of them off");
  }
  if (p.zero().stage() < 0 || p.zero().stage() > 3) {
    return invalid("zero_stage=", p.zero().stage(), " is unknown; choose 0, 1, 2 or 3");
  }
  if (p.zero().stage() == 3 && p.pp() > 1 && p.pipeline().schedule() == "zb_h1") {
    return invalid(
        "zero_stage=3 with schedule zb_h1: zb_h1 runs weight gradients after ZeRO-3 "
        "has released the layer's parameters; use zero_stage <= 2 or another schedule");
  }
  if (p.zero().reduce_bucket_bytes() < 1 || p.zero().allgather_bucket_bytes() < 1 || p.zero().bucket_bytes() < 1) {
    return invalid("bucket sizes must be positive");
  }
  if (p.zero().gather_bucket_bytes() < 0) {
    return invalid("zero gather_bucket_bytes=", p.zero().gather_bucket_bytes(),
                   " is negative: give a size in bytes, or 0 for a bucket per layer");
  }
  if (!(p.zero().gradient_predivide_factor() > 0)) return invalid("gradient_predivide_factor must be positive");
  TRIDENT_ASSIGN_OR_RETURN(const int shard_group_size, ZeroShardGroupSize(p.zero(), p.dp()));
  if (p.zero().stage() == 0 && (shard_group_size < p.dp() || p.zero().offload_optimizer() != ZeroSpec::none)) {
    return invalid(
        "zero_stage=0 has no shards to group or optimizer state of its own to offload: "
        "set zero_stage 1-3 with shard_group_size, num_shard_groups or offload_optimizer");
  }
  if (p.zero().offload_params() != ZeroSpec::none && p.zero().stage() != 3) {
    return invalid("offload_params=", ZeroSpec::Offload_Name(p.zero().offload_params()),
                   " moves ZeRO-3's parameter shards off the device: set zero_stage=3 (it is ", p.zero().stage(), ")");
  }
  if ((p.zero().wrap_size() > 0 || p.zero().min_num_params() != 0 || p.zero().limit_all_gathers()) &&
      p.zero().stage() != 3) {
    return invalid(
        "zero wrap (atorch_wrap_cls), min_num_params (atorch_size_based_min_num_params) and "
        "limit_all_gathers shape ZeRO-3's gather units: set zero_stage=3 (it is ",
        p.zero().stage(), ") or leave them out");
  }
  if (p.zero().min_num_params() < 0)
    return invalid("zero min_num_params=", p.zero().min_num_params(), " must be at least 0");
  if (p.zero().ignored_size() > 0 && p.zero().stage() != 3) {
    return invalid(
        "zero ignored (atorch_ignored_cls) keeps parameters whole under zero_stage=3; the other stages "
        "hold every parameter whole already: leave it out or set zero_stage=3");
  }
  if (p.zero().prefetch_layers() < 0 || p.zero().max_inflight_reduce_scatters() < 1) {
    return invalid("zero prefetch_layers=", p.zero().prefetch_layers(), " must be at least 0 and ",
                   "max_inflight_reduce_scatters=", p.zero().max_inflight_reduce_scatters(), " at least 1");
  }
  if (p.micro_batch_size() < 1 || p.num_micro_batches() < 1) {
    return invalid("micro_batch_size=", p.micro_batch_size(), " and the number of micro-batches (",
                   p.num_micro_batches(), ") must be at least 1");
  }
  if (p.reduction().loss() == ReductionSpec::per_token_mean) {
    return invalid(
        "loss_reduction=per_token_mean: the reported loss is the mean or the sum; per_token_mean is for "
        "grad_reduction");
  }
  if (!p.trace().split_method().empty() && p.trace().split_method() != "layer_split" &&
      !SplitMethodRegistry().Contains(p.trace().split_method())) {
    return invalid(SplitMethodRegistry().Find(p.trace().split_method()).status().message(),
                   ", or layer_split for a LayerSequence");
  }
  if ((p.recompute().method() == RecomputeSpec::selected) != !p.recompute().layers().empty()) {
    return invalid(
        "activation_checkpointing=selected recomputes the layers checkpoint_layers names; "
        "give both or neither");
  }
  if (p.recompute().num_layers() < 1 || p.recompute().ratio() < 0 || p.recompute().ratio() > 1) {
    return invalid("checkpoint_num_layers must be at least 1 and activation_checkpoint_ratio in [0, 1]");
  }
  TRIDENT_ASSIGN_OR_RETURN(PrecisionPolicy precision, MakePrecisionPolicy(p.precision().mode(), p.precision().table()));
  if (p.device() == ParallelPlan::cpu && (precision.compute == at::kHalf || precision.param == at::kHalf)) {
    return absl::UnimplementedError(
        absl::StrCat("precision=", p.precision().mode(),
                     " computes or stores float16, which needs a GPU; on CPU, whose "
                     "kernels lack float16 (LayerNorm, matrix products), use bf16 or pure_bf16 (or device=cuda)"));
  }
  TRIDENT_ASSIGN_OR_RETURN(auto schedule, MakeSchedule(p.pipeline().schedule(), p.virtual_stages()));
  if (p.pp() == 1 && schedule->num_chunks() > 1) {
    return invalid("schedule ", p.pipeline().schedule(), " with virtual_stages=", p.virtual_stages(), " needs pp > 1");
  }
  if (p.pp() > 1) TRIDENT_RETURN_IF_ERROR(schedule->Check(p.pp(), static_cast<int>(p.num_micro_batches())));
  if (!p.pipeline().custom_split_points().empty() && static_cast<int64_t>(p.pipeline().custom_split_points().size()) !=
                                                         static_cast<int64_t>(p.pp()) * p.virtual_stages() - 1) {
    return invalid("custom_split_points names ", p.pipeline().custom_split_points().size(),
                   " layer(s) but pp*virtual_stages = ", p.pp() * p.virtual_stages(), " stages need ",
                   p.pp() * p.virtual_stages() - 1, " (the first layer of every stage after the first)");
  }
  return absl::OkStatus();
}

absl::Status CheckSource(const ModelSource& source, const ParallelPlan& plan) {
  const bool layers = source.kind == ModelSource::Kind::kLayers ||
                      (source.kind == ModelSource::Kind::kModule && plan.trace().method() == TraceSpec::layers);
  const int64_t stages = static_cast<int64_t>(plan.pp()) * plan.virtual_stages();
  if (plan.tp() > 1 && !layers && plan.trace().method() != TraceSpec::jit) {
    return absl::InvalidArgumentError(
        "tp > 1 splits a module's layers through its traced graph; trace it (trace_method=jit), or "
        "build its layers tensor-parallel (ParallelLinear and ApplyTensorParallel) as a LayerSequence");
  }
  if (source.kind == ModelSource::Kind::kLayers) {
    if (!plan.trace().split_method().empty() && plan.trace().split_method() != "layer_split") {
      return absl::InvalidArgumentError(
          absl::StrCat("split_method=", plan.trace().split_method(),
                       " cuts traced graphs; this model is a layer "
                       "sequence, cut at layer boundaries: use layer_split (with custom_split_points to choose "
                       "the cuts)"));
    }
    if (source.num_layers < stages) {
      return absl::InvalidArgumentError(absl::StrCat("pp*virtual_stages = ", stages,
                                                     " pipeline stages but the model has ", source.num_layers,
                                                     " layers; lower pp or virtual_stages or use a deeper model"));
    }
  }
  if (source.kind == ModelSource::Kind::kTorchScript && !std::ifstream(source.torchscript_path)) {
    return absl::NotFoundError(
        absl::StrCat("cannot read TorchScript file ", source.torchscript_path, " (save one with torch.jit.save)"));
  }
  if (!layers && plan.trace().split_method() == "layer_split") {
    return absl::InvalidArgumentError(
        "split_method=layer_split cuts a LayerSequence at layer boundaries; a traced model is cut "
        "with farthest_min_deps or nearest_min_deps (or declare it as a LayerSequence and use "
        "trace_method=layers)");
  }
  if (plan.trace().method() == TraceSpec::none && !layers && stages > 1) {
    return absl::InvalidArgumentError(
        "trace_method=none runs the model whole, untraced: it cannot be cut into pipeline stages; "
        "use pp=1, or trace_method=jit");
  }
  return absl::OkStatus();
}

}  // namespace trident
