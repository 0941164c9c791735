#include "base/recompute.h"

#include <ATen/core/ivalue.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include "base/autocast_state.h"
#include "base/rng.h"

namespace trident {
namespace {

struct RecomputedForward : torch::CustomClassHolder {
  std::function<Values(const Values&)> forward;
  at::Tensor rng;  // the CPU generator's state when the forward ran
  // Autocast as the forward saw it: backward may run in another thread.
  AutocastState cpu_autocast, cuda_autocast;
};

class RecomputeFunction : public torch::autograd::Function<RecomputeFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                c10::intrusive_ptr<RecomputedForward> recomputed,
                                                at::TensorList inputs) {  // a TensorList: autograd sees each tensor
    recomputed->rng = CpuRngState();
    recomputed->cpu_autocast = GetAutocastState(c10::DeviceType::CPU);
    recomputed->cuda_autocast = GetAutocastState(c10::DeviceType::CUDA);
    ctx->save_for_backward(inputs.vec());
    Values outputs = recomputed->forward(inputs.vec());  // gradients are off in here
    ctx->saved_data["forward"] = c10::IValue::make_capsule(std::move(recomputed));
    return outputs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto recomputed = c10::static_intrusive_pointer_cast<RecomputedForward>(ctx->saved_data["forward"].toCapsule());
    Values inputs;
    for (const at::Tensor& saved : ctx->get_saved_variables()) {
      inputs.push_back(saved.defined() ? saved.detach().requires_grad_(saved.requires_grad()) : saved);
    }
    const at::Tensor rng = CpuRngState();
    const AutocastState cpu = GetAutocastState(c10::DeviceType::CPU), cuda = GetAutocastState(c10::DeviceType::CUDA);
    SetCpuRngState(recomputed->rng);
    SetAutocastState(c10::DeviceType::CPU, recomputed->cpu_autocast);
    SetAutocastState(c10::DeviceType::CUDA, recomputed->cuda_autocast);
    Values outputs;
    {
      c10::AutoGradMode with_grad(true);
      outputs = recomputed->forward(inputs);
    }
    SetAutocastState(c10::DeviceType::CPU, cpu);
    SetAutocastState(c10::DeviceType::CUDA, cuda);
    SetCpuRngState(rng);
    Values roots, with;
    for (size_t k = 0; k < outputs.size() && k < grads.size(); ++k) {
      if (!outputs[k].defined() || !outputs[k].requires_grad() || !grads[k].defined()) continue;
      roots.push_back(outputs[k]);
      with.push_back(grads[k]);
    }
    if (!roots.empty()) torch::autograd::backward(roots, with);
    torch::autograd::variable_list input_grads = {at::Tensor()};  // for `recomputed`
    for (const at::Tensor& input : inputs) {
      input_grads.push_back(input.defined() && input.requires_grad() ? input.grad() : at::Tensor());
    }
    return input_grads;
  }
};

}  // namespace

Values RecomputeInBackward(const std::function<Values(const Values&)>& forward, const Values& inputs) {
  if (!c10::GradMode::is_enabled()) return forward(inputs);
  auto recomputed = c10::make_intrusive<RecomputedForward>();
  recomputed->forward = forward;
  return RecomputeFunction::apply(recomputed, at::TensorList(inputs));
}

}  // namespace trident
