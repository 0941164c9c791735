// Callbacks that run after autograd accumulates a gradient into a parameter's
// .grad (post hooks on the parameter's grad accumulator), for reducers that
// start communication as soon as gradients are ready.
#ifndef TRIDENT_BASE_GRADIENT_HOOKS_H_
#define TRIDENT_BASE_GRADIENT_HOOKS_H_

#include <functional>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

namespace torch::autograd {
struct Node;
}  // namespace torch::autograd

namespace trident {

// The hooks live as long as this object: its destructor removes them.
class GradientAccumulatedHooks {
 public:
  GradientAccumulatedHooks() = default;
  GradientAccumulatedHooks(const GradientAccumulatedHooks&) = delete;
  GradientAccumulatedHooks& operator=(const GradientAccumulatedHooks&) = delete;
  ~GradientAccumulatedHooks();

  // Calls `callback` after each accumulation into `parameter`'s .grad. Makes
  // the parameter's grad accumulator now, which records the parameter's shape.
  void Add(const at::Tensor& parameter, std::function<void()> callback);

 private:
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
};

}  // namespace trident

#endif  // TRIDENT_BASE_GRADIENT_HOOKS_H_
