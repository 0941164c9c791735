#include "trainer/internal/optimizer.h"

#include <cmath>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace trident {
namespace internal {

AdamW::AdamW(NamedTensors parameters, AdamWOptions options)
    : parameters_(std::move(parameters)), options_(options) {
  for (const auto& [name, p] : parameters_) {
    params_.push_back(p);
    if (p.dim() >= 2) decayed_.push_back(p);
    exp_avg_.push_back(at::zeros_like(p));
    exp_avg_sq_.push_back(at::zeros_like(p));
  }
}

void AdamW::Step(double lr) {
  at::NoGradGuard no_grad;
  ++steps_;
  std::vector<at::Tensor> grads;
  grads.reserve(params_.size());
  for (const at::Tensor& p : params_) grads.push_back(p.grad());
  if (options_.weight_decay != 0 && !decayed_.empty()) {
    at::_foreach_mul_(decayed_, 1.0 - lr * options_.weight_decay);
  }
  at::_foreach_mul_(exp_avg_, options_.beta1);
  at::_foreach_add_(exp_avg_, grads, 1.0 - options_.beta1);
  at::_foreach_mul_(exp_avg_sq_, options_.beta2);
  at::_foreach_addcmul_(exp_avg_sq_, grads, grads, 1.0 - options_.beta2);
  const double bias_correction1 = 1.0 - std::pow(options_.beta1, static_cast<double>(steps_));
  const double bias_correction2 = 1.0 - std::pow(options_.beta2, static_cast<double>(steps_));
  std::vector<at::Tensor> denominators = at::_foreach_sqrt(exp_avg_sq_);
  at::_foreach_div_(denominators, std::sqrt(bias_correction2));
  at::_foreach_add_(denominators, options_.eps);
  at::_foreach_addcdiv_(params_, exp_avg_, denominators, -lr / bias_correction1);
}

NamedTensors AdamW::State() const {
  NamedTensors state;
  for (size_t i = 0; i < parameters_.size(); ++i) {
    state.emplace_back("exp_avg/" + parameters_[i].first, exp_avg_[i]);
    state.emplace_back("exp_avg_sq/" + parameters_[i].first, exp_avg_sq_[i]);
  }
  state.emplace_back("steps", at::tensor({steps_}, at::kLong));
  return state;
}

absl::Status AdamW::LoadState(const SafetensorsContents& contents) {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < parameters_.size(); ++i) {
    for (auto [prefix, target] : {std::make_pair("exp_avg/", &exp_avg_[i]),
                                  std::make_pair("exp_avg_sq/", &exp_avg_sq_[i])}) {
      TRIDENT_ASSIGN_OR_RETURN(at::Tensor saved, contents.Get(prefix + parameters_[i].first));
      if (!saved.sizes().equals(target->sizes())) {
        return absl::InvalidArgumentError(absl::StrCat(
            "optimizer state ", prefix, parameters_[i].first, " in ", contents.path, " has shape ",
            c10::str(saved.sizes()), ", the model needs ", c10::str(target->sizes())));
      }
      target->copy_(saved);
    }
  }
  TRIDENT_ASSIGN_OR_RETURN(at::Tensor steps, contents.Get("steps"));
  steps_ = steps.item<int64_t>();
  return absl::OkStatus();
}

double ClipGradNorm(const std::vector<at::Tensor>& parameters, double max_norm) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  for (const at::Tensor& p : parameters) {
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  if (grads.empty()) return 0.0;
  const double norm = at::stack(at::_foreach_norm(grads)).norm().item<double>();
  if (max_norm > 0 && norm > max_norm) at::_foreach_mul_(grads, max_norm / (norm + 1e-6));
  return norm;
}

double LearningRate(const std::string& schedule, double lr, double min_lr, int64_t warmup_steps,
                    int64_t max_steps, int64_t step) {
  if (step < warmup_steps) return lr * static_cast<double>(step + 1) / (warmup_steps + 1);
  if (schedule == "constant" || max_steps <= warmup_steps) return lr;
  const double progress =
      std::min(1.0, static_cast<double>(step - warmup_steps) / (max_steps - warmup_steps));
  if (schedule == "linear") return lr + (min_lr - lr) * progress;
  return min_lr + 0.5 * (1.0 + std::cos(M_PI * progress)) * (lr - min_lr);  // cosine
}

}  // namespace internal
}  // namespace trident
