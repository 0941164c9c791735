#include "parallel/optimizer.h"

#include <cmath>
#include <map>
#include <sstream>
#include <string>
#include <type_traits>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>
#include <torch/version.h>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "kernels/kernels.h"

namespace trident {
namespace {

bool Fusable(const at::Tensor& t) { return t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(); }

// GPU parameters of one device and dtype, updated together by LibTorch 2's
// multi-tensor AdamW kernel (PyTorch's fused=True): one launch for all of
// them instead of about nine per tensor.
struct GpuAdamWBatch {
  std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, steps;
};

}  // namespace

torch::Tensor FusedAdamW::step(LossClosure closure) {
  // The fused pass calls no ATen operator: without this scope a profile
  // (--profile_step) would not see it (about a tenth of a bf16 gpt-tiny step).
  RECORD_USER_SCOPE("trident::fused_adamw");
  c10::NoGradGuard no_grad;
  torch::Tensor loss;
  if (closure != nullptr) {
    c10::AutoGradMode enable_grad(true);
    loss = closure();
  }
  for (auto& group : param_groups()) {
    const auto& options = static_cast<const torch::optim::AdamWOptions&>(group.options());
    TORCH_CHECK(!options.amsgrad(), "FusedAdamW does not implement amsgrad");
    const double lr = options.lr(), decay = options.weight_decay(), eps = options.eps();
    const double beta1 = std::get<0>(options.betas()), beta2 = std::get<1>(options.betas());
    std::map<std::pair<std::string, at::ScalarType>, GpuAdamWBatch> gpu;
    // The fused kernel only reads the step counts: parameters at the same step
    // on a device share one tensor (one fill per step, not one per parameter).
    std::map<std::pair<std::string, int64_t>, at::Tensor> step_tensors;
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      const at::Tensor& grad = p.grad();
      using Key = typename std::decay_t<decltype(state())>::key_type;
      const Key key = OptimizerStateKey<Key>(p.unsafeGetTensorImpl());
      auto found = state().find(key);
      if (found == state().end()) {
        auto fresh = std::make_unique<torch::optim::AdamWParamState>();
        fresh->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
        fresh->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
        found = state().emplace(key, std::move(fresh)).first;
      }
      auto& s = static_cast<torch::optim::AdamWParamState&>(*found->second);
      s.step(s.step() + 1);
      const double bias_correction1 = 1 - std::pow(beta1, static_cast<double>(s.step()));
      const double bias_correction2 = 1 - std::pow(beta2, static_cast<double>(s.step()));
      if (Fusable(p) && Fusable(grad) && Fusable(s.exp_avg()) && Fusable(s.exp_avg_sq())) {
        FusedAdamWStep(p.data_ptr<float>(), grad.data_ptr<float>(), s.exp_avg().data_ptr<float>(),
                       s.exp_avg_sq().data_ptr<float>(), p.numel(), static_cast<float>(1.0 - lr * decay), beta1, beta2,
                       static_cast<float>(1.0 / std::sqrt(bias_correction2)), eps,
                       static_cast<float>(lr / bias_correction1));
        continue;
      }
#if TORCH_VERSION_MAJOR >= 2
      if (p.is_cuda() && grad.scalar_type() == p.scalar_type() && s.exp_avg().scalar_type() == p.scalar_type()) {
        GpuAdamWBatch& batch = gpu[{p.device().str(), p.scalar_type()}];
        batch.params.push_back(p);
        batch.grads.push_back(grad);
        batch.exp_avgs.push_back(s.exp_avg());
        batch.exp_avg_sqs.push_back(s.exp_avg_sq());
        at::Tensor& step = step_tensors[{p.device().str(), s.step()}];
        if (!step.defined()) step = at::full({}, static_cast<double>(s.step()), p.options().dtype(at::kFloat));
        batch.steps.push_back(step);
        continue;
      }
#endif
      // Other dtypes and devices: the same arithmetic, tensor by tensor.
      if (decay != 0) p.mul_(1 - lr * decay);
      s.exp_avg().mul_(beta1).add_(grad, 1 - beta1);
      s.exp_avg_sq().mul_(beta2).addcmul_(grad, grad, 1 - beta2);
      at::Tensor denominator = (s.exp_avg_sq().sqrt() / std::sqrt(bias_correction2)).add_(eps);
      p.addcdiv_(s.exp_avg(), denominator, -lr / bias_correction1);
    }
#if TORCH_VERSION_MAJOR >= 2
    for (auto& [where, b] : gpu) {
      at::_fused_adamw_(b.params, b.grads, b.exp_avgs, b.exp_avg_sqs, /*max_exp_avg_sqs=*/{}, b.steps, lr, beta1, beta2,
                        decay, eps, /*amsgrad=*/false, /*maximize=*/false);
    }
#endif
  }
  return loss;
}

Registry<OptimizerMaker>& OptimizerRegistry() {
  static auto* registry = new Registry<OptimizerMaker>("optimizer");
  return *registry;
}

absl::StatusOr<OptimizerFactory> MakeOptimizerFactory(const std::string& type, const ComponentArgs& args) {
  TRIDENT_ASSIGN_OR_RETURN(OptimizerMaker make, OptimizerRegistry().Find(type));
  return make(args);
}

void SetLearningRate(torch::optim::Optimizer& optimizer, double lr) {
  for (auto& group : optimizer.param_groups()) group.options().set_lr(lr);
}

