#include "trainer/config.h"

#include <algorithm>
#include <optional>
#include <set>

#include <google/protobuf/descriptor.h>
#include <google/protobuf/text_format.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/status.h"
#include "base/text_proto.h"

namespace trident {
namespace {

using google::protobuf::FieldDescriptor;

absl::Status Invalid(const std::string& message) { return absl::InvalidArgumentError(message); }

// Where a flag's value goes: `field` of `message`.
struct FlagTarget {
  google::protobuf::Message* message = nullptr;
  const FieldDescriptor* field = nullptr;
};

// The field a dotted flag names ("model_config.args.n_layer",
// "optimizer_config.type"): messages on the path are created, a map's key
// becomes its entry (the rest of the name, dots included) and the target is
// the entry's value. Unknown names are an error naming the part at fault.
absl::StatusOr<FlagTarget> DottedField(google::protobuf::Message* root, const std::string& name) {
  std::vector<std::string> parts = absl::StrSplit(name, '.');
  google::protobuf::Message* message = root;
  for (size_t i = 0; i < parts.size(); ++i) {
    const FieldDescriptor* field = message->GetDescriptor()->FindFieldByName(parts[i]);
    if (field == nullptr) {
      return Invalid(absl::StrCat("unknown flag --", name, ": ", message->GetDescriptor()->name(), " has no field '",
                                  parts[i], "' (see trainer/config.proto)"));
    }
    const auto* reflection = message->GetReflection();
    if (i + 1 == parts.size()) return FlagTarget{message, field};
    if (field->is_map()) {
      const std::string key = absl::StrJoin(parts.begin() + i + 1, parts.end(), ".");
      const FieldDescriptor* key_field = field->message_type()->FindFieldByName("key");
      for (int e = 0; e < reflection->FieldSize(*message, field); ++e) {
        google::protobuf::Message* entry = reflection->MutableRepeatedMessage(message, field, e);
        if (entry->GetReflection()->GetString(*entry, key_field) == key) {
          return FlagTarget{entry, field->message_type()->FindFieldByName("value")};
        }
      }
      google::protobuf::Message* entry = reflection->AddMessage(message, field);
      entry->GetReflection()->SetString(entry, key_field, key);
      return FlagTarget{entry, field->message_type()->FindFieldByName("value")};
    }
    if (field->cpp_type() != FieldDescriptor::CPPTYPE_MESSAGE || field->is_repeated()) {
      return Invalid(absl::StrCat("flag --", name, ": '", parts[i], "' is not a message, so it has no fields"));
    }
    message = reflection->MutableMessage(message, field);
  }
  return Invalid(absl::StrCat("flag --", name, " names no field"));
}

}  // namespace

absl::StatusOr<TrainerConfig> LoadTrainerConfig(const std::string& path) {
  TrainerConfig config;
  TRIDENT_RETURN_IF_ERROR(ReadTextProto(path, "config", &config));
  return config;
}

absl::Status ApplyConfigFlags(std::vector<std::string>* args, TrainerConfig* config) {
  const auto* descriptor = config->GetDescriptor();
  const auto* reflection = config->GetReflection();
  std::vector<std::string> rest;
  for (size_t i = 0; i < args->size(); ++i) {
    absl::string_view arg = (*args)[i];
    if (!absl::ConsumePrefix(&arg, "--")) {
      rest.push_back((*args)[i]);
      continue;
    }
    std::string name(arg.substr(0, arg.find('=')));
    const bool has_value = arg.find('=') != absl::string_view::npos;
    std::string value = has_value ? std::string(arg.substr(arg.find('=') + 1)) : "";
    google::protobuf::Message* target = config;
    const FieldDescriptor* field = descriptor->FindFieldByName(name);
    if (absl::StrContains(name, '.')) {
      TRIDENT_ASSIGN_OR_RETURN(FlagTarget dotted, DottedField(config, name));
      target = dotted.message;
      field = dotted.field;
    }
    if (field == nullptr && absl::StartsWith(name, "no") && !has_value) {
      const FieldDescriptor* negated = descriptor->FindFieldByName(name.substr(2));
      if (negated != nullptr && negated->type() == FieldDescriptor::TYPE_BOOL) {
        reflection->SetBool(config, negated, false);
        continue;
      }
    }
    if (field == nullptr) {
      rest.push_back((*args)[i]);
      continue;
    }
    if (!has_value) {
      if (field->type() == FieldDescriptor::TYPE_BOOL) {
        value = "true";
      } else if (i + 1 < args->size()) {
        value = (*args)[++i];
      } else {
        return Invalid(absl::StrCat("flag --", name, " needs a value"));
      }
    }
    if (field->type() == FieldDescriptor::TYPE_STRING && !field->is_repeated()) {
      target->GetReflection()->SetString(target, field, value);
    } else if (field->type() == FieldDescriptor::TYPE_STRING) {  // one more item of a list
      target->GetReflection()->AddString(target, field, value);
    } else if (!ParseTextFieldValue(value, field, target)) {
      return Invalid(absl::StrCat("flag --", name, "='", value, "' is not a valid ", field->type_name(), " value"));
    }
  }
  *args = std::move(rest);
  return absl::OkStatus();
}

std::vector<std::string> CommaList(const std::string& text) {
  std::vector<std::string> items;
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    items.emplace_back(absl::StripAsciiWhitespace(item));
  }
  return items;
}

