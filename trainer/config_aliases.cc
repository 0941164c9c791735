// The flat flags of earlier versions as aliases of the nested TrainerConfig's
// fields: the table, the conversions some of them need, and the translation
// of a flat text config.
#include <cstdint>
#include <map>
#include <optional>
#include <regex>

#include <google/protobuf/descriptor.h>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/status.h"
#include "base/text_proto.h"
#include "lora/lora.h"
#include "trainer/config.h"

namespace trident {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;

absl::Status Invalid(const std::string& message) { return absl::InvalidArgumentError(message); }

enum class Conversion {
  kNone,              // the value as the field's own
  kCommaList,         // "a,b" replaces the list with its items
  kRankList,          // "3,2,1,0": the same for a list of ranks
  kElementsToBytes,   // fp32 elements x 4
  kMegabytesToBytes,  // x 2^20
  kModelType,         // torchscript:PATH is type torchscript with args.path
  kUnlessUnset,       // "" or 0 (what saved configs held for "the model's own") sets nothing
  kAdapterName,       // "default" (what saved configs held) does not start a LoRA config
  kLossScale,         // -1 off (the precision's own), 0 dynamic, > 0 static
  kSkipIfNonfinite,   // loss scaling on, statically 1 unless a scale is set
  kPrescale,          // DeepSpeed's switch: gradient_predivide_factor alone decides now
  kLoraFile,          // a LoraConfig text file read into plan.lora
  kLayerMapping,      // "input:output:col|row"
  kWeightChange,      // "name:0" a column, "name:1" a row
  kRefused,           // no longer means anything; the note says why
};

struct Alias {
  const char* flat;  // a flag's name, or a prefix ending in '.'
  const char* path;  // the dotted field it spells (a prefix for a prefix)
  Conversion conversion = Conversion::kNone;
};

const std::vector<Alias>& Table() {
  using C = Conversion;
  static const auto* table = new std::vector<Alias>{
      // The components.
      {"model", "model.type", C::kModelType},
      {"preset", "model.args.preset", C::kUnlessUnset},
      {"n_layer", "model.args.n_layer"},
      {"n_head", "model.args.n_head"},
      {"n_embd", "model.args.n_embd"},
      {"n_kv_head", "model.args.n_kv_head"},
      {"intermediate_size", "model.args.intermediate_size"},
      {"block_size", "model.args.block_size"},
      {"vocab_size", "model.args.vocab_size"},
      {"dropout", "model.args.dropout"},
      {"rope_theta", "model.args.rope_theta"},
      {"init_method_std", "model.args.init_method_std", C::kUnlessUnset},
      {"loss", "model.loss"},
      {"model_config.", "model."},
      {"data", "dataset.dir"},
      {"shuffle", "dataset.shuffle"},
      {"dataset_config.", "dataset."},
      {"adam_beta1", "optimizer.args.beta1"},
      {"adam_beta2", "optimizer.args.beta2"},
      {"adam_eps", "optimizer.args.eps"},
      {"weight_decay", "optimizer.args.weight_decay"},
      {"grad_clip", "optimizer.clip_gnorm"},
      {"optimizer_config.", "optimizer."},
      // The layout.
      {"dp", "plan.dp"},
      {"tp", "plan.tp"},
      {"pp", "plan.pp"},
      {"axis_order", "plan.axis_order", C::kCommaList},
      {"rank_order", "plan.rank_order", C::kRankList},
      {"virtual_stages", "plan.virtual_stages"},
      {"micro_batch_size", "plan.micro_batch_size"},
      {"grad_accumulation_steps", "plan.num_micro_batches"},
      {"device", "plan.device"},
      {"seed", "plan.seed"},
      {"trace_method", "plan.trace.method"},
      {"split_method", "plan.trace.split_method"},
      {"shard_count", "plan.trace.shard_count"},
      {"leaf_modules", "plan.trace.leaf_modules", C::kCommaList},
      {"input_names", "plan.trace.input_names", C::kCommaList},
      {"no_tie_modules", "plan.trace.no_tie_modules"},
      {"schedule", "plan.pipeline.schedule"},
      {"partition_method", "plan.pipeline.partition_method"},
      {"custom_split_points", "plan.pipeline.custom_split_points", C::kCommaList},
      {"dealloc_pipeoutput", "plan.pipeline.dealloc_pipeoutput"},
      {"sequence_parallel", "plan.tensor_parallel.sequence_parallel"},
      {"tp_overlapping_level", "plan.tensor_parallel.overlapping_level"},
      {"parallel_vocab", "plan.tensor_parallel.parallel_vocab"},
      {"tp_split_all", "plan.tensor_parallel.split_all"},
      {"tp_layer_lists.col_para_list", "plan.tensor_parallel.layer_lists.column"},
      {"tp_layer_lists.row_para_list", "plan.tensor_parallel.layer_lists.row"},
      {"tp_layer_lists.input_output_mapping", "plan.tensor_parallel.layer_lists.input_output_mapping",
       C::kLayerMapping},
      {"tp_layer_lists.weight_change_list", "plan.tensor_parallel.layer_lists", C::kWeightChange},
      {"tp_layer_lists.tp_attr_list", "", C::kRefused},
      {"activation_checkpointing", "plan.recompute.method"},
      {"checkpoint_layers", "plan.recompute.layers", C::kCommaList},
      {"checkpoint_modules", "plan.recompute.modules", C::kCommaList},
      {"checkpoint_num_layers", "plan.recompute.num_layers"},
      {"activation_checkpoint_ratio", "plan.recompute.ratio"},
      {"zero_stage", "plan.zero.stage"},
      {"zero_reduce_bucket_size", "plan.zero.reduce_bucket_bytes", C::kElementsToBytes},
      {"zero_allgather_bucket_size", "plan.zero.allgather_bucket_bytes", C::kElementsToBytes},
      {"zero_allow_untested_optimizer", "plan.zero.allow_untested_optimizer"},
      {"bucket_size_mb", "plan.zero.bucket_bytes", C::kMegabytesToBytes},
      {"gradient_predivide_factor", "plan.zero.gradient_predivide_factor"},
      {"prescale_gradients", "plan.zero.gradient_predivide_factor", C::kPrescale},
      {"zero_shard_group_size", "plan.zero.shard_group_size"},
      {"zero_ngroups", "plan.zero.num_shard_groups"},
      {"zero_prefetch_layers", "plan.zero.prefetch_layers"},
      {"zero_max_inflight_reduce_scatters", "plan.zero.max_inflight_reduce_scatters"},
      {"zero_gather_bucket_bytes", "plan.zero.gather_bucket_bytes"},
      {"offload_optimizer", "plan.zero.offload_optimizer"},
      {"offload_dir", "plan.zero.offload_dir"},
      {"offload_params", "plan.zero.offload_params"},
      {"atorch_ignored_cls", "plan.zero.ignored", C::kCommaList},
      {"atorch_wrap_cls", "plan.zero.wrap", C::kCommaList},
      {"atorch_size_based_min_num_params", "plan.zero.min_num_params"},
      {"limit_all_gathers", "plan.zero.limit_all_gathers"},
      {"precision", "plan.precision.mode"},
      {"precision_table", "plan.precision.table"},
      {"loss_scale", "plan.precision.loss_scaler.loss_scale", C::kLossScale},
      {"skip_if_nonfinite", "plan.precision.loss_scaling", C::kSkipIfNonfinite},
      {"initial_scale_power", "plan.precision.loss_scaler.initial_scale_power"},
      {"loss_scale_window", "plan.precision.loss_scaler.loss_scale_window"},
      {"hysteresis", "plan.precision.loss_scaler.hysteresis"},
      {"min_loss_scale", "plan.precision.loss_scaler.min_loss_scale"},
      {"grad_reduction", "plan.reduction.gradients"},
      {"loss_reduction", "plan.reduction.loss"},
      {"module_replace", "plan.module_replace", C::kCommaList},
      {"lora_config", "plan.lora", C::kLoraFile},
      {"adapter_name", "plan.lora.adapter_name", C::kAdapterName},
      {"lora_save_base", "plan.save_frozen"},
      // The loop.
      {"max_steps", "loop.max_steps"},
      {"max_epochs", "loop.max_epochs"},
      {"global_batch_size", "loop.global_batch_size"},
      {"lr", "loop.lr"},
      {"min_lr", "loop.min_lr"},
      {"warmup_steps", "loop.warmup_steps"},
      {"lr_scheduler", "loop.lr_scheduler"},
      {"eval_every", "loop.eval_every"},
      {"eval_steps", "loop.eval_steps"},
      {"max_val_steps", "loop.max_val_steps"},
      {"val_every_n_epochs", "loop.val_every_n_epochs"},
      // Checkpoints.
      {"save_dir", "checkpoint.save_dir"},
      {"save_every", "checkpoint.save_every"},
      {"resume_from", "checkpoint.resume_from"},
      {"keep_last_n", "checkpoint.keep_last_n"},
      {"init_from", "checkpoint.init_from"},
      {"save_type", "checkpoint.save_type"},
      {"finetune", "checkpoint.finetune"},
      {"no_save_optim", "checkpoint.no_save_optim"},
      {"no_save_rng", "checkpoint.no_save_rng"},
      {"no_load_optim", "checkpoint.no_load_optim"},
      {"no_load_rng", "checkpoint.no_load_rng"},
      {"async_save", "checkpoint.async_save"},
      {"save_failure", "checkpoint.save_failure"},
      {"export_safetensors", "checkpoint.export_safetensors"},
      {"export_every", "checkpoint.export_every"},
      {"lora_merge_on_export", "checkpoint.lora_merge_on_export"},
      // The strategy.
      {"strategy", "strategy.search"},
      {"load_strategy", "strategy.load"},
      {"save_strategy", "strategy.save"},
      {"ignore_dryrun_on_load_strategy", "strategy.ignore_dryrun_on_load"},
      {"run_mode", "strategy.run_mode"},
      {"memory_limit_mb", "strategy.memory_limit_mb"},
      {"strategy_time_limit_s", "strategy.time_limit_s"},
      {"strategy_dry_runs", "strategy.dry_runs"},
      {"strategy_reuse", "strategy.reuse"},
      {"finetune_strategy", "strategy.finetune"},
      {"allow_precision_change", "strategy.allow_precision_change"},
      {"strategy_excluded", "strategy.excluded", C::kCommaList},
      {"profile_cache_dir", "strategy.profile_cache_dir"},
      // Generation.
      {"sample_tokens", "generation.sample_tokens"},
      {"temperature", "generation.temperature"},
      {"top_k", "generation.top_k"},
      {"prompt", "generation.prompt"},
      {"text_generation", "generation.text_generation"},
      {"out_seq_length", "generation.out_seq_length"},
      {"kv_cache", "generation.kv_cache"},
      // The runtime.
      {"intra_op_threads", "runtime.intra_op_threads"},
      {"collective_timeout_s", "runtime.collective_timeout_s"},
      {"max_restarts", "runtime.max_restarts"},
      {"preempt_save", "runtime.preempt_save"},
      {"preempt_grace_s", "runtime.preempt_grace_s"},
      {"elastic", "runtime.elastic"},
      // The output.
      {"log_every", "output.log_every"},
      {"wall_clock_breakdown", "output.wall_clock_breakdown"},
      {"metrics_file", "output.metrics_file"},
      {"tensorboard_dir", "output.tensorboard_dir"},
      {"enable_progress_bar", "output.enable_progress_bar"},
      {"trace_file", "output.trace_file"},
      {"trace_step", "output.trace_step"},
      {"profile_step", "output.profile_step"},
      {"tp_plan_report", "output.tp_plan_report"},
  };
  return *table;
}

// The alias `name` is (a prefix alias rewrites the name), or none.
std::optional<std::pair<Alias, std::string>> FindAlias(const std::string& name) {
  for (const Alias& alias : Table()) {
    const absl::string_view flat = alias.flat;
    if (flat == name) return std::make_pair(alias, std::string(alias.path));
    if (absl::EndsWith(flat, ".") && absl::StartsWith(name, flat)) {
      return std::make_pair(alias, absl::StrCat(alias.path, name.substr(flat.size())));
    }
  }
  return std::nullopt;
}

// Where a field lives: `field` of `message`.
struct Target {
  Message* message = nullptr;
  const FieldDescriptor* field = nullptr;
};

// The field a dotted path names ("model.args.n_layer", "plan.zero.stage"):
// messages on the path are created, a map's key becomes its entry (the rest
// of the name, dots included) and the target is the entry's value. Unknown
// names are an error naming `flag` and the part at fault.
absl::StatusOr<Target> FieldAt(Message* root, const std::string& path, const std::string& flag) {
  std::vector<std::string> parts = absl::StrSplit(path, '.');
  Message* message = root;
  for (size_t i = 0; i < parts.size(); ++i) {
    const FieldDescriptor* field = message->GetDescriptor()->FindFieldByName(parts[i]);
    if (field == nullptr) {
      return Invalid(absl::StrCat("unknown flag --", flag, ": ", message->GetDescriptor()->name(), " has no field '",
                                  parts[i], "' (train --help lists them)"));
    }
    const auto* reflection = message->GetReflection();
    if (i + 1 == parts.size()) return Target{message, field};
    if (field->is_map()) {
      const std::string key = absl::StrJoin(parts.begin() + i + 1, parts.end(), ".");
      const FieldDescriptor* key_field = field->message_type()->FindFieldByName("key");
      for (int e = 0; e < reflection->FieldSize(*message, field); ++e) {
        Message* entry = reflection->MutableRepeatedMessage(message, field, e);
        if (entry->GetReflection()->GetString(*entry, key_field) == key) {
          return Target{entry, field->message_type()->FindFieldByName("value")};
        }
      }
      Message* entry = reflection->AddMessage(message, field);
      entry->GetReflection()->SetString(entry, key_field, key);
      return Target{entry, field->message_type()->FindFieldByName("value")};
    }
    if (field->cpp_type() != FieldDescriptor::CPPTYPE_MESSAGE || field->is_repeated()) {
      return Invalid(absl::StrCat("flag --", flag, ": '", parts[i], "' is not a message, so it has no fields"));
    }
    message = reflection->MutableMessage(message, field);
  }
  return Invalid(absl::StrCat("flag --", flag, " names no field"));
}

// Sets the target from a flag's text: a list grows by one item, an enum
// takes its value's name ('-' read as '_').
absl::Status SetFromText(const Target& t, const std::string& flag, const std::string& value) {
  const auto* reflection = t.message->GetReflection();
  if (t.field->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
    return Invalid(absl::StrCat("flag --", flag, " names a group of fields; set one of them (--", flag, ".FIELD)"));
  }
  if (t.field->type() == FieldDescriptor::TYPE_STRING) {
    if (t.field->is_repeated()) {
      reflection->AddString(t.message, t.field, value);
    } else {
      reflection->SetString(t.message, t.field, value);
    }
    return absl::OkStatus();
  }
  if (t.field->type() == FieldDescriptor::TYPE_ENUM) {
    TRIDENT_ASSIGN_OR_RETURN(int number, EnumValueNamed(t.field->enum_type(), flag, value));
    if (t.field->is_repeated()) {
      reflection->AddEnumValue(t.message, t.field, number);
    } else {
      reflection->SetEnumValue(t.message, t.field, number);
    }
    return absl::OkStatus();
  }
  if (!ParseTextFieldValue(value, t.field, t.message)) {
    return Invalid(absl::StrCat("flag --", flag, "='", value, "' is not a valid ", t.field->type_name(), " value"));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> Integer(const std::string& flag, const std::string& value) {
  int64_t number = 0;
  if (!absl::SimpleAtoi(value, &number)) return Invalid(absl::StrCat("flag --", flag, "='", value, "' is no integer"));
  return number;
}
absl::StatusOr<double> Real(const std::string& flag, const std::string& value) {
  double number = 0;
  if (!absl::SimpleAtod(value, &number)) return Invalid(absl::StrCat("flag --", flag, "='", value, "' is no number"));
  return number;
}

absl::Status ApplyAlias(const Alias& alias, const std::string& path, const std::string& flag, const std::string& value,
                        TrainerConfig* config) {
  using C = Conversion;
  ParallelPlan* plan = config->mutable_plan();
  switch (alias.conversion) {
    case C::kNone: {
      TRIDENT_ASSIGN_OR_RETURN(Target target, FieldAt(config, path, flag));
      return SetFromText(target, flag, value);
    }
    case C::kCommaList: {
      TRIDENT_ASSIGN_OR_RETURN(Target target, FieldAt(config, path, flag));
      target.message->GetReflection()->ClearField(target.message, target.field);
      for (const std::string& item : CommaList(value)) TRIDENT_RETURN_IF_ERROR(SetFromText(target, flag, item));
      return absl::OkStatus();
    }
    case C::kRankList:
      plan->clear_rank_order();
      for (const std::string& item : CommaList(value)) {
        int rank = 0;
        if (!absl::SimpleAtoi(item, &rank)) {
          return Invalid(absl::StrCat("rank_order '", value, "': '", item,
                                      "' is not a rank; list the rank at each mesh position, comma-separated"));
        }
        plan->add_rank_order(rank);
      }
      return absl::OkStatus();
    case C::kElementsToBytes: {
      TRIDENT_ASSIGN_OR_RETURN(int64_t elements, Integer(flag, value));
      TRIDENT_ASSIGN_OR_RETURN(Target target, FieldAt(config, path, flag));
      target.message->GetReflection()->SetInt64(target.message, target.field, elements * 4);
      return absl::OkStatus();
    }
    case C::kMegabytesToBytes: {
      TRIDENT_ASSIGN_OR_RETURN(double megabytes, Real(flag, value));
      if (!(megabytes > 0)) return Invalid("bucket_size_mb must be positive");
      plan->mutable_zero()->set_bucket_bytes(static_cast<int64_t>(megabytes * (1 << 20)));
      return absl::OkStatus();
    }
    case C::kModelType:
      if (absl::StartsWith(value, "torchscript:")) {
        config->mutable_model()->set_type("torchscript");
        (*config->mutable_model()->mutable_args())["path"] = value.substr(std::string("torchscript:").size());
      } else {
        config->mutable_model()->set_type(value);
      }
      return absl::OkStatus();
    case C::kUnlessUnset: {
      double number = 1;
      if (value.empty() || (absl::SimpleAtod(value, &number) && number == 0)) {
        config->mutable_model()->mutable_args()->erase(path.substr(path.rfind('.') + 1));
        return absl::OkStatus();
      }
      TRIDENT_ASSIGN_OR_RETURN(Target target, FieldAt(config, path, flag));
      return SetFromText(target, flag, value);
    }
    case C::kAdapterName:
      if (value == "default" && !plan->has_lora()) return absl::OkStatus();
      plan->mutable_lora()->set_adapter_name(value);
      return absl::OkStatus();
    case C::kLossScale: {
      TRIDENT_ASSIGN_OR_RETURN(double scale, Real(flag, value));
      if (scale < 0 && scale != -1) {
        return Invalid("loss_scale must be -1 (off), 0 (dynamic) or positive (static)");
      }
      if (scale >= 0) {
        plan->mutable_precision()->set_loss_scaling(true);
        plan->mutable_precision()->mutable_loss_scaler()->set_loss_scale(scale);
      } else if (plan->has_precision()) {  // off: the precision mode's own (fp16's dynamic scaling)
        plan->mutable_precision()->clear_loss_scaling();
        if (plan->precision().has_loss_scaler()) plan->mutable_precision()->mutable_loss_scaler()->clear_loss_scale();
      }
      return absl::OkStatus();
    }
    case C::kSkipIfNonfinite: {
      bool skip = false;
      if (!absl::SimpleAtob(value, &skip)) return Invalid(absl::StrCat("flag --", flag, "='", value, "' is no bool"));
      if (!skip) return absl::OkStatus();
      plan->mutable_precision()->set_loss_scaling(true);
      LossScalerSpec* scaler = plan->mutable_precision()->mutable_loss_scaler();
      if (!scaler->has_loss_scale()) scaler->set_loss_scale(1);  // skip the step, scale nothing
      return absl::OkStatus();
    }
    case C::kPrescale:
      return absl::OkStatus();
    case C::kLoraFile: {
      if (value.empty()) return absl::OkStatus();  // no LoRA (what saved configs held)
      LoraConfig* lora = plan->mutable_lora();
      TRIDENT_ASSIGN_OR_RETURN(LoraConfig read, ReadLoraConfig(value, lora->adapter_name()));
      const std::string adapter = lora->adapter_name();
      lora->MergeFrom(read);
      lora->set_adapter_name(adapter);
      return absl::OkStatus();
    }
    case C::kLayerMapping: {
      std::vector<std::string> parts = absl::StrSplit(value, ':');
      int64_t input = 0, output = 0;
      if (parts.size() != 3 || !absl::SimpleAtoi(parts[0], &input) || !absl::SimpleAtoi(parts[1], &output) ||
          input < 1 || output < 1 || (parts[2] != "col" && parts[2] != "row")) {
        return Invalid(absl::StrCat("tp_layer_lists.input_output_mapping '", value,
                                    "' is not input:output:col or input:output:row (\"1:3:col\")"));
      }
      TensorParallelLayerLists::Mapping* m =
          plan->mutable_tensor_parallel()->mutable_layer_lists()->add_input_output_mapping();
      m->set_input(input);
      m->set_output(output);
      m->set_column(parts[2] == "col");
      return absl::OkStatus();
    }
    case C::kWeightChange: {
      std::vector<std::string> parts = absl::StrSplit(value, ':');
      if (parts.size() != 2 || (parts[1] != "0" && parts[1] != "1")) {
        return Invalid(absl::StrCat("tp_layer_lists.weight_change_list '", value,
                                    "' is not name:0 (a linear weight's output features: column) or name:1 "
                                    "(its input features: row)"));
      }
      TensorParallelLayerLists* lists = plan->mutable_tensor_parallel()->mutable_layer_lists();
      *(parts[1] == "0" ? lists->add_column() : lists->add_row()) = parts[0];
      return absl::OkStatus();
    }
    case C::kRefused:
      return Invalid(absl::StrCat("tp_layer_lists.tp_attr_list names ", value,
                                  ": the automatic pass rewrites the sizes a split changes (head counts in "
                                  "views) itself; leave tp_attr_list empty"));
  }
  return absl::OkStatus();
}

// Whether flag `name` (an alias, or a dotted path) sets a bool.
bool NamesBool(const std::string& name) {
  std::string path = name;
  if (auto alias = FindAlias(name)) {
    if (alias->first.conversion == Conversion::kSkipIfNonfinite || alias->first.conversion == Conversion::kPrescale) {
      return true;
    }
    path = alias->second;
  }
  TrainerConfig scratch;
  auto target = FieldAt(&scratch, path, name);
  return target.ok() && target->field->type() == FieldDescriptor::TYPE_BOOL;
}

// Whether `name` is a flag of the config: an alias or a dotted path.
bool IsConfigFlag(const std::string& name) {
  if (FindAlias(name)) return true;
  TrainerConfig scratch;
  const std::string first = name.substr(0, name.find('.'));
  return scratch.GetDescriptor()->FindFieldByName(first) != nullptr;
}

// Applies field `name` of a flat text config, its value as written there
// (quoted strings unescaped); errors name the line.
absl::Status ApplyTextValue(const std::pair<Alias, std::string>& alias, const std::string& name, std::string value,
                            size_t line, TrainerConfig* config) {
  if (value.size() >= 2 && (value.front() == '"' || value.front() == '\'') && value.back() == value.front()) {
    std::string unescaped;
    if (!absl::CUnescape(value.substr(1, value.size() - 2), &unescaped)) {
      return Invalid(absl::StrCat("line ", line, ": the string of '", name, "' does not unescape"));
    }
    value = unescaped;
  }
  absl::Status applied = ApplyAlias(alias.first, alias.second, name, value, config);
  if (!applied.ok()) return Invalid(absl::StrCat("line ", line, ": ", applied.message()));
  return absl::OkStatus();
}

// Applies the `field: value` pairs of a flattened block's text as flags
// `block.field`.
absl::Status ApplyBlock(const std::string& block, const std::string& text, size_t line, TrainerConfig* config) {
  static const std::regex* pair = new std::regex(R"re((\w+)\s*:\s*("(?:[^"\\]|\\.)*"|[^\s"]+))re");
  for (std::sregex_iterator m(text.begin(), text.end(), *pair), end; m != end; ++m) {
    const std::string name = absl::StrCat(block, ".", (*m)[1].str());
    auto alias = FindAlias(name);
    if (!alias) return Invalid(absl::StrCat("line ", line, ": ", block, " has no field '", (*m)[1].str(), "'"));
    TRIDENT_RETURN_IF_ERROR(ApplyTextValue(*alias, name, (*m)[2].str(), line, config));
  }
  return absl::OkStatus();
}

// Where the characters of `chars` stand in `text` outside double-quoted strings.
std::vector<size_t> UnquotedPositions(absl::string_view text, absl::string_view chars) {
  std::vector<size_t> positions;
  bool quoted = false;
  for (size_t c = 0; c < text.size(); ++c) {
    if (text[c] == '\\' && quoted) {
      ++c;
    } else if (text[c] == '"') {
      quoted = !quoted;
    } else if (!quoted && chars.find(text[c]) != absl::string_view::npos) {
      positions.push_back(c);
    }
  }
  return positions;
}

// A line without its comment (a '#' outside double quotes), trimmed.
std::string WithoutComment(absl::string_view line) {
  const std::vector<size_t> comment = UnquotedPositions(line, "#");
  if (!comment.empty()) line = line.substr(0, comment.front());
  return std::string(absl::StripAsciiWhitespace(line));
}

}  // namespace

absl::Status SetConfigFlag(const std::string& name, const std::string& value, TrainerConfig* config) {
  if (auto alias = FindAlias(name)) return ApplyAlias(alias->first, alias->second, name, value, config);
  TRIDENT_ASSIGN_OR_RETURN(Target target, FieldAt(config, name, name));
  return SetFromText(target, name, value);
}

absl::Status ApplyConfigFlags(std::vector<std::string>* args, TrainerConfig* config) {
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
    if (!has_value && !IsConfigFlag(name) && absl::StartsWith(name, "no") && NamesBool(name.substr(2))) {
      TRIDENT_RETURN_IF_ERROR(SetConfigFlag(name.substr(2), "false", config));
      continue;
    }
    if (!IsConfigFlag(name)) {
      rest.push_back((*args)[i]);
      continue;
    }
    if (!has_value) {
      if (NamesBool(name)) {
        value = "true";
      } else if (i + 1 < args->size()) {
        value = (*args)[++i];
      } else {
        return Invalid(absl::StrCat("flag --", name, " needs a value"));
      }
    }
    TRIDENT_RETURN_IF_ERROR(SetConfigFlag(name, value, config));
  }
  *args = std::move(rest);
  return absl::OkStatus();
}

std::multimap<std::string, std::string> ConfigFlagAliases() {
  std::multimap<std::string, std::string> aliases;
  for (const Alias& alias : Table()) {
    if (alias.conversion == Conversion::kRefused) continue;
    const char* note = alias.conversion == Conversion::kNone ? ""
                       : alias.conversion == Conversion::kCommaList || alias.conversion == Conversion::kRankList
                           ? " (comma-separated)"
                           : " (converted)";
    aliases.emplace(alias.path, absl::StrCat("--", alias.flat, absl::EndsWith(alias.flat, ".") ? "FIELD" : "", note));
  }
  return aliases;
}

absl::StatusOr<std::string> TranslateFlatConfig(const std::string& text, TrainerConfig* config) {
  // Line by line, as configs are written (one field per line): a top-level
  // `alias: value` line is applied as its flag and blanked (line numbers of
  // errors stay right), a top-level block of a renamed message is renamed,
  // and the fields inside a block of a flattened one (tp_layer_lists) are
  // applied as flags too.
  std::vector<std::string> lines = absl::StrSplit(text, '\n');
  int depth = 0;
  std::string block, block_text;  // the flattened block we are in, if any, and its text
  size_t block_line = 0;
  for (size_t n = 0; n < lines.size(); ++n) {
    std::string& line = lines[n];
    const std::string stripped = WithoutComment(line);
    const size_t colon = stripped.find(':');
    const size_t brace = stripped.find_first_of("{<");
    std::string name(absl::StripAsciiWhitespace(stripped.substr(0, std::min(colon, brace))));
    const absl::string_view after_colon =
        colon == std::string::npos ? ""
                                   : absl::StripLeadingAsciiWhitespace(absl::string_view(stripped).substr(colon + 1));
    const bool scalar = colon != std::string::npos && (brace == std::string::npos || brace > colon) &&
                        !absl::StartsWith(after_colon, "{") && !absl::StartsWith(after_colon, "<");
    if (depth == 0 && scalar) {
      if (auto alias = FindAlias(name); alias && !absl::EndsWith(alias->first.flat, ".")) {
        TRIDENT_RETURN_IF_ERROR(ApplyTextValue(*alias, name, std::string(after_colon), n + 1, config));
        line.clear();
        continue;
      }
    }
    size_t from = 0;  // where this line's text inside a flattened block starts
    if (depth == 0 && brace != std::string::npos && !scalar) {
      if (auto alias = FindAlias(name + ".")) {  // a renamed message
        const std::string renamed = std::string(alias->first.path);
        line = absl::StrCat(renamed.substr(0, renamed.size() - 1), stripped.substr(name.size()));
      } else if (FindAlias(name + ".col_para_list")) {  // a flattened one
        block = name;
        block_line = n + 1;
        from = brace + 1;
      }
    }
    for (size_t c : UnquotedPositions(stripped, "{<}>")) {
      if (stripped[c] == '{' || stripped[c] == '<') {
        ++depth;
      } else if (--depth == 0 && !block.empty()) {
        absl::StrAppend(&block_text, " ", stripped.substr(from, c - from));
        TRIDENT_RETURN_IF_ERROR(ApplyBlock(block, block_text, block_line, config));
        block.clear();
        block_text.clear();
        line.clear();
      }
    }
    if (!block.empty()) {
      absl::StrAppend(&block_text, " ", stripped.substr(from));
      line.clear();
    }
  }
  return absl::StrJoin(lines, "\n");
}

}  // namespace trident
