// Callbacks that run after autograd accumulates a gradient into a parameter's
// .grad (post hooks on the parameter's grad accumulator), and the grouping of
// parameters into buckets, for reducers that start communication as soon as
// gradients are ready.
#ifndef TRIDENT_BASE_GRADIENT_HOOKS_H_
#define TRIDENT_BASE_GRADIENT_HOOKS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

namespace torch::autograd {
struct Node;
}  // namespace torch::autograd

namespace trident {

// `parameters` grouped into buckets of at most `bucket_bytes` (a larger
// parameter alone), in reverse order, roughly the order backward produces
// their gradients. With `kind`, a bucket holds parameters of one kind only.
std::vector<std::vector<at::Tensor>> BucketsInBackwardOrder(
    const std::vector<at::Tensor>& parameters, int64_t bucket_bytes,
    const std::function<int(const at::Tensor&)>& kind = nullptr);
// The same rule on sizes alone: indices into `bytes` (and `kinds`, when not
// empty) per bucket.
std::vector<std::vector<int>> BucketIndicesInBackwardOrder(const std::vector<int64_t>& bytes, int64_t bucket_bytes,
                                                           const std::vector<int>& kinds = {});

// The hooks live as long as this object: its destructor removes them.
class GradientAccumulatedHooks {
 public:
  GradientAccumulatedHooks() = default;
  GradientAccumulatedHooks(const GradientAccumulatedHooks&) = delete;
  GradientAccumulatedHooks& operator=(const GradientAccumulatedHooks&) = delete;
  ~GradientAccumulatedHooks();

  // Calls `callback` after each accumulation into `parameter`'s .grad. Makes
  // the parameter's grad accumulator now, which records the parameter's shape,
  // and returns it (the node backward runs for the parameter, kept alive here).
  const torch::autograd::Node* Add(const at::Tensor& parameter, std::function<void()> callback);

 private:
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
};

}  // namespace trident

#endif  // TRIDENT_BASE_GRADIENT_HOOKS_H_
