#include "trainer/config.h"

#include <optional>
#include <set>

#include <google/protobuf/descriptor.h>
#include <google/protobuf/text_format.h>

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

}  // namespace

TrainerConfig DefaultTrainerConfig() {
  TrainerConfig config;
  ParallelPlan* plan = config.mutable_plan();
  plan->set_dp(2);
  plan->set_micro_batch_size(8);
  plan->set_seed(1337);
  plan->mutable_zero()->set_reduce_bucket_bytes(int64_t{2000000000});  // DeepSpeed's 5e8 fp32 elements
  plan->mutable_zero()->set_allgather_bucket_bytes(int64_t{2000000000});
  return config;
}

absl::StatusOr<TrainerConfig> LoadTrainerConfig(const std::string& path) {
  TRIDENT_ASSIGN_OR_RETURN(std::string text, ReadTextFile(path, "config"));
  TrainerConfig config = DefaultTrainerConfig();
  auto rest = TranslateFlatConfig(text, &config);
  if (!rest.ok()) return Invalid(absl::StrCat("config file ", path, ": ", rest.status().message()));
  TRIDENT_RETURN_IF_ERROR(MergeTextProto(*rest, path, "config", &config));
  return config;
}

std::vector<std::string> CommaList(const std::string& text) {
  std::vector<std::string> items;
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    items.emplace_back(absl::StripAsciiWhitespace(item));
  }
  return items;
}

