#include "base/gradient_hooks.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

namespace trident {

std::vector<std::vector<at::Tensor>> BucketsInBackwardOrder(
    const std::vector<at::Tensor>& parameters, int64_t bucket_bytes,
    const std::function<int(const at::Tensor&)>& kind) {
  std::vector<std::vector<at::Tensor>> buckets;
  int64_t bytes = 0;
  int open_kind = 0;
  for (auto it = parameters.rbegin(); it != parameters.rend(); ++it) {
    const int64_t size = it->numel() * static_cast<int64_t>(it->element_size());
    const int this_kind = kind ? kind(*it) : 0;
    if (buckets.empty() || bytes + size > bucket_bytes || this_kind != open_kind) {
      if (buckets.empty() || !buckets.back().empty()) buckets.emplace_back();
      bytes = 0;
      open_kind = this_kind;
    }
    buckets.back().push_back(*it);
    bytes += size;
  }
  return buckets;
}
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
