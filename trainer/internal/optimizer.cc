#include "trainer/internal/optimizer.h"

#include <cmath>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace trident {
namespace internal {

AdamW::AdamW(NamedTensors parameters, AdamWOptions options)
    : parameters_(std::move(parameters)), options_(options) {
  for (const auto& [name, p] : parameters_) {
    params_.push_back(p);
    exp_avg_.push_back(at::zeros_like(p));
    exp_avg_sq_.push_back(at::zeros_like(p));
  }
}

namespace {

// One pass of AdamW over a contiguous float32 parameter: reads p, g, m, v once
// and writes p, m, v once (the multi-tensor form makes about nine passes).
void FusedAdamWStep(float* p, const float* g, float* m, float* v, int64_t n, float decay,
                    float beta1, float beta2, float inverse_sqrt_bias_correction2, float eps,
                    float step_size) {
  at::parallel_for(0, n, 1 << 14, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float grad = g[i];
      m[i] = m[i] * beta1 + grad * (1 - beta1);
      v[i] = v[i] * beta2 + grad * grad * (1 - beta2);
      const float denominator = std::sqrt(v[i]) * inverse_sqrt_bias_correction2 + eps;
      p[i] = p[i] * decay - step_size * (m[i] / denominator);
    }
  });
}

bool Fusable(const at::Tensor& t) {
  return t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous();
}

}  // namespace

void AdamW::Step(double lr) {
  at::NoGradGuard no_grad;
  ++steps_;
  const double bias_correction1 = 1.0 - std::pow(options_.beta1, static_cast<double>(steps_));
  const double bias_correction2 = 1.0 - std::pow(options_.beta2, static_cast<double>(steps_));
  std::vector<at::Tensor> params, grads, exp_avg, exp_avg_sq, decayed;
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i];
    const at::Tensor& g = p.grad();
    const bool decays = p.dim() >= 2 && options_.weight_decay != 0;
    if (Fusable(p) && Fusable(g)) {
      FusedAdamWStep(p.data_ptr<float>(), g.data_ptr<float>(), exp_avg_[i].data_ptr<float>(),
                     exp_avg_sq_[i].data_ptr<float>(), p.numel(),
                     decays ? static_cast<float>(1.0 - lr * options_.weight_decay) : 1.0f,
                     options_.beta1, options_.beta2,
                     static_cast<float>(1.0 / std::sqrt(bias_correction2)), options_.eps,
                     static_cast<float>(lr / bias_correction1));
      continue;
    }
    params.push_back(p);
    grads.push_back(g);
    exp_avg.push_back(exp_avg_[i]);
    exp_avg_sq.push_back(exp_avg_sq_[i]);
    if (decays) decayed.push_back(p);
  }
  if (params.empty()) return;
  // Other dtypes and devices: the same arithmetic with multi-tensor kernels.
  if (!decayed.empty()) at::_foreach_mul_(decayed, 1.0 - lr * options_.weight_decay);
  at::_foreach_mul_(exp_avg, options_.beta1);
  at::_foreach_add_(exp_avg, grads, 1.0 - options_.beta1);
  at::_foreach_mul_(exp_avg_sq, options_.beta2);
  at::_foreach_addcmul_(exp_avg_sq, grads, grads, 1.0 - options_.beta2);
  std::vector<at::Tensor> denominators = at::_foreach_sqrt(exp_avg_sq);
  at::_foreach_div_(denominators, std::sqrt(bias_correction2));
  at::_foreach_add_(denominators, options_.eps);
  at::_foreach_addcdiv_(params, exp_avg, denominators, -lr / bias_correction1);
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

absl::StatusOr<double> ClipGradNorm(const std::vector<at::Tensor>& counted,
                                    const std::vector<at::Tensor>& parameters, double max_norm,
                                    const ProcessGroup* group) {
  at::NoGradGuard no_grad;
  auto grads_of = [](const std::vector<at::Tensor>& tensors) {
    std::vector<at::Tensor> grads;
    for (const at::Tensor& p : tensors) {
      if (p.grad().defined()) grads.push_back(p.grad());
    }
    return grads;
  };
  const std::vector<at::Tensor> counted_grads = grads_of(counted);
  at::Tensor squares = counted_grads.empty()
                           ? at::zeros({1}, at::kDouble)
                           : at::stack(at::_foreach_norm(counted_grads)).to(at::kDouble).pow(2).sum().reshape({1});
  if (group != nullptr && group->size() > 1) TRIDENT_RETURN_IF_ERROR(group->AllReduce(squares));
  const double norm = std::sqrt(squares.item<double>());
  std::vector<at::Tensor> grads = grads_of(parameters);
  if (max_norm > 0 && norm > max_norm && !grads.empty()) {
    at::_foreach_mul_(grads, max_norm / (norm + 1e-6));
  }
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
