#include "base/recompute.h"

#include <algorithm>

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
  size_t num_inputs = 0;   // the forward's inputs: the first of the Function's
  size_t num_anchors = 0;  // after them: tensors that only make the outputs need gradients
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
    const Values forward_inputs(inputs.begin(), inputs.begin() + recomputed->num_inputs);
    ctx->save_for_backward(forward_inputs);
    Values outputs = recomputed->forward(forward_inputs);  // gradients are off in here
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
    input_grads.resize(input_grads.size() + recomputed->num_anchors);
    return input_grads;
  }
};

}  // namespace

Values RecomputeInBackward(const std::function<Values(const Values&)>& forward, const Values& inputs,
                           const Values& parameters) {
  if (!c10::GradMode::is_enabled()) return forward(inputs);
  auto recomputed = c10::make_intrusive<RecomputedForward>();
  recomputed->forward = forward;
  recomputed->num_inputs = inputs.size();
  auto needs_gradient = [](const at::Tensor& t) { return t.defined() && t.requires_grad(); };
  Values anchored = inputs;
  if (std::none_of(inputs.begin(), inputs.end(), needs_gradient) &&
      std::any_of(parameters.begin(), parameters.end(), needs_gradient)) {
    // The Function's outputs need gradients only where one of its inputs does.
    anchored.push_back(at::empty({0}, parameters.front().options()).requires_grad_(true));
    recomputed->num_anchors = 1;
  }
  return RecomputeFunction::apply(recomputed, at::TensorList(anchored));
}

}  // namespace trident