absl::StatusOr<TensorParallelLayerLists> LayerListsFromConfig(const TrainerConfig& c) {
  const TrainerConfig::TensorParallelLayerLists& lists = c.tp_layer_lists();
  TensorParallelLayerLists layers;
  *layers.mutable_column() = lists.col_para_list();
  *layers.mutable_row() = lists.row_para_list();
  for (const std::string& entry : lists.input_output_mapping()) {
    std::vector<std::string> parts = absl::StrSplit(entry, ':');
    int64_t input = 0, output = 0;
    if (parts.size() != 3 || !absl::SimpleAtoi(parts[0], &input) || !absl::SimpleAtoi(parts[1], &output) || input < 1 ||
        output < 1 || (parts[2] != "col" && parts[2] != "row")) {
      return Invalid(absl::StrCat("tp_layer_lists.input_output_mapping '", entry,
                                  "' is not input:output:col or input:output:row (\"1:3:col\")"));
    }
    TensorParallelLayerLists::Mapping* m = layers.add_input_output_mapping();
    m->set_input(input);
    m->set_output(output);
    m->set_column(parts[2] == "col");
  }
  for (const std::string& entry : lists.weight_change_list()) {
    std::vector<std::string> parts = absl::StrSplit(entry, ':');
    if (parts.size() != 2 || (parts[1] != "0" && parts[1] != "1")) {
      return Invalid(absl::StrCat("tp_layer_lists.weight_change_list '", entry,
                                  "' is not name:0 (a linear weight's output features: column) or name:1 "
                                  "(its input features: row)"));
    }
    *(parts[1] == "0" ? layers.add_column() : layers.add_row()) = parts[0];
  }
  if (!lists.tp_attr_list().empty()) {
    return Invalid(absl::StrCat("tp_layer_lists.tp_attr_list names ", lists.tp_attr_list(0),
                                ": the automatic pass rewrites the sizes a split changes (head counts in "
                                "views) itself; leave tp_attr_list empty"));
  }
  return layers;
}

