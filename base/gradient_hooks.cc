#include "base/gradient_hooks.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

namespace trident {
namespace {

class AccumulatedHook : public torch::autograd::FunctionPostHook {
 public:
  explicit AccumulatedHook(std::function<void()> callback) : callback_(std::move(callback)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    callback_();
    return outputs;
  }

 private:
  std::function<void()> callback_;
};

}  // namespace

void GradientAccumulatedHooks::Add(const at::Tensor& parameter, std::function<void()> callback) {
  std::shared_ptr<torch::autograd::Node> accumulator =
      torch::autograd::impl::grad_accumulator(parameter);
  accumulator->add_post_hook(std::make_unique<AccumulatedHook>(std::move(callback)));
  accumulators_.push_back(std::move(accumulator));
}

GradientAccumulatedHooks::~GradientAccumulatedHooks() {
  for (auto& accumulator : accumulators_) accumulator->post_hooks().clear();
}

}  // namespace trident
