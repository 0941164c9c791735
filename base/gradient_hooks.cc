#include "base/gradient_hooks.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

namespace trident {

std::vector<std::vector<int>> BucketIndicesInBackwardOrder(const std::vector<int64_t>& bytes, int64_t bucket_bytes,
                                                           const std::vector<int>& kinds) {
  std::vector<std::vector<int>> buckets;
  int64_t filled = 0;
  int open_kind = 0;
  for (int i = static_cast<int>(bytes.size()) - 1; i >= 0; --i) {
    const int kind = kinds.empty() ? 0 : kinds[i];
    if (buckets.empty() || filled + bytes[i] > bucket_bytes || kind != open_kind) {
      if (buckets.empty() || !buckets.back().empty()) buckets.emplace_back();
      filled = 0;
      open_kind = kind;
    }
    buckets.back().push_back(i);
    filled += bytes[i];
  }
  return buckets;
}

std::vector<std::vector<at::Tensor>> BucketsInBackwardOrder(const std::vector<at::Tensor>& parameters,
                                                            int64_t bucket_bytes,
                                                            const std::function<int(const at::Tensor&)>& kind) {
  std::vector<int64_t> bytes;
  std::vector<int> kinds;
  for (const at::Tensor& p : parameters) {
    bytes.push_back(p.numel() * static_cast<int64_t>(p.element_size()));
    kinds.push_back(kind ? kind(p) : 0);
  }
  std::vector<std::vector<at::Tensor>> buckets;
  for (const std::vector<int>& indices : BucketIndicesInBackwardOrder(bytes, bucket_bytes, kinds)) {
    buckets.emplace_back();
    for (int i : indices) buckets.back().push_back(parameters[i]);
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

const torch::autograd::Node* GradientAccumulatedHooks::Add(const at::Tensor& parameter,
                                                           std::function<void()> callback) {
  std::shared_ptr<torch::autograd::Node> accumulator = torch::autograd::impl::grad_accumulator(parameter);
  accumulator->add_post_hook(std::make_unique<AccumulatedHook>(std::move(callback)));
  accumulators_.push_back(std::move(accumulator));
  return accumulators_.back().get();
}

GradientAccumulatedHooks::~GradientAccumulatedHooks() {
  for (auto& accumulator : accumulators_) accumulator->post_hooks().clear();
}

}  // namespace trident
