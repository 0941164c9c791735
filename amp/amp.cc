#include "amp/amp.h"

#include <cmath>
#include <map>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/core/GradMode.h>
#include <torch/version.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/autocast_state.h"
#include "base/status.h"

namespace trident {
namespace {

absl::StatusOr<at::ScalarType> ParseDtype(absl::string_view name) {
  if (name == "fp32") return at::kFloat;
  if (name == "bf16") return at::kBFloat16;
  if (name == "fp16") return at::kHalf;
  return absl::InvalidArgumentError(absl::StrCat("precision '", name, "' is unknown; choose fp32, bf16 or fp16"));
}

TRIDENT_REGISTER(PrecisionModeRegistry, "fp32", [](PrecisionPolicy&) {});
TRIDENT_REGISTER(PrecisionModeRegistry, "bf16", [](PrecisionPolicy& p) { p.compute = at::kBFloat16; });
TRIDENT_REGISTER(PrecisionModeRegistry, "fp16", [](PrecisionPolicy& p) {
  p.compute = at::kHalf;
  p.loss_scaling = true;
});
TRIDENT_REGISTER(PrecisionModeRegistry, "pure_bf16", [](PrecisionPolicy& p) { p.param = p.buffer = at::kBFloat16; });
TRIDENT_REGISTER(PrecisionModeRegistry, "pure_fp16", [](PrecisionPolicy& p) {
  p.param = p.buffer = at::kHalf;
  p.loss_scaling = true;
});

}  // namespace

Registry<PrecisionMode>& PrecisionModeRegistry() {
  static auto* registry = new Registry<PrecisionMode>("precision");
  return *registry;
}

absl::StatusOr<PrecisionPolicy> MakePrecisionPolicy(const std::string& mode, const std::string& table) {
  TRIDENT_ASSIGN_OR_RETURN(PrecisionMode set_mode, PrecisionModeRegistry().Find(mode));
  PrecisionPolicy policy;
  policy.mode = mode;
  set_mode(policy);
  if (table.empty()) return policy;
  for (absl::string_view entry : absl::StrSplit(table, ',')) {
    std::vector<absl::string_view> kv = absl::StrSplit(entry, '=');
    if (kv.size() != 2) {
      return absl::InvalidArgumentError(
          absl::StrCat("precision table entry '", entry, "' is not kind=dtype (param, buffer, input)"));
    }
    TRIDENT_ASSIGN_OR_RETURN(at::ScalarType dtype, ParseDtype(kv[1]));
    if (kv[0] == "param") {
      policy.param = dtype;
    } else if (kv[0] == "buffer") {
      policy.buffer = dtype;
    } else if (kv[0] == "input") {
      policy.input = dtype;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("precision table kind '", kv[0], "' is unknown; choose param, buffer or input"));
    }
  }
  if (policy.param == at::kHalf) policy.loss_scaling = true;
  return policy;
}

void ApplyPrecision(torch::nn::Module& module, const PrecisionPolicy& policy) {
  c10::NoGradGuard no_grad;
  for (auto& p : module.parameters()) {
    if (p.is_floating_point() && p.scalar_type() != policy.param) p.set_data(p.to(policy.param));
  }
  for (auto& b : module.buffers()) {
    if (b.is_floating_point() && b.scalar_type() != policy.buffer) b.set_data(b.to(policy.buffer));
  }
}

AutocastScope::AutocastScope(const PrecisionPolicy& policy, c10::DeviceType device)
    : active_(policy.compute != at::kFloat), device_(device) {
  if (!active_) return;
  const AutocastState was = GetAutocastState(device);
  was_enabled_ = was.enabled;
  was_dtype_ = was.dtype;
  SetAutocastState(device, {true, policy.compute});
  at::autocast::increment_nesting();
}

AutocastScope::~AutocastScope() {
  if (!active_) return;
  // Cached casts of the weights are dropped when the outermost scope ends.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  SetAutocastState(device_, {was_enabled_, was_dtype_});
}

LossScaler::LossScaler(LossScalerSpec options)
    : options_(options),
      scale_(options.loss_scale() > 0 ? options.loss_scale() : std::ldexp(1.0, options.initial_scale_power())),
      hysteresis_left_(options.hysteresis()) {}

void LossScaler::Update(bool overflow) {
  if (options_.loss_scale() > 0) return;  // static
  if (overflow) {
    clean_steps_ = 0;
    if (hysteresis_left_ > 1) {
      --hysteresis_left_;
    } else {
      scale_ = std::max(scale_ / 2, options_.min_loss_scale());
    }
    return;
  }
  hysteresis_left_ = options_.hysteresis();
  if (++clean_steps_ % options_.loss_scale_window() == 0) scale_ *= 2;
}

NamedTensors LossScaler::State() const {
  return {{"amp/loss_scale", at::full({1}, scale_, at::kDouble)},
          {"amp/hysteresis_left", at::full({1}, hysteresis_left_, at::kLong)},
          {"amp/clean_steps", at::full({1}, clean_steps_, at::kLong)}};
}

absl::Status LossScaler::LoadState(const NamedTensors& state) {
  auto get = [&](const std::string& name) -> absl::StatusOr<at::Tensor> {
    for (const auto& [key, tensor] : state) {
      if (key == name) return tensor;
    }
    return absl::NotFoundError(
        absl::StrCat("the loss scaler's state lacks '", name, "' (saved without loss scaling?)"));
  };
  TRIDENT_ASSIGN_OR_RETURN(at::Tensor scale, get("amp/loss_scale"));
  TRIDENT_ASSIGN_OR_RETURN(at::Tensor hysteresis, get("amp/hysteresis_left"));
  TRIDENT_ASSIGN_OR_RETURN(at::Tensor clean, get("amp/clean_steps"));
  scale_ = scale.item<double>();
  hysteresis_left_ = static_cast<int>(hysteresis.item<int64_t>());
  clean_steps_ = clean.item<int64_t>();
  return absl::OkStatus();
}

}  // namespace trident