namespace {

// The automatic mode's fields, and the plan the search starts from: one rank
// holding the whole global batch.
absl::Status ResolveAutomaticStrategy(const TrainerConfig& c, ParallelPlan* plan) {
  const StrategySpec& s = c.strategy();
  if (s.search() != "auto")
    return Invalid(absl::StrCat("strategy='", s.search(), "' is unknown; use auto (or leave it empty)"));
  if (!s.load().empty() && !s.finetune()) {
    return Invalid(
        "strategy=auto with load_strategy: the loaded strategy already decides; add "
        "--finetune_strategy to search around it, or drop --strategy=auto");
  }
  if (s.run_mode() != "run" && s.run_mode() != "compile") {
    return Invalid(absl::StrCat("run_mode='", s.run_mode(), "' is unknown; choose run or compile"));
  }
  const std::set<std::string> reuse = {"auto", "match", "override", "moo"};
  if (!reuse.count(s.reuse())) {
    return Invalid(absl::StrCat("strategy_reuse='", s.reuse(), "' is unknown; choose auto, match, override or moo"));
  }
  const std::set<std::string> methods = {"data", "tensor_parallel", "pipeline_parallel", "zero1", "zero2",
                                         "fsdp", "checkpoint",      "amp_native"};
  for (const std::string& method : s.excluded()) {
    if (!methods.count(method)) {
      return Invalid(
          absl::StrCat("strategy_excluded names '", method, "'; the methods are ", absl::StrJoin(methods, ", ")));
    }
  }
  if (s.memory_limit_mb() < 0 || !(s.time_limit_s() > 0) || s.dry_runs() < 0) {
    return Invalid(
        "memory_limit_mb and strategy_dry_runs must not be negative and strategy_time_limit_s must be positive");
  }
  const int64_t global = c.loop().has_global_batch_size() ? c.loop().global_batch_size() : GlobalBatchSize(*plan);
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
  if (c.strategy().run_mode() != "run") {
    return Invalid(absl::StrCat("run_mode=", c.strategy().run_mode(),
                                " needs strategy=auto (compile chooses a strategy and stops)"));
  }
  if (plan->dp() < 1 || plan->tp() < 1 || plan->pp() < 1) {
    return Invalid(
        absl::StrCat("dp=", plan->dp(), ", tp=", plan->tp(), ", pp=", plan->pp(), ": each must be at least 1"));
  }
  std::optional<int64_t> global, accumulation;
  if (c.loop().has_global_batch_size()) global = c.loop().global_batch_size();
  if (c.plan().has_num_micro_batches()) accumulation = c.plan().num_micro_batches();
  if (!c.strategy().load().empty()) {
    TRIDENT_ASSIGN_OR_RETURN(Strategy strategy, LoadStrategy(c.strategy().load()));
    TRIDENT_RETURN_IF_ERROR(ApplyStrategy(strategy, world_size, plan));
    // The strategy's micro-batch count, else the config's.
    if (global) TRIDENT_RETURN_IF_ERROR(KeepGlobalBatch(*global, plan));
    accumulation = plan->num_micro_batches();
  }
  const int model_parallel = plan->tp() * plan->pp();
  if (c.runtime().elastic() && plan->dp() * model_parallel != world_size) {
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
  if (c.output().tp_plan_report() && plan->tp() < 2) {
    return Invalid("tp_plan_report prints the automatic tensor-parallel plan of a run with tp > 1; set tp");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckConfigFields(TrainerConfig* c) {
  const LossScalerSpec& scaler = c->plan().precision().loss_scaler();
  if (scaler.loss_scale() < 0 || scaler.loss_scale_window() < 1 || scaler.hysteresis() < 1 ||
      !(scaler.min_loss_scale() > 0) || scaler.initial_scale_power() < 0 || scaler.initial_scale_power() > 100) {
    return Invalid(
        "loss_scale must be -1 (off), 0 (dynamic) or positive (static), loss_scale_window and hysteresis must be at "
        "least 1, min_loss_scale positive and initial_scale_power in [0, 100]");
  }
  const LoopSpec& loop = c->loop();
  if (!(loop.lr() > 0)) return Invalid(absl::StrCat("lr=", loop.lr(), " must be positive"));
  if (loop.min_lr() < 0 || loop.min_lr() > loop.lr()) {
    return Invalid(absl::StrCat("min_lr=", loop.min_lr(), " must be in [0, lr=", loop.lr(), "]"));
  }
  if (!LrScheduleRegistry().Contains(loop.lr_scheduler()))
    return LrScheduleRegistry().Find(loop.lr_scheduler()).status();
  if (loop.warmup_steps() < 0 || loop.lr_decay_steps() < 0) {
    return Invalid("warmup_steps and lr_decay_steps must not be negative");
  }
  if (c->optimizer().clip_gnorm() < 0) return Invalid("grad_clip must not be negative (0 turns it off)");
  if (loop.max_steps() < 1) return Invalid(absl::StrCat("max_steps=", loop.max_steps(), " must be at least 1"));
  if (loop.max_epochs() < 0 || loop.val_every_n_epochs() < 0) {
    return Invalid("max_epochs and val_every_n_epochs must not be negative");
  }
  if (loop.eval_every() < 0 || loop.eval_steps() < 1 || loop.max_val_steps() < 0) {
    return Invalid("eval_every and max_val_steps must not be negative and eval_steps must be at least 1");
  }
  const OutputSpec& output = c->output();
  if (output.log_every() < 1) return Invalid("log_every must be at least 1");
  if (output.profile_step() < 0 || output.profile_step() > loop.max_steps()) {
    return Invalid(absl::StrCat("profile_step=", output.profile_step(), " is not a step of this run (1 to max_steps=",
                                loop.max_steps(), "; 0 turns profiling off)"));
  }
  if (output.profile_step() > 0) {
    c->mutable_output()->set_trace_step(output.profile_step());
    if (output.trace_file().empty()) c->mutable_output()->set_trace_file("trace.json");
  }
  const CheckpointSpec& checkpoint = c->checkpoint();
  if (checkpoint.save_every() < 0 || checkpoint.keep_last_n() < 0 || checkpoint.export_every() < 0) {
    return Invalid("save_every, keep_last_n and export_every must not be negative");
  }
  if ((checkpoint.save_every() > 0 || checkpoint.resume_from() == "last" || checkpoint.resume_from() == "best") &&
      checkpoint.save_dir().empty()) {
    return Invalid("save_every and resume_from=last|best need save_dir");
  }
  if (checkpoint.save_type() != "sharded" && checkpoint.save_type() != "deduped" &&
      checkpoint.save_type() != "merged") {
    return Invalid(absl::StrCat("save_type='", checkpoint.save_type(), "' is not one of sharded, deduped, merged"));
  }
  if (checkpoint.save_failure() != "fail" && checkpoint.save_failure() != "warn") {
    return Invalid(absl::StrCat("save_failure='", checkpoint.save_failure(), "' is not one of fail, warn"));
  }
  const RuntimeSpec& runtime = c->runtime();
  if (!(runtime.collective_timeout_s() > 0)) {
    return Invalid(absl::StrCat("collective_timeout_s=", runtime.collective_timeout_s(), " must be positive"));
  }
  if (runtime.max_restarts() < 0) return Invalid("max_restarts must not be negative");
  if (runtime.intra_op_threads() < 0) return Invalid("intra_op_threads must not be negative");
  if (checkpoint.finetune() && checkpoint.resume_from().empty()) {
    return Invalid("finetune loads the weights of resume_from (a checkpoint); set resume_from");
  }
  const GenerationSpec& generation = c->generation();
  if (!(generation.temperature() > 0) || generation.top_k() < 0 || generation.sample_tokens() < 0 ||
      generation.out_seq_length() < 0) {
    return Invalid("temperature must be positive; top_k, sample_tokens and out_seq_length must not be negative");
  }
  if (!(c->plan().zero().bucket_bytes() > 0)) return Invalid("bucket_size_mb must be positive");
  if (!c->model().loss().empty() && !LossRegistry().Contains(c->model().loss())) {
    return LossRegistry().Find(c->model().loss()).status();
  }
  if (c->plan().has_lora() && c->plan().lora().target_modules().empty()) {
    return Invalid("plan.lora has no target_modules; give a LoRA config file (lora_config) that names them");
  }
  if ((checkpoint.lora_merge_on_export() || c->plan().save_frozen()) && !c->plan().has_lora()) {
    return Invalid("lora_merge_on_export and lora_save_base apply to LoRA runs; set lora_config");
  }
  return absl::OkStatus();
}

absl::StatusOr<ParallelPlan> ResolveConfig(TrainerConfig* c, int world_size) {
  TRIDENT_RETURN_IF_ERROR(CheckConfigFields(c));
  ParallelPlan plan = c->plan();
  if (!c->strategy().search().empty()) {
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
  const ParallelPlan& plan = c.plan();
  const int layout = plan.dp() * plan.tp() * plan.pp();
  if (c.strategy().load().empty()) return layout;
  TRIDENT_ASSIGN_OR_RETURN(Strategy strategy, LoadStrategy(c.strategy().load()));
  return StrategyWorldSize(strategy, layout);
}

int64_t GlobalBatchSize(const ParallelPlan& plan) {
  return plan.micro_batch_size() * plan.num_micro_batches() * plan.dp();
}

std::pair<std::string, ComponentArgs> ModelComponent(const TrainerConfig& c) {
  const std::string type = c.model().type();
  std::map<std::string, std::string> args(c.model().args().begin(), c.model().args().end());
  if (type == "gpt" || type == "llama" || type == "mlp") {
    if (!args.count("preset")) args["preset"] = absl::StrCat(type, "-tiny");
    if (c.plan().trace().no_tie_modules()) args["tie_word_embeddings"] = "false";  // the zoo unties itself
  }
  return {type, ComponentArgs(absl::StrCat("model '", type, "'"), std::move(args))};
}

std::pair<std::string, ComponentArgs> OptimizerComponent(const TrainerConfig& c) {
  const std::string type = c.optimizer().type();
  std::map<std::string, std::string> args(c.optimizer().args().begin(), c.optimizer().args().end());
  if (type == "adamw") {  // the trainer's defaults (nanoGPT's), not the optimizer's (PyTorch's)
    args.insert({{"beta1", "0.9"}, {"beta2", "0.95"}, {"eps", "1e-08"}, {"weight_decay", "0.1"}});
  }
  return {type, ComponentArgs(absl::StrCat("optimizer '", type, "'"), std::move(args))};
}

namespace {

// Sets every unset field of `message` that has a default to it; recurses into
// the sub-messages `message` holds (and, with `create`, into every singular
// one: a TrainerConfig's groups, whose presence means nothing). The plan is
// left as set: some of its fields mean something by being set
// (num_micro_batches against loop.global_batch_size, lora).
void FillDefaults(google::protobuf::Message* message, bool create) {
  const auto* reflection = message->GetReflection();
  const auto* descriptor = message->GetDescriptor();
  for (int i = 0; i < descriptor->field_count(); ++i) {
    const FieldDescriptor* field = descriptor->field(i);
    if (field->is_repeated()) continue;
    if (field->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
      if (field->message_type() == ParallelPlan::descriptor()) continue;
      if (create || reflection->HasField(*message, field)) {
        FillDefaults(reflection->MutableMessage(message, field), false);
      }
      continue;
    }
    if (!field->has_default_value() || reflection->HasField(*message, field)) continue;
    switch (field->cpp_type()) {
      case FieldDescriptor::CPPTYPE_INT32:
        reflection->SetInt32(message, field, field->default_value_int32());
        break;
      case FieldDescriptor::CPPTYPE_INT64:
        reflection->SetInt64(message, field, field->default_value_int64());
        break;
      case FieldDescriptor::CPPTYPE_UINT64:
        reflection->SetUInt64(message, field, field->default_value_uint64());
        break;
      case FieldDescriptor::CPPTYPE_DOUBLE:
        reflection->SetDouble(message, field, field->default_value_double());
        break;
      case FieldDescriptor::CPPTYPE_BOOL:
        reflection->SetBool(message, field, field->default_value_bool());
        break;
      case FieldDescriptor::CPPTYPE_STRING:
        reflection->SetString(message, field, field->default_value_string());
        break;
      case FieldDescriptor::CPPTYPE_ENUM:
        reflection->SetEnum(message, field, field->default_value_enum());
        break;
      default:
        break;
    }
  }
}

// Clears the singular fields of `message` whose value is `defaults`' (set or
// not), recursively, and the sub-messages left empty.
void ClearDefaults(const google::protobuf::Message& defaults, google::protobuf::Message* message) {
  const auto* reflection = message->GetReflection();
  std::vector<const FieldDescriptor*> fields;
  reflection->ListFields(*message, &fields);
  for (const FieldDescriptor* field : fields) {
    if (field->is_repeated()) continue;
    if (field->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
      google::protobuf::Message* sub = reflection->MutableMessage(message, field);
      ClearDefaults(defaults.GetReflection()->GetMessage(defaults, field), sub);
      if (sub->ByteSizeLong() == 0) reflection->ClearField(message, field);
      continue;
    }
    std::string value, default_value;
    google::protobuf::TextFormat::PrintFieldValueToString(*message, field, -1, &value);
    google::protobuf::TextFormat::PrintFieldValueToString(defaults, field, -1, &default_value);
    if (value == default_value) reflection->ClearField(message, field);
  }
}

}  // namespace

std::string ConfigToText(const TrainerConfig& config) {
  TrainerConfig complete = config;
  FillDefaults(&complete, /*create=*/true);
  std::string text;
  google::protobuf::TextFormat::PrintToString(complete, &text);
  return text;
}

std::string ConfigChangesToText(const TrainerConfig& config) {
  TrainerConfig changes = config;
  ClearDefaults(DefaultTrainerConfig(), &changes);
  google::protobuf::TextFormat::Printer printer;
  printer.SetSingleLineMode(true);
  std::string text;
  printer.PrintToString(changes, &text);
  return std::string(absl::StripAsciiWhitespace(text));
}

}  // namespace trident