namespace {

// beta1, beta2, eps and weight_decay, checked.
struct AdamArgs {
  double beta1, beta2, eps, weight_decay;
};
absl::StatusOr<AdamArgs> ReadAdamArgs(const ComponentArgs& args, double default_decay) {
  TRIDENT_RETURN_IF_ERROR(args.CheckKnown({"beta1", "beta2", "eps", "weight_decay"}));
  AdamArgs a;
  TRIDENT_ASSIGN_OR_RETURN(a.beta1, args.GetDouble("beta1", 0.9));
  TRIDENT_ASSIGN_OR_RETURN(a.beta2, args.GetDouble("beta2", 0.999));
  TRIDENT_ASSIGN_OR_RETURN(a.eps, args.GetDouble("eps", 1e-8));
  TRIDENT_ASSIGN_OR_RETURN(a.weight_decay, args.GetDouble("weight_decay", default_decay));
  if (a.beta1 < 0 || a.beta1 >= 1 || a.beta2 < 0 || a.beta2 >= 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(args.owner(), ": beta1=", a.beta1, " and beta2=", a.beta2, " must be in [0, 1)"));
  }
  if (!(a.eps > 0) || a.weight_decay < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(args.owner(), ": eps must be positive and weight_decay not negative"));
  }
  return a;
}

template <typename Optimizer, typename Options>
OptimizerFactory AdamFactory(AdamArgs a, bool decoupled) {
  return [a, decoupled](const std::vector<std::vector<at::Tensor>>& groups) {
    std::vector<torch::optim::OptimizerParamGroup> param_groups;
    for (size_t g = 0; g < groups.size(); ++g) {
      auto options = std::make_unique<Options>(0.0);
      options->betas({a.beta1, a.beta2}).eps(a.eps);
      options->weight_decay(g == 0 && decoupled ? a.weight_decay : 0.0);
      param_groups.emplace_back(groups[g], std::move(options));
    }
    return std::unique_ptr<torch::optim::Optimizer>(new Optimizer(param_groups, Options(0.0)));
  };
}

TRIDENT_REGISTER(OptimizerRegistry, "adamw", [](const ComponentArgs& args) -> absl::StatusOr<OptimizerFactory> {
  TRIDENT_ASSIGN_OR_RETURN(AdamArgs a, ReadAdamArgs(args, 0.01));
  return AdamFactory<FusedAdamW, torch::optim::AdamWOptions>(a, /*decoupled=*/true);
});

TRIDENT_REGISTER(OptimizerRegistry, "adam", [](const ComponentArgs& args) -> absl::StatusOr<OptimizerFactory> {
  TRIDENT_ASSIGN_OR_RETURN(AdamArgs a, ReadAdamArgs(args, 0.0));
  if (a.weight_decay != 0) {
    return absl::InvalidArgumentError(
        "optimizer 'adam' takes no weight_decay here (it would be L2 on every parameter); use adamw");
  }
  return AdamFactory<torch::optim::Adam, torch::optim::AdamOptions>(a, /*decoupled=*/false);
});

TRIDENT_REGISTER(OptimizerRegistry, "sgd", [](const ComponentArgs& args) -> absl::StatusOr<OptimizerFactory> {
  TRIDENT_RETURN_IF_ERROR(args.CheckKnown({"momentum", "weight_decay"}));
  TRIDENT_ASSIGN_OR_RETURN(const double momentum, args.GetDouble("momentum", 0.0));
  TRIDENT_ASSIGN_OR_RETURN(const double decay, args.GetDouble("weight_decay", 0.0));
  if (momentum < 0 || decay < 0) {
    return absl::InvalidArgumentError("optimizer 'sgd': momentum and weight_decay must not be negative");
  }
  return OptimizerFactory([momentum, decay](const std::vector<std::vector<at::Tensor>>& groups) {
    std::vector<torch::optim::OptimizerParamGroup> param_groups;
    for (size_t g = 0; g < groups.size(); ++g) {
      auto options = std::make_unique<torch::optim::SGDOptions>(0.0);
      options->momentum(momentum).weight_decay(g == 0 ? decay : 0.0);
      param_groups.emplace_back(groups[g], std::move(options));
    }
    return std::unique_ptr<torch::optim::Optimizer>(new torch::optim::SGD(param_groups, torch::optim::SGDOptions(0.0)));
  });
});

}  // namespace

Registry<LrSchedule>& LrScheduleRegistry() {
  static auto* registry = new Registry<LrSchedule>("lr_scheduler");
  return *registry;
}

namespace {

TRIDENT_REGISTER(LrScheduleRegistry, "constant", [](double lr, double, double) { return lr; });
TRIDENT_REGISTER(LrScheduleRegistry, "linear",
                 [](double lr, double min_lr, double progress) { return lr + (min_lr - lr) * progress; });
TRIDENT_REGISTER(LrScheduleRegistry, "cosine", [](double lr, double min_lr, double progress) {
  return min_lr + 0.5 * (1.0 + std::cos(M_PI * progress)) * (lr - min_lr);
});

}  // namespace

absl::StatusOr<double> LearningRate(const std::string& schedule, double lr, double min_lr, int64_t warmup_steps,
                                    int64_t max_steps, int64_t step) {
  TRIDENT_ASSIGN_OR_RETURN(LrSchedule decay, LrScheduleRegistry().Find(schedule));
  if (step < warmup_steps) return lr * static_cast<double>(step + 1) / (warmup_steps + 1);
  if (max_steps <= warmup_steps) return lr;
  return decay(lr, min_lr, std::min(1.0, static_cast<double>(step - warmup_steps) / (max_steps - warmup_steps)));
}

}  // namespace trident