namespace {

// The layout the config's own fields give (its flat fields, then what its
// `plan` sets), before the rank count, a loaded strategy and the batch
// arithmetic have their say.
absl::StatusOr<ParallelPlan> PlanOfFields(const TrainerConfig& c) {
  ParallelPlan plan;
  plan.set_dp(c.dp());
  plan.set_tp(c.tp());
  plan.set_pp(c.pp());
  SetStrings(plan.mutable_axis_order(), CommaList(c.axis_order()));
  for (const std::string& rank : CommaList(c.rank_order())) {
    int value = -1;  // ResolveConfig refuses what does not parse
    plan.add_rank_order(absl::SimpleAtoi(rank, &value) ? value : -1);
  }
  plan.mutable_tensor_parallel()->set_sequence_parallel(c.sequence_parallel());
  plan.mutable_tensor_parallel()->set_overlapping_level(c.tp_overlapping_level());
  plan.mutable_tensor_parallel()->set_split_all(c.tp_split_all());
  *plan.mutable_tensor_parallel()->mutable_layer_lists() = LayerListsFromConfig(c).value_or(TensorParallelLayerLists());
  plan.set_virtual_stages(c.virtual_stages());
  plan.mutable_pipeline()->set_schedule(c.schedule());
  plan.mutable_trace()->set_split_method(c.split_method());
  plan.mutable_trace()->set_shard_count(c.shard_count());
  plan.mutable_pipeline()->set_partition_method(c.partition_method());
  SetStrings(plan.mutable_pipeline()->mutable_custom_split_points(), CommaList(c.custom_split_points()));
  TRIDENT_ASSIGN_OR_RETURN(TraceSpec::Method trace, ParseEnum<TraceSpec::Method>("trace_method", c.trace_method()));
  plan.mutable_trace()->set_method(trace);
  SetStrings(plan.mutable_trace()->mutable_leaf_modules(), CommaList(c.leaf_modules()));
  SetStrings(plan.mutable_trace()->mutable_input_names(), CommaList(c.input_names()));
  plan.mutable_pipeline()->set_dealloc_pipeoutput(c.dealloc_pipeoutput());
  TRIDENT_ASSIGN_OR_RETURN(RecomputeSpec::Method recompute,
                           ParseEnum<RecomputeSpec::Method>("activation_checkpointing", c.activation_checkpointing()));
  plan.mutable_recompute()->set_method(recompute);
  SetStrings(plan.mutable_recompute()->mutable_layers(), CommaList(c.checkpoint_layers()));
  SetStrings(plan.mutable_recompute()->mutable_modules(), CommaList(c.checkpoint_modules()));
  SetStrings(plan.mutable_module_replace(), CommaList(c.module_replace()));
  plan.mutable_tensor_parallel()->set_parallel_vocab(c.parallel_vocab());
  plan.mutable_trace()->set_no_tie_modules(c.no_tie_modules());
  plan.mutable_recompute()->set_num_layers(c.checkpoint_num_layers());
  plan.mutable_recompute()->set_ratio(c.activation_checkpoint_ratio());
  plan.mutable_zero()->set_stage(c.zero_stage());
  plan.mutable_zero()->set_reduce_bucket_bytes(c.zero_reduce_bucket_size() * 4);  // elements of fp32
  plan.mutable_zero()->set_allgather_bucket_bytes(c.zero_allgather_bucket_size() * 4);
  plan.mutable_zero()->set_allow_untested_optimizer(c.zero_allow_untested_optimizer());
  plan.mutable_zero()->set_bucket_bytes(static_cast<int64_t>(c.bucket_size_mb() * (1 << 20)));
  if (c.prescale_gradients()) plan.mutable_zero()->set_gradient_predivide_factor(c.gradient_predivide_factor());
  plan.mutable_precision()->set_mode(c.precision());
  plan.mutable_precision()->set_table(c.precision_table());
  plan.mutable_precision()->set_loss_scaling(c.loss_scale() >= 0 || c.skip_if_nonfinite());
  // Without loss_scale: fp16's dynamic scaler, or skip_if_nonfinite's static 1.
  auto precision = MakePrecisionPolicy(c.precision(), c.precision_table());
  const bool fp16 = precision.ok() && precision->loss_scaling;
  plan.mutable_precision()->mutable_loss_scaler()->set_loss_scale(c.loss_scale() >= 0 ? c.loss_scale()
                                                                  : fp16              ? 0.0
                                                                                      : 1.0);
  plan.mutable_precision()->mutable_loss_scaler()->set_initial_scale_power(c.initial_scale_power());
  plan.mutable_precision()->mutable_loss_scaler()->set_loss_scale_window(c.loss_scale_window());
  plan.mutable_precision()->mutable_loss_scaler()->set_hysteresis(c.hysteresis());
  plan.mutable_precision()->mutable_loss_scaler()->set_min_loss_scale(c.min_loss_scale());
  TRIDENT_ASSIGN_OR_RETURN(ReductionSpec::Reduction gradients,
                           ParseEnum<ReductionSpec::Reduction>("grad_reduction", c.grad_reduction()));
  TRIDENT_ASSIGN_OR_RETURN(ReductionSpec::Reduction loss,
                           ParseEnum<ReductionSpec::Reduction>("loss_reduction", c.loss_reduction()));
  plan.mutable_reduction()->set_gradients(gradients);
  plan.mutable_reduction()->set_loss(loss);
  TRIDENT_ASSIGN_OR_RETURN(ParallelPlan::Device device, ParseEnum<ParallelPlan::Device>("device", c.device()));
  plan.set_device(device);
  plan.set_micro_batch_size(c.micro_batch_size());
  plan.set_num_micro_batches(std::max<int64_t>(1, c.grad_accumulation_steps()));
  plan.set_seed(c.seed());
  if (!c.lora_config().empty()) {  // ValidateConfig reports a file that does not read
    auto lora = ReadLoraConfig(c.lora_config(), c.adapter_name());
    if (lora.ok()) *plan.mutable_lora() = *std::move(lora);
    plan.set_save_frozen(c.lora_save_base());
  }
  OverlaySetFields(c.plan(), &plan);  // --plan.* wins over the flat aliases
  return plan;
}

// The automatic mode's fields, and the plan the search starts from: one rank
// holding the whole global batch.
absl::Status ResolveAutomaticStrategy(const TrainerConfig& c, ParallelPlan* plan) {
  if (c.strategy() != "auto")
    return Invalid(absl::StrCat("strategy='", c.strategy(), "' is unknown; use auto (or leave it empty)"));
  if (!c.load_strategy().empty() && !c.finetune_strategy()) {
    return Invalid(
        "strategy=auto with load_strategy: the loaded strategy already decides; add "
        "--finetune_strategy to search around it, or drop --strategy=auto");
  }
  if (c.run_mode() != "run" && c.run_mode() != "compile") {
    return Invalid(absl::StrCat("run_mode='", c.run_mode(), "' is unknown; choose run or compile"));
  }
  const std::set<std::string> reuse = {"auto", "match", "override", "moo"};
  if (!reuse.count(c.strategy_reuse())) {
    return Invalid(
        absl::StrCat("strategy_reuse='", c.strategy_reuse(), "' is unknown; choose auto, match, override or moo"));
  }
  const std::set<std::string> methods = {"data", "tensor_parallel", "pipeline_parallel", "zero1", "zero2",
                                         "fsdp", "checkpoint",      "amp_native"};
  for (const std::string& method : CommaList(c.strategy_excluded())) {
    if (!methods.count(method)) {
      return Invalid(
          absl::StrCat("strategy_excluded names '", method, "'; the methods are ", absl::StrJoin(methods, ", ")));
    }
  }
  if (c.memory_limit_mb() < 0 || !(c.strategy_time_limit_s() > 0) || c.strategy_dry_runs() < 0) {
    return Invalid(
        "memory_limit_mb and strategy_dry_runs must not be negative and strategy_time_limit_s must be positive");
  }
  const int64_t global = c.has_global_batch_size() ? c.global_batch_size() : GlobalBatchSize(*plan);
  if (global < 1) return Invalid(absl::StrCat("global_batch_size=", global, " must be at least 1"));
  plan->set_dp(1);
  plan->set_tp(1);
  plan->set_pp(1);
  plan->set_micro_batch_size(global);
  plan->set_num_micro_batches(1);
  return absl::OkStatus();
}

// dp x tp x pp on `world_size` ranks (dp following them under elastic, or as
// a loaded strategy lays them out) and the micro-batches of the global batch.
absl::Status ResolveLayout(const TrainerConfig& c, int world_size, ParallelPlan* plan) {
  if (c.run_mode() != "run") {
    return Invalid(
        absl::StrCat("run_mode=", c.run_mode(), " needs strategy=auto (compile chooses a strategy and stops)"));
  }
  if (plan->dp() < 1 || plan->tp() < 1 || plan->pp() < 1) {
    return Invalid(
        absl::StrCat("dp=", plan->dp(), ", tp=", plan->tp(), ", pp=", plan->pp(), ": each must be at least 1"));
  }
  std::optional<int64_t> global, accumulation;
  if (c.has_global_batch_size()) global = c.global_batch_size();
  if (c.plan().has_num_micro_batches()) {
    accumulation = c.plan().num_micro_batches();
  } else if (c.has_grad_accumulation_steps()) {
    accumulation = c.grad_accumulation_steps();
  }
  if (!c.load_strategy().empty()) {
    TRIDENT_ASSIGN_OR_RETURN(Strategy strategy, LoadStrategy(c.load_strategy()));
    TRIDENT_RETURN_IF_ERROR(ApplyStrategy(strategy, world_size, plan));
    // The strategy's micro-batch count, else the config's.
    if (global) TRIDENT_RETURN_IF_ERROR(KeepGlobalBatch(*global, plan));
    accumulation = plan->num_micro_batches();
  }
  const int model_parallel = plan->tp() * plan->pp();
  if (c.elastic() && plan->dp() * model_parallel != world_size) {
    // Another rank count than the layout's: dp follows it, tp and pp and the global batch stay.
    if (world_size % model_parallel != 0) {
      return Invalid(absl::StrCat("elastic: ", world_size, " ranks cannot hold tp*pp = ", plan->tp(), "*", plan->pp(),
                                  " = ", model_parallel, "; start a multiple of ", model_parallel,
                                  " ranks or change tp and pp"));
    }
    if (!global) global = plan->micro_batch_size() * plan->dp() * accumulation.value_or(1);
    accumulation.reset();
    plan->set_dp(world_size / model_parallel);
  }
  if (plan->dp() * model_parallel != world_size) {
    return Invalid(absl::StrCat("dp*tp*pp = ", plan->dp(), "*", plan->tp(), "*", plan->pp(), " = ",
                                plan->dp() * model_parallel, " but ", world_size,
                                " ranks were started; make the product equal the number of "
                                "ranks, start train without a launcher to spawn dp*tp*pp, or set "
                                "elastic to let dp follow the rank count"));
  }
  if (plan->micro_batch_size() < 1) {
    return Invalid(absl::StrCat("micro_batch_size=", plan->micro_batch_size(), " must be at least 1"));
  }
  const int64_t per_step = plan->micro_batch_size() * plan->dp();
  if (global) {
    if (*global < 1 || *global % per_step != 0) {
      return Invalid(absl::StrCat("global_batch_size=", *global, " is not divisible by micro_batch_size*dp = ",
                                  plan->micro_batch_size(), "*", plan->dp(), " = ", per_step));
    }
    if (accumulation && *accumulation != *global / per_step) {
      return Invalid(absl::StrCat("global_batch_size=", *global, " and grad_accumulation_steps=", *accumulation,
                                  " disagree: with micro_batch_size=", plan->micro_batch_size(), " and dp=", plan->dp(),
                                  " the global batch needs ", *global / per_step,
                                  " accumulation steps; set only one of the two"));
    }
    accumulation = *global / per_step;
  }
  if (accumulation.value_or(1) < 1) {
    return Invalid(absl::StrCat("grad_accumulation_steps=", *accumulation, " must be at least 1"));
  }
  plan->set_num_micro_batches(accumulation.value_or(1));
  if (c.tp_plan_report() && plan->tp() < 2) {
    return Invalid("tp_plan_report prints the automatic tensor-parallel plan of a run with tp > 1; set tp");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckConfigFields(TrainerConfig* c) {
  TRIDENT_RETURN_IF_ERROR(LayerListsFromConfig(*c).status());
  if ((c->loss_scale() < 0 && c->loss_scale() != -1) || c->loss_scale_window() < 1 || c->hysteresis() < 1 ||
      !(c->min_loss_scale() > 0) || c->initial_scale_power() < 0 || c->initial_scale_power() > 100) {
    return Invalid(
        "loss_scale must be -1 (off), 0 (dynamic) or positive (static), loss_scale_window and hysteresis must be at "
        "least 1, min_loss_scale positive and initial_scale_power in [0, 100]");
  }
  if (!(c->lr() > 0)) return Invalid(absl::StrCat("lr=", c->lr(), " must be positive"));
  if (c->min_lr() < 0 || c->min_lr() > c->lr()) {
    return Invalid(absl::StrCat("min_lr=", c->min_lr(), " must be in [0, lr=", c->lr(), "]"));
  }
  if (!LrScheduleRegistry().Contains(c->lr_scheduler())) return LrScheduleRegistry().Find(c->lr_scheduler()).status();
  if (c->warmup_steps() < 0) return Invalid("warmup_steps must not be negative");
  if (GradientClip(*c) < 0) return Invalid("grad_clip must not be negative (0 turns it off)");
  if (c->max_steps() < 1) return Invalid(absl::StrCat("max_steps=", c->max_steps(), " must be at least 1"));
  if (c->max_epochs() < 0 || c->val_every_n_epochs() < 0) {
    return Invalid("max_epochs and val_every_n_epochs must not be negative");
  }
  if (c->eval_every() < 0 || c->eval_steps() < 1 || c->max_val_steps() < 0) {
    return Invalid("eval_every and max_val_steps must not be negative and eval_steps must be at least 1");
  }
  if (c->log_every() < 1) return Invalid("log_every must be at least 1");
  if (c->profile_step() < 0 || c->profile_step() > c->max_steps()) {
    return Invalid(absl::StrCat("profile_step=", c->profile_step(), " is not a step of this run (1 to max_steps=",
                                c->max_steps(), "; 0 turns profiling off)"));
  }
  if (c->profile_step() > 0) {
    c->set_trace_step(c->profile_step());
    if (c->trace_file().empty()) c->set_trace_file("trace.json");
  }
  if (c->save_every() < 0 || c->keep_last_n() < 0 || c->export_every() < 0) {
    return Invalid("save_every, keep_last_n and export_every must not be negative");
  }
  if ((c->save_every() > 0 || c->resume_from() == "last" || c->resume_from() == "best") && c->save_dir().empty()) {
    return Invalid("save_every and resume_from=last|best need save_dir");
  }
  if (c->save_type() != "sharded" && c->save_type() != "deduped" && c->save_type() != "merged") {
    return Invalid(absl::StrCat("save_type='", c->save_type(), "' is not one of sharded, deduped, merged"));
  }
  if (c->save_failure() != "fail" && c->save_failure() != "warn") {
    return Invalid(absl::StrCat("save_failure='", c->save_failure(), "' is not one of fail, warn"));
  }
  if (!(c->collective_timeout_s() > 0)) {
    return Invalid(absl::StrCat("collective_timeout_s=", c->collective_timeout_s(), " must be positive"));
  }
  if (c->max_restarts() < 0) return Invalid("max_restarts must not be negative");
  if (c->finetune() && c->resume_from().empty()) {
    return Invalid("finetune loads the weights of resume_from (a checkpoint); set resume_from");
  }
  if (!(c->temperature() > 0) || c->top_k() < 0 || c->sample_tokens() < 0 || c->out_seq_length() < 0) {
    return Invalid("temperature must be positive; top_k, sample_tokens and out_seq_length must not be negative");
  }
  for (const std::string& rank : CommaList(c->rank_order())) {
    int value = 0;
    if (!absl::SimpleAtoi(rank, &value)) {
      return Invalid(absl::StrCat("rank_order '", c->rank_order(), "': '", rank,
                                  "' is not a rank; list the rank at each mesh position, comma-separated"));
    }
  }
  if (!(c->bucket_size_mb() > 0)) return Invalid("bucket_size_mb must be positive");
  if (c->intra_op_threads() < 0) return Invalid("intra_op_threads must not be negative");
  if (!c->loss().empty() && !LossRegistry().Contains(c->loss())) {
    return LossRegistry().Find(c->loss()).status();
  }
  if (!c->lora_config().empty()) TRIDENT_RETURN_IF_ERROR(ReadLoraConfig(c->lora_config(), c->adapter_name()).status());
  if ((c->lora_merge_on_export() || c->lora_save_base()) && c->lora_config().empty()) {
    return Invalid("lora_merge_on_export and lora_save_base apply to LoRA runs; set lora_config");
  }
  return absl::OkStatus();
}

absl::StatusOr<ParallelPlan> ResolveConfig(TrainerConfig* c, int world_size) {
  TRIDENT_RETURN_IF_ERROR(CheckConfigFields(c));
  TRIDENT_ASSIGN_OR_RETURN(ParallelPlan plan, PlanOfFields(*c));
  if (!c->strategy().empty()) {
    TRIDENT_RETURN_IF_ERROR(ResolveAutomaticStrategy(*c, &plan));
  } else {
    TRIDENT_RETURN_IF_ERROR(ResolveLayout(*c, world_size, &plan));
  }
  TRIDENT_RETURN_IF_ERROR(ValidatePlan(plan));
  return plan;
}

absl::Status KeepGlobalBatch(int64_t global, ParallelPlan* plan) {
  const int64_t per_micro_batch = plan->dp() * plan->num_micro_batches();
  if (global % per_micro_batch != 0) {
    return Invalid(absl::StrCat("strategy: global_batch_size=", global, " is not divisible by dp*micro_batches = ",
                                plan->dp(), "*", plan->num_micro_batches()));
  }
  plan->set_micro_batch_size(global / per_micro_batch);
  return absl::OkStatus();
}

absl::StatusOr<int> ConfigWorldSize(const TrainerConfig& c) {
  TRIDENT_ASSIGN_OR_RETURN(ParallelPlan plan, PlanOfFields(c));
  const int layout = plan.dp() * plan.tp() * plan.pp();
  if (c.load_strategy().empty()) return layout;
  TRIDENT_ASSIGN_OR_RETURN(Strategy strategy, LoadStrategy(c.load_strategy()));
  return StrategyWorldSize(strategy, layout);
}

int64_t GlobalBatchSize(const ParallelPlan& plan) {
  return plan.micro_batch_size() * plan.num_micro_batches() * plan.dp();
}

std::pair<std::string, ComponentArgs> ModelComponent(const TrainerConfig& c) {
  if (c.has_model_config()) {
    const std::string type = c.model_config().type();
    return {type, ComponentArgs(absl::StrCat("model '", type, "'"),
                                {c.model_config().args().begin(), c.model_config().args().end()})};
  }
  std::map<std::string, std::string> args;
  std::string type = c.model();
  if (absl::StartsWith(type, "torchscript:")) {
    args["path"] = type.substr(std::string("torchscript:").size());
    type = "torchscript";
  } else if (!c.preset().empty() || type == "gpt" || type == "llama" || type == "mlp") {
    args["preset"] = !c.preset().empty() ? c.preset() : absl::StrCat(type, "-tiny");
  }
  const auto* reflection = c.GetReflection();
  for (const char* field : {"n_layer", "n_head", "n_embd", "n_kv_head", "intermediate_size"}) {
    const auto* descriptor = c.GetDescriptor()->FindFieldByName(field);
    if (reflection->HasField(c, descriptor)) args[field] = absl::StrCat(reflection->GetInt64(c, descriptor));
  }
  if (c.has_block_size()) args["block_size"] = absl::StrCat(c.block_size());
  if (c.has_vocab_size()) args["vocab_size"] = absl::StrCat(c.vocab_size());
  if (c.has_dropout()) args["dropout"] = absl::StrCat(c.dropout());
  if (c.has_rope_theta()) args["rope_theta"] = absl::StrCat(c.rope_theta());
  if (c.init_method_std() > 0) args["init_method_std"] = absl::StrCat(c.init_method_std());
  if (c.no_tie_modules() && args.count("preset")) args["tie_word_embeddings"] = "false";  // the zoo unties itself
  return {type, ComponentArgs(absl::StrCat("model '", type, "'"), std::move(args))};
}

std::pair<std::string, ComponentArgs> OptimizerComponent(const TrainerConfig& c) {
  if (c.has_optimizer_config()) {
    const std::string type = c.optimizer_config().type();
    return {type, ComponentArgs(absl::StrCat("optimizer '", type, "'"),
                                {c.optimizer_config().args().begin(), c.optimizer_config().args().end()})};
  }
  return {"adamw", ComponentArgs("optimizer 'adamw'", {{"beta1", absl::StrCat(c.adam_beta1())},
                                                       {"beta2", absl::StrCat(c.adam_beta2())},
                                                       {"eps", absl::StrCat(c.adam_eps())},
                                                       {"weight_decay", absl::StrCat(c.weight_decay())}})};
}

double GradientClip(const TrainerConfig& c) {
  return c.has_optimizer_config() && c.optimizer_config().has_clip_gnorm() ? c.optimizer_config().clip_gnorm()
                                                                           : c.grad_clip();
}

std::string ConfigToText(const TrainerConfig& config) {
  // Fields with a default are printed even when unset, so the text is complete.
  TrainerConfig complete = config;
  const auto* reflection = complete.GetReflection();
  const auto* descriptor = complete.GetDescriptor();
  for (int i = 0; i < descriptor->field_count(); ++i) {
    const FieldDescriptor* field = descriptor->field(i);
    if (!field->has_default_value() || reflection->HasField(complete, field)) continue;
    switch (field->cpp_type()) {
      case FieldDescriptor::CPPTYPE_INT32:
        reflection->SetInt32(&complete, field, field->default_value_int32());
        break;
      case FieldDescriptor::CPPTYPE_INT64:
        reflection->SetInt64(&complete, field, field->default_value_int64());
        break;
      case FieldDescriptor::CPPTYPE_UINT64:
        reflection->SetUInt64(&complete, field, field->default_value_uint64());
        break;
      case FieldDescriptor::CPPTYPE_DOUBLE:
        reflection->SetDouble(&complete, field, field->default_value_double());
        break;
      case FieldDescriptor::CPPTYPE_BOOL:
        reflection->SetBool(&complete, field, field->default_value_bool());
        break;
      case FieldDescriptor::CPPTYPE_STRING:
        reflection->SetString(&complete, field, field->default_value_string());
        break;
      default:
        break;
    }
  }
  std::string text;
  google::protobuf::TextFormat::PrintToString(complete, &text);
  return text;
}

std::string ConfigChangesToText(const TrainerConfig& config) {
  TrainerConfig changes = config;
  const auto* reflection = changes.GetReflection();
  const auto* descriptor = changes.GetDescriptor();
  for (int i = 0; i < descriptor->field_count(); ++i) {
    const FieldDescriptor* field = descriptor->field(i);
    if (field->is_repeated() || field->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE ||
        !reflection->HasField(changes, field)) {
      continue;
    }
    std::string value, default_value;
    google::protobuf::TextFormat::PrintFieldValueToString(changes, field, -1, &value);
    google::protobuf::TextFormat::PrintFieldValueToString(TrainerConfig::default_instance(), field, -1, &default_value);
    if (value == default_value) reflection->ClearField(&changes, field);
  }
  google::protobuf::TextFormat::Printer printer;
  printer.SetSingleLineMode(true);
  std::string text;
  printer.PrintToString(changes, &text);
  return std::string(absl::StripAsciiWhitespace(text));
}

}  // namespace trident
