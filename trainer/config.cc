#include "trainer/config.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include <google/protobuf/descriptor.h>
#include <google/protobuf/io/tokenizer.h>
#include <google/protobuf/text_format.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "base/status.h"
#include "amp/amp.h"
#include "pipeline/pipeline.h"

namespace trident {
namespace {

using google::protobuf::FieldDescriptor;

absl::Status Invalid(const std::string& message) { return absl::InvalidArgumentError(message); }

// Keeps the first text-format parse error instead of logging it.
class FirstError : public google::protobuf::io::ErrorCollector {
 public:
  void AddError(int line, int column, const std::string& message) override {
    if (text.empty()) text = absl::StrCat("line ", line + 1, " column ", column + 1, ": ", message);
  }
  std::string text;
};

}  // namespace

absl::StatusOr<TrainerConfig> LoadTrainerConfig(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read config file ", path));
  std::stringstream text;
  text << in.rdbuf();
  TrainerConfig config;
  FirstError error;
  google::protobuf::TextFormat::Parser parser;
  parser.RecordErrorsTo(&error);
  if (!parser.ParseFromString(text.str(), &config)) {
    return Invalid(absl::StrCat("config file ", path, " is not a valid TrainerConfig (",
                                error.text, "); the fields are in trainer/config.proto"));
  }
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
    const FieldDescriptor* field = descriptor->FindFieldByName(name);
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
    if (field->type() == FieldDescriptor::TYPE_STRING) {
      reflection->SetString(config, field, value);
    } else if (FirstError error; [&] {
                 google::protobuf::TextFormat::Parser parser;
                 parser.RecordErrorsTo(&error);
                 return !parser.ParseFieldValueFromString(value, field, config);
               }()) {
      return Invalid(absl::StrCat("flag --", name, "='", value, "' is not a valid ",
                                  field->type_name(), " value"));
    }
  }
  *args = std::move(rest);
  return absl::OkStatus();
}

