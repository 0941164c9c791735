#include "strategy/strategy.h"

#include <algorithm>
#include <fstream>
#include <map>
#include <set>

#include <google/protobuf/text_format.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "base/text_proto.h"
#include "zero/zero.h"

namespace trident {
namespace {

using google::protobuf::FieldDescriptor;

absl::Status Invalid(const std::string& message) { return absl::InvalidArgumentError(message); }

// The fields each method may set (besides its name).
const std::map<std::string, std::set<std::string>>& MethodFields() {
  static const auto* fields = new std::map<std::string, std::set<std::string>>{
      {"parallel_mode", {"parallel_mode", "rank_order"}},
      {"amp_native",
       {"dtype", "skip_if_nonfinite", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
        "min_loss_scale"}},
      {"half", {"dtype", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"}},
      {"zero1", {"offload_optimizer"}},
      {"zero2", {"offload_optimizer"}},
      {"fsdp", {"wrap", "min_num_params", "ignored", "offload_optimizer", "offload_params", "limit_all_gathers"}},
      {"checkpoint", {"layers", "activation_checkpoint_ratio", "checkpoint_num_layers", "modules", "all_layers"}},
      {"module_replace", {"pairs"}},
      {"tensor_parallel", {"sequence_parallel", "overlapping_level"}},
      {"pipeline_parallel", {"schedule", "micro_batches", "virtual_stages", "split_method", "partition_method"}},
      {"mixed_parallel", {}},
  };
  return *fields;
}

// Checks each method's name and fields, and that no method comes twice.
absl::Status CheckMethods(const Strategy& strategy) {
  std::set<std::string> seen;
  for (const OptimizationMethod& method : strategy.methods()) {
    auto allowed = MethodFields().find(method.name());
    if (allowed == MethodFields().end()) {
      std::vector<std::string> names;
      for (const auto& [name, fields] : MethodFields()) names.push_back(name);
      return Invalid(
          absl::StrCat("strategy: unknown method '", method.name(), "'; choose ", absl::StrJoin(names, ", ")));
    }
    if (!seen.insert(method.name()).second) {
      return Invalid(absl::StrCat("strategy: method '", method.name(), "' is given twice"));
    }
    std::vector<const FieldDescriptor*> set;
    method.GetReflection()->ListFields(method, &set);
    for (const FieldDescriptor* field : set) {
      if (field->name() != "name" && !allowed->second.count(field->name())) {
        return Invalid(absl::StrCat("strategy: method '", method.name(), "' takes no '", field->name(), "'"));
      }
    }
  }
  return absl::OkStatus();
}

// The loss scaler `method` (amp_native or half) gives over the defaults;
// `static_one`: bf16's skip, whose scale is a static 1 unless given.
LossScalerSpec ScalerOf(const OptimizationMethod& method, bool static_one) {
  LossScalerSpec scaler;
  if (static_one) scaler.set_loss_scale(1);
  if (method.has_loss_scale()) scaler.set_loss_scale(method.loss_scale());
  if (method.has_initial_scale_power()) scaler.set_initial_scale_power(method.initial_scale_power());
  if (method.has_loss_scale_window()) scaler.set_loss_scale_window(method.loss_scale_window());
  if (method.has_hysteresis()) scaler.set_hysteresis(method.hysteresis());
  if (method.has_min_loss_scale()) scaler.set_min_loss_scale(method.min_loss_scale());
  return scaler;
}

// Records `scaler` on `method` where it differs from ScalerOf's defaults.
void RecordScaler(const LossScalerSpec& scaler, bool static_one, OptimizationMethod* method) {
  const LossScalerSpec defaults = ScalerOf(OptimizationMethod(), static_one);
  if (scaler.loss_scale() != defaults.loss_scale()) method->set_loss_scale(scaler.loss_scale());
  if (scaler.initial_scale_power() != defaults.initial_scale_power()) {
    method->set_initial_scale_power(scaler.initial_scale_power());
  }
  if (scaler.loss_scale_window() != defaults.loss_scale_window())
    method->set_loss_scale_window(scaler.loss_scale_window());
  if (scaler.hysteresis() != defaults.hysteresis()) method->set_hysteresis(scaler.hysteresis());
  if (scaler.min_loss_scale() != defaults.min_loss_scale()) method->set_min_loss_scale(scaler.min_loss_scale());
}

const std::vector<std::string>& DefaultAxisOrder() {
  static const auto* order = new std::vector<std::string>{"tensor", "pipeline", "data"};
  return *order;
}

// The layout of parallel_mode: sizes by axis name, data adjusted to the world
// size, the axes' order (empty where it lays the ranks out as the default
// order does) and the rank order (empty for the identity).
absl::Status ApplyParallelMode(const OptimizationMethod& method, int world_size, ParallelPlan* plan, bool* zero_axis) {
  std::map<std::string, int> sizes;
  std::vector<std::string> order;
  for (const ParallelAxis& axis : method.parallel_mode()) {
    if (axis.name() != "data" && axis.name() != "zero" && axis.name() != "tensor" && axis.name() != "pipeline") {
      return Invalid(absl::StrCat("strategy: parallel_mode axis '", axis.name(),
                                  "' is unknown; choose data, zero, tensor or pipeline"));
    }
    if (axis.size() < 1)
      return Invalid(absl::StrCat("strategy: parallel_mode axis '", axis.name(), "' has size ", axis.size()));
    if (!sizes.emplace(axis.name(), axis.size()).second) {
      return Invalid(absl::StrCat("strategy: parallel_mode names axis '", axis.name(), "' twice"));
    }
    const std::string name = axis.name() == "zero" ? "data" : axis.name();
    if (std::find(order.begin(), order.end(), name) == order.end()) order.push_back(name);
  }
  const int tp = sizes.count("tensor") ? sizes["tensor"] : 1;
  const int pp = sizes.count("pipeline") ? sizes["pipeline"] : 1;
  const bool hybrid = sizes.count("zero") && sizes.count("data");
  if (world_size % (tp * pp) != 0) {
    return Invalid(absl::StrCat("strategy: parallel_mode's tensor x pipeline = ", tp, " x ", pp,
                                " does not divide the ", world_size, " ranks"));
  }
  plan->set_tp(tp);
  plan->set_pp(pp);
  plan->set_dp(world_size / (tp * pp));  // data (or zero) takes the rest, as the reference adjusts it
  *zero_axis = sizes.count("zero") > 0;
  // Both: ZeRO shards over blocks of `zero` ranks, replicated over `data`.
  plan->mutable_zero()->set_shard_group_size(hybrid ? sizes["zero"] : 0);
  if (hybrid && plan->dp() % sizes["zero"] != 0) {
    return Invalid(absl::StrCat("strategy: parallel_mode's zero size ", sizes["zero"], " does not divide the ",
                                plan->dp(), " data-parallel ranks"));
  }
  for (const std::string& name : DefaultAxisOrder()) {
    if (std::find(order.begin(), order.end(), name) == order.end()) order.push_back(name);
  }
  // Axes of one rank do not change where ranks lie.
  const std::map<std::string, int> final_sizes = {
      {"tensor", plan->tp()}, {"pipeline", plan->pp()}, {"data", plan->dp()}};
  auto split = [&final_sizes](const std::vector<std::string>& names) {
    std::vector<std::string> kept;
    for (const std::string& name : names) {
      if (final_sizes.at(name) > 1) kept.push_back(name);
    }
    return kept;
  };
  SetStrings(plan->mutable_axis_order(),
             split(order) == split(DefaultAxisOrder()) ? std::vector<std::string>() : order);
  *plan->mutable_rank_order() = method.rank_order();
  bool identity = true;
  for (int i = 0; i < static_cast<int>(plan->rank_order().size()); ++i) identity &= plan->rank_order()[i] == i;
  if (identity && static_cast<int>(plan->rank_order().size()) == world_size) plan->clear_rank_order();
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Strategy> LoadStrategy(const std::string& path) {
  Strategy strategy;
  TRIDENT_RETURN_IF_ERROR(ReadTextProto(path, "strategy", &strategy));
  return strategy;
}

std::string StrategyToText(const Strategy& strategy) {
  std::string text;
  google::protobuf::TextFormat::PrintToString(strategy, &text);
  return text;
}

absl::Status SaveStrategy(const Strategy& strategy, const std::string& path) {
  std::ofstream out(path);
  out << StrategyToText(strategy);
  return out ? absl::OkStatus() : absl::InternalError(absl::StrCat("cannot write strategy file ", path));
}

absl::Status ApplyStrategy(const Strategy& strategy, int world_size, ParallelPlan* plan) {
  TRIDENT_RETURN_IF_ERROR(CheckMethods(strategy));
  std::map<std::string, const OptimizationMethod*> by_name;
  for (const OptimizationMethod& method : strategy.methods()) by_name[method.name()] = &method;
  auto has = [&](const char* name) { return by_name.count(name) > 0; };
  for (const auto& [a, b] : std::vector<std::pair<const char*, const char*>>{
           {"amp_native", "half"}, {"zero1", "zero2"}, {"zero1", "fsdp"}, {"zero2", "fsdp"}}) {
    if (has(a) && has(b))
      return Invalid(absl::StrCat("strategy: methods '", a, "' and '", b, "' do not go together; keep one"));
  }
  // Without parallel_mode: data parallelism over every rank.
  bool zero_axis = false;
  plan->set_dp(world_size);
  plan->set_tp(1);
  plan->set_pp(1);
  plan->clear_axis_order();
  plan->clear_rank_order();
  if (has("parallel_mode")) {
    TRIDENT_RETURN_IF_ERROR(ApplyParallelMode(*by_name["parallel_mode"], world_size, plan, &zero_axis));
  }
  plan->mutable_zero()->set_stage(has("zero1") ? 1 : has("zero2") ? 2 : has("fsdp") ? 3 : zero_axis ? 1 : 0);
  plan->mutable_zero()->set_offload_optimizer(ZeroSpec::none);
  plan->mutable_zero()->set_offload_params(ZeroSpec::none);
  auto parse_offload = [](const char* method, const char* field, const std::string& value,
                          ZeroSpec::Offload* offload) -> absl::Status {
    if (ZeroSpec::Offload_Parse(value, offload)) return absl::OkStatus();
    return Invalid(absl::StrCat("strategy: ", method, " ", field, " '", value, "'; choose none, cpu or disk"));
  };
  for (const char* zero : {"zero1", "zero2", "fsdp"}) {
    if (!has(zero)) continue;
    ZeroSpec::Offload offload;
    if (by_name[zero]->has_offload_optimizer()) {
      TRIDENT_RETURN_IF_ERROR(parse_offload(zero, "offload_optimizer", by_name[zero]->offload_optimizer(), &offload));
      plan->mutable_zero()->set_offload_optimizer(offload);
    }
    if (by_name[zero]->has_offload_params()) {
      TRIDENT_RETURN_IF_ERROR(parse_offload(zero, "offload_params", by_name[zero]->offload_params(), &offload));
      plan->mutable_zero()->set_offload_params(offload);
    }
  }
  plan->mutable_zero()->clear_ignored();
  plan->mutable_zero()->clear_wrap();
  plan->mutable_zero()->clear_min_num_params();
  plan->mutable_zero()->clear_limit_all_gathers();
  if (has("fsdp")) {
    const OptimizationMethod& fsdp = *by_name["fsdp"];
    *plan->mutable_zero()->mutable_ignored() = fsdp.ignored();
    *plan->mutable_zero()->mutable_wrap() = fsdp.wrap();
    if (fsdp.has_min_num_params()) plan->mutable_zero()->set_min_num_params(fsdp.min_num_params());
    if (fsdp.has_limit_all_gathers()) plan->mutable_zero()->set_limit_all_gathers(fsdp.limit_all_gathers());
  }
  if (has("amp_native")) {
    const OptimizationMethod& amp = *by_name["amp_native"];
    const std::string dtype = amp.has_dtype() ? amp.dtype() : "fp16";
    if (dtype != "bf16" && dtype != "fp16")
      return Invalid(absl::StrCat("strategy: amp_native dtype '", dtype, "'; choose bf16 or fp16"));
    plan->mutable_precision()->set_mode(dtype);
    // fp16 always scales its loss; bf16 only to skip steps whose gradients
    // are not finite (a static scale of 1 unless the method gives one).
    const bool skip = dtype == "bf16" && amp.skip_if_nonfinite();
    if (dtype == "bf16") plan->mutable_precision()->set_loss_scaling(skip);
    if (skip || dtype == "fp16") *plan->mutable_precision()->mutable_loss_scaler() = ScalerOf(amp, skip);
  }
  if (has("half")) {
    const OptimizationMethod& half = *by_name["half"];
    const std::string dtype = half.has_dtype() ? half.dtype() : "fp16";
    if (dtype != "bf16" && dtype != "fp16")
      return Invalid(absl::StrCat("strategy: half dtype '", dtype, "'; choose bf16 or fp16"));
    plan->mutable_precision()->set_mode("pure_" + dtype);
    if (dtype == "fp16") *plan->mutable_precision()->mutable_loss_scaler() = ScalerOf(half, /*static_one=*/false);
  }
  if (strategy.has_precision_table()) plan->mutable_precision()->set_table(strategy.precision_table());
  if (has("checkpoint")) {
    const OptimizationMethod& checkpoint = *by_name["checkpoint"];
    *plan->mutable_recompute()->mutable_layers() = checkpoint.layers();
    *plan->mutable_recompute()->mutable_modules() = checkpoint.modules();
    if (checkpoint.has_activation_checkpoint_ratio() && !plan->recompute().layers().empty()) {
      return Invalid("strategy: checkpoint takes layers or activation_checkpoint_ratio, not both");
    }
    if (checkpoint.all_layers() &&
        (checkpoint.has_activation_checkpoint_ratio() || !plan->recompute().layers().empty())) {
      return Invalid(
          "strategy: checkpoint's all_layers recomputes every layer; leave out layers and activation_checkpoint_ratio");
    }
    const bool modules_only = !plan->recompute().modules().empty() && !checkpoint.all_layers();
    plan->mutable_recompute()->set_method(!plan->recompute().layers().empty()            ? RecomputeSpec::selected
                                          : checkpoint.has_activation_checkpoint_ratio() ? RecomputeSpec::stage_aware
                                          : modules_only                                 ? RecomputeSpec::none
                                                                                         : RecomputeSpec::full);
    if (checkpoint.has_activation_checkpoint_ratio()) {
      plan->mutable_recompute()->set_ratio(checkpoint.activation_checkpoint_ratio());
    }
    if (checkpoint.has_checkpoint_num_layers())
      plan->mutable_recompute()->set_num_layers(checkpoint.checkpoint_num_layers());
  }
  if (has("module_replace")) {
    const OptimizationMethod& replace = *by_name["module_replace"];
    if (replace.pairs().empty()) {
      return Invalid("strategy: module_replace names no pairs; list them (pairs: \"fused_attention\" ...)");
    }
    *plan->mutable_module_replace() = replace.pairs();
  }
  if (has("tensor_parallel")) {
    if (plan->tp() == 1)
      return Invalid("strategy: tensor_parallel needs tensor ranks: add (\"tensor\", N) to parallel_mode");
    plan->mutable_tensor_parallel()->set_sequence_parallel(by_name["tensor_parallel"]->sequence_parallel());
    plan->mutable_tensor_parallel()->set_overlapping_level(by_name["tensor_parallel"]->overlapping_level());
  }
  if (has("pipeline_parallel")) {
    if (plan->pp() == 1)
      return Invalid("strategy: pipeline_parallel needs pipeline ranks: add (\"pipeline\", N) to parallel_mode");
    const OptimizationMethod& pipeline = *by_name["pipeline_parallel"];
    if (pipeline.has_schedule()) plan->mutable_pipeline()->set_schedule(pipeline.schedule());
    if (pipeline.has_micro_batches()) plan->set_num_micro_batches(pipeline.micro_batches());
    if (pipeline.has_virtual_stages()) plan->set_virtual_stages(pipeline.virtual_stages());
    if (pipeline.has_split_method()) plan->mutable_trace()->set_split_method(pipeline.split_method());
    if (pipeline.has_partition_method()) plan->mutable_pipeline()->set_partition_method(pipeline.partition_method());
    if (has("fsdp") && plan->pipeline().schedule() == "zb_h1") {
      return Invalid(
          "strategy: fsdp with pipeline_parallel schedule zb_h1 do not go together: zb_h1 runs "
          "weight gradients after ZeRO-3 released the layer; use zero2 or another schedule");
    }
  }
  if (strategy.has_gradient_accumulation_steps()) {
    if (plan->pp() > 1)
      return Invalid(
          "strategy: gradient_accumulation_steps is for layouts without pipeline ranks; give pipeline_parallel's "
          "micro_batches");
    if (strategy.gradient_accumulation_steps() < 1)
      return Invalid("strategy: gradient_accumulation_steps must be at least 1");
    plan->set_num_micro_batches(strategy.gradient_accumulation_steps());
  }
  if (has("mixed_parallel") && (plan->tp() == 1) + (plan->pp() == 1) + (plan->dp() == 1) > 1) {
    return Invalid("strategy: mixed_parallel needs at least two of data, tensor and pipeline ranks in parallel_mode");
  }
  return ValidatePlan(*plan);
}

Strategy StrategyFromPlan(const ParallelPlan& plan) {
  Strategy strategy;
  OptimizationMethod* mode = strategy.add_methods();
  mode->set_name("parallel_mode");
  const std::map<std::string, int> sizes = {{"tensor", plan.tp()}, {"pipeline", plan.pp()}, {"data", plan.dp()}};
  // In the default order axes of one rank are left out (data stays); an
  // explicit order names all three.
  // Hybrid sharding: the data ranks as ("zero", shard group size), ("data", groups).
  const int shard_group_size = ZeroShardGroupSize(plan.zero(), plan.dp()).value_or(plan.dp());
  for (const std::string& name : plan.axis_order().empty() ? DefaultAxisOrder() : ToVector(plan.axis_order())) {
    if (plan.axis_order().empty() && sizes.at(name) == 1 && name != "data") continue;
    const bool hybrid = name == "data" && plan.zero().stage() > 0 && shard_group_size < plan.dp();
    if (hybrid) {
      ParallelAxis* zero = mode->add_parallel_mode();
      zero->set_name("zero");
      zero->set_size(shard_group_size);
    }
    ParallelAxis* axis = mode->add_parallel_mode();
    axis->set_name(name);
    axis->set_size(hybrid ? plan.dp() / shard_group_size : sizes.at(name));
  }
  for (int rank : plan.rank_order()) mode->add_rank_order(rank);
  if (plan.zero().stage() > 0) {
    OptimizationMethod* zero = strategy.add_methods();
    zero->set_name(plan.zero().stage() == 1 ? "zero1" : plan.zero().stage() == 2 ? "zero2" : "fsdp");
    if (plan.zero().offload_optimizer() != ZeroSpec::none) {
      zero->set_offload_optimizer(ZeroSpec::Offload_Name(plan.zero().offload_optimizer()));
    }
    if (plan.zero().offload_params() != ZeroSpec::none) {
      zero->set_offload_params(ZeroSpec::Offload_Name(plan.zero().offload_params()));
    }
    *zero->mutable_ignored() = plan.zero().ignored();
    if (plan.zero().stage() == 3) {
      *zero->mutable_wrap() = plan.zero().wrap();
      if (plan.zero().min_num_params() > 0) zero->set_min_num_params(plan.zero().min_num_params());
      if (plan.zero().limit_all_gathers()) zero->set_limit_all_gathers(true);
    }
  }
  if (plan.precision().mode() == "bf16" || plan.precision().mode() == "fp16") {
    OptimizationMethod* amp = strategy.add_methods();
    amp->set_name("amp_native");
    amp->set_dtype(plan.precision().mode());
    const bool skip = plan.precision().mode() == "bf16" && plan.precision().loss_scaling();
    if (skip) amp->set_skip_if_nonfinite(true);
    if (skip || plan.precision().mode() == "fp16") RecordScaler(plan.precision().loss_scaler(), skip, amp);
  } else if (plan.precision().mode() == "pure_bf16" || plan.precision().mode() == "pure_fp16") {
    OptimizationMethod* half = strategy.add_methods();
    half->set_name("half");
    half->set_dtype(plan.precision().mode().substr(5));
    if (plan.precision().mode() == "pure_fp16")
      RecordScaler(plan.precision().loss_scaler(), /*static_one=*/false, half);
  }
  if (!plan.precision().table().empty()) strategy.set_precision_table(plan.precision().table());
  if (plan.recompute().method() != RecomputeSpec::none || !plan.recompute().modules().empty()) {
    OptimizationMethod* checkpoint = strategy.add_methods();
    checkpoint->set_name("checkpoint");
    for (const std::string& layer : plan.recompute().layers()) checkpoint->add_layers(layer);
    if (plan.recompute().method() == RecomputeSpec::stage_aware) {
      checkpoint->set_activation_checkpoint_ratio(plan.recompute().ratio());
    }
    if (plan.recompute().num_layers() != 1) checkpoint->set_checkpoint_num_layers(plan.recompute().num_layers());
    for (const std::string& module : plan.recompute().modules()) checkpoint->add_modules(module);
    if (plan.recompute().method() == RecomputeSpec::full && !plan.recompute().modules().empty())
      checkpoint->set_all_layers(true);
  }
  if (!plan.module_replace().empty()) {
    OptimizationMethod* replace = strategy.add_methods();
    replace->set_name("module_replace");
    for (const std::string& pair : plan.module_replace()) replace->add_pairs(pair);
  }
  if (plan.tp() > 1) {
    OptimizationMethod* tensor = strategy.add_methods();
    tensor->set_name("tensor_parallel");
    if (plan.tensor_parallel().sequence_parallel()) tensor->set_sequence_parallel(true);
    if (plan.tensor_parallel().overlapping_level() > 0)
      tensor->set_overlapping_level(plan.tensor_parallel().overlapping_level());
  }
  if (plan.pp() > 1) {
    OptimizationMethod* pipeline = strategy.add_methods();
    pipeline->set_name("pipeline_parallel");
    pipeline->set_schedule(plan.pipeline().schedule());
    pipeline->set_micro_batches(static_cast<int>(plan.num_micro_batches()));
    if (plan.virtual_stages() > 1) pipeline->set_virtual_stages(plan.virtual_stages());
    if (!plan.trace().split_method().empty()) pipeline->set_split_method(plan.trace().split_method());
    pipeline->set_partition_method(plan.pipeline().partition_method());
  } else if (plan.num_micro_batches() > 1) {
    strategy.set_gradient_accumulation_steps(static_cast<int>(plan.num_micro_batches()));
  }
  return strategy;
}

int StrategyWorldSize(const Strategy& strategy, int fallback) {
  for (const OptimizationMethod& method : strategy.methods()) {
    if (method.name() != "parallel_mode") continue;
    int world = 1;
    for (const ParallelAxis& axis : method.parallel_mode()) world *= std::max(1, axis.size());
    return world;
  }
  return fallback;
}

std::string DescribePlan(const ParallelPlan& plan) {
  std::vector<std::string> parts;
  for (const auto& [name, size] :
       std::vector<std::pair<const char*, int>>{{"dp", plan.dp()}, {"tp", plan.tp()}, {"pp", plan.pp()}}) {
    if (size > 1) parts.push_back(absl::StrCat(name, size));
  }
  std::string text = parts.empty() ? "1 rank" : absl::StrJoin(parts, " x ");
  if (plan.pp() > 1) {
    absl::StrAppend(&text, " ", plan.pipeline().schedule(),
                    plan.virtual_stages() > 1 ? absl::StrCat("x", plan.virtual_stages()) : "");
  }
  absl::StrAppend(&text, " mb", plan.micro_batch_size(), "x", plan.num_micro_batches());
  if (!plan.axis_order().empty()) absl::StrAppend(&text, " axes=", absl::StrJoin(plan.axis_order(), ","));
  if (!plan.rank_order().empty()) absl::StrAppend(&text, " ranks=", absl::StrJoin(plan.rank_order(), ","));
  if (plan.tensor_parallel().sequence_parallel()) absl::StrAppend(&text, " sp");
  if (plan.zero().stage() > 0) absl::StrAppend(&text, " zero", plan.zero().stage());
  const int shard_group_size = ZeroShardGroupSize(plan.zero(), plan.dp()).value_or(plan.dp());
  if (plan.zero().stage() > 0 && shard_group_size < plan.dp()) absl::StrAppend(&text, " shard", shard_group_size);
  if (plan.zero().stage() > 0 && plan.zero().offload_optimizer() != ZeroSpec::none) {
    absl::StrAppend(&text, " offload=", ZeroSpec::Offload_Name(plan.zero().offload_optimizer()));
  }
  if (plan.zero().stage() == 3 && plan.zero().offload_params() != ZeroSpec::none) {
    absl::StrAppend(&text, " offload_params=", ZeroSpec::Offload_Name(plan.zero().offload_params()));
  }
  if (plan.precision().mode() != "fp32") absl::StrAppend(&text, " ", plan.precision().mode());
  if (plan.recompute().method() != RecomputeSpec::none) {
    absl::StrAppend(&text, " recompute=", RecomputeSpec::Method_Name(plan.recompute().method()));
  }
  return text;
}

}  // namespace trident