absl::Status ResolveConfig(TrainerConfig* c, int world_size) {
  if (c->dp() < 1 || c->tp() < 1 || c->pp() < 1) {
    return Invalid(absl::StrCat("dp=", c->dp(), ", tp=", c->tp(), ", pp=", c->pp(),
                                ": each must be at least 1"));
  }
  if (c->dp() * c->tp() * c->pp() != world_size) {
    return Invalid(absl::StrCat("dp*tp*pp = ", c->dp(), "*", c->tp(), "*", c->pp(), " = ",
                                c->dp() * c->tp() * c->pp(), " but ", world_size,
                                " ranks were started; make the product equal the number of "
                                "ranks (or start train without a launcher to spawn dp*tp*pp)"));
  }
  TRIDENT_ASSIGN_OR_RETURN(PrecisionPolicy precision,
                           MakePrecisionPolicy(c->precision(), c->precision_table()));
  if (precision.compute == at::kHalf || precision.param == at::kHalf) {
    return absl::UnimplementedError(absl::StrCat(
        "precision=", c->precision(), " computes or stores float16, which needs a GPU; the "
        "trainer runs on CPU, whose kernels lack float16 (LayerNorm, matrix products): use bf16 "
        "or pure_bf16"));
  }
  if (c->loss_scale() < 0 || c->loss_scale_window() < 1 || c->hysteresis() < 1 ||
      !(c->min_loss_scale() > 0) || c->initial_scale_power() < 0 ||
      c->initial_scale_power() > 100) {
    return Invalid("loss_scale must not be negative, loss_scale_window and hysteresis must be at "
                   "least 1, min_loss_scale positive and initial_scale_power in [0, 100]");
  }
  if (!(c->gradient_predivide_factor() > 0)) return Invalid("gradient_predivide_factor must be positive");
  if (c->zero_stage() < 0 || c->zero_stage() > 3) {
    return Invalid(absl::StrCat("zero_stage=", c->zero_stage(), " is unknown; choose 0, 1, 2 or 3"));
  }
  if (c->zero_stage() == 3 && c->pp() > 1 && c->schedule() == "zb_h1") {
    return Invalid("zero_stage=3 with schedule zb_h1: zb_h1 runs weight gradients after ZeRO-3 "
                   "has released the layer's parameters; use zero_stage <= 2 or another schedule");
  }
  if (c->zero_reduce_bucket_size() < 1 || c->zero_allgather_bucket_size() < 1) {
    return Invalid("zero_reduce_bucket_size and zero_allgather_bucket_size must be positive");
  }
  if (c->sequence_parallel() && c->tp() == 1) {
    return Invalid("sequence_parallel needs tp > 1 (it splits the sequence over the tensor-parallel ranks)");
  }
  if (c->micro_batch_size() < 1) {
    return Invalid(absl::StrCat("micro_batch_size=", c->micro_batch_size(), " must be at least 1"));
  }
  const int64_t per_step = c->micro_batch_size() * c->dp();
  if (c->has_global_batch_size()) {
    if (c->global_batch_size() < 1 || c->global_batch_size() % per_step != 0) {
      return Invalid(absl::StrCat("global_batch_size=", c->global_batch_size(),
                                  " is not divisible by micro_batch_size*dp = ",
                                  c->micro_batch_size(), "*", c->dp(), " = ", per_step));
    }
    const int64_t accumulation = c->global_batch_size() / per_step;
    if (c->has_grad_accumulation_steps() && c->grad_accumulation_steps() != accumulation) {
      return Invalid(absl::StrCat(
          "global_batch_size=", c->global_batch_size(), " and grad_accumulation_steps=",
          c->grad_accumulation_steps(), " disagree: with micro_batch_size=",
          c->micro_batch_size(), " and dp=", c->dp(), " the global batch needs ", accumulation,
          " accumulation steps; set only one of the two"));
    }
    c->set_grad_accumulation_steps(accumulation);
  } else {
    const int64_t accumulation = c->has_grad_accumulation_steps() ? c->grad_accumulation_steps() : 1;
    if (accumulation < 1) {
      return Invalid(absl::StrCat("grad_accumulation_steps=", accumulation, " must be at least 1"));
    }
    c->set_grad_accumulation_steps(accumulation);
    c->set_global_batch_size(per_step * accumulation);
  }
  if (!(c->lr() > 0)) return Invalid(absl::StrCat("lr=", c->lr(), " must be positive"));
  if (c->min_lr() < 0 || c->min_lr() > c->lr()) {
    return Invalid(absl::StrCat("min_lr=", c->min_lr(), " must be in [0, lr=", c->lr(), "]"));
  }
  if (c->lr_scheduler() != "constant" && c->lr_scheduler() != "cosine" &&
      c->lr_scheduler() != "linear") {
    return Invalid(absl::StrCat("lr_scheduler='", c->lr_scheduler(),
                                "' is unknown; choose constant, cosine or linear"));
  }
  if (c->warmup_steps() < 0) return Invalid("warmup_steps must not be negative");
  if (c->weight_decay() < 0) return Invalid("weight_decay must not be negative");
  if (c->adam_beta1() < 0 || c->adam_beta1() >= 1 || c->adam_beta2() < 0 || c->adam_beta2() >= 1) {
    return Invalid(absl::StrCat("adam_beta1=", c->adam_beta1(), " and adam_beta2=",
                                c->adam_beta2(), " must be in [0, 1)"));
  }
  if (!(c->adam_eps() > 0)) return Invalid("adam_eps must be positive");
  if (c->grad_clip() < 0) return Invalid("grad_clip must not be negative (0 turns it off)");
  if (c->max_steps() < 1) return Invalid(absl::StrCat("max_steps=", c->max_steps(), " must be at least 1"));
  if (c->max_epochs() < 0) return Invalid("max_epochs must not be negative");
  if (c->eval_every() < 0 || c->eval_steps() < 1) {
    return Invalid("eval_every must not be negative and eval_steps must be at least 1");
  }
  if (c->log_every() < 1) return Invalid("log_every must be at least 1");
  if (c->save_every() < 0 || c->keep_last_n() < 0 || c->export_every() < 0) {
    return Invalid("save_every, keep_last_n and export_every must not be negative");
  }
  if ((c->save_every() > 0 || c->resume_from() == "last" || c->resume_from() == "best") &&
      c->save_dir().empty()) {
    return Invalid("save_every and resume_from=last|best need save_dir");
  }
  if (!(c->temperature() > 0) || c->top_k() < 0 || c->sample_tokens() < 0) {
    return Invalid("temperature must be positive; top_k and sample_tokens must not be negative");
  }
  if (!(c->bucket_size_mb() > 0)) return Invalid("bucket_size_mb must be positive");
  if (c->intra_op_threads() < 0) return Invalid("intra_op_threads must not be negative");
  if (c->activation_checkpointing() != "none" && c->activation_checkpointing() != "full" &&
      c->activation_checkpointing() != "stage_aware") {
    return Invalid(absl::StrCat("activation_checkpointing='", c->activation_checkpointing(),
                                "' is unknown; choose none, full or stage_aware"));
  }
  if (c->checkpoint_num_layers() < 1 || c->activation_checkpoint_ratio() < 0 ||
      c->activation_checkpoint_ratio() > 1) {
    return Invalid("checkpoint_num_layers must be at least 1 and activation_checkpoint_ratio in [0, 1]");
  }
  if (c->split_method() != "layer_split") {
    return Invalid(absl::StrCat(
        "split_method='", c->split_method(), "': the trainer's models are layer sequences, cut "
        "at layer boundaries; use layer_split (with custom_split_points to choose the cuts). "
        "farthest_min_deps and nearest_min_deps cut traced graphs (partition::PlanGraphStages)"));
  }
  if (!c->custom_split_points().empty()) {
    const int64_t points = std::count(c->custom_split_points().begin(),
                                      c->custom_split_points().end(), ',') + 1;
    const int64_t stages = static_cast<int64_t>(c->pp()) * c->virtual_stages();
    if (points != stages - 1) {
      return Invalid(absl::StrCat("custom_split_points='", c->custom_split_points(), "' names ",
                                  points, " layer(s) but pp*virtual_stages = ", stages,
                                  " stages need ", stages - 1, " (the first layer of every stage "
                                  "after the first)"));
    }
  }
  // The schedule must run this many stages and micro-batches (grad_accumulation_steps).
  TRIDENT_ASSIGN_OR_RETURN(auto schedule, MakeSchedule(c->schedule(), c->virtual_stages()));
  if (c->pp() == 1 && schedule->num_chunks() > 1) {
    return Invalid(absl::StrCat("schedule ", c->schedule(), " with virtual_stages=",
                                c->virtual_stages(), " needs pp > 1"));
  }
  if (c->pp() > 1) {
    TRIDENT_RETURN_IF_ERROR(schedule->Check(c->pp(), c->grad_accumulation_steps()));
  }
  return absl::OkStatus();
}

absl::StatusOr<ModelConfig> ResolveModelConfig(const TrainerConfig& c, int data_vocab_size) {
  TRIDENT_ASSIGN_OR_RETURN(ModelConfig model, PresetModelConfig(c.model(), c.preset()));
  if (c.has_n_layer()) model.n_layer = c.n_layer();
  if (c.has_n_head()) model.n_head = c.n_head();
  if (c.has_n_embd()) model.n_embd = c.n_embd();
  if (c.has_block_size()) model.block_size = c.block_size();
  model.vocab_size = c.has_vocab_size() ? c.vocab_size() : data_vocab_size;
  if (c.has_dropout()) model.dropout = c.dropout();
  if (c.has_n_kv_head()) model.n_kv_head = c.n_kv_head();
  if (c.has_intermediate_size()) model.intermediate_size = c.intermediate_size();
  if (c.has_rope_theta()) model.rope_theta = c.rope_theta();
  model.init_method_std = c.init_method_std();
  if (model.vocab_size < data_vocab_size) {
    return Invalid(absl::StrCat("vocab_size=", model.vocab_size, " is smaller than the data's ",
                                data_vocab_size, "-token vocabulary"));
  }
  // Checked here with rank 0's place, so bad sizes fail before any rank starts.
  model.tp = {c.tp(), 0, "tp", c.sequence_parallel()};
  TRIDENT_RETURN_IF_ERROR(ValidateModelConfig(model));
  const int64_t stages = static_cast<int64_t>(c.pp()) * c.virtual_stages();
  if (c.pp() > 1 && model.n_layer + 2 < stages) {
    return Invalid(absl::StrCat("pp*virtual_stages = ", stages, " pipeline stages but the model has ",
                                model.n_layer + 2, " layers (embedding, n_layer=", model.n_layer,
                                " blocks, head); lower pp or virtual_stages or raise n_layer"));
  }
  return model;
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

}  // namespace trident
