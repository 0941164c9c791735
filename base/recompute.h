// Selective recomputation (Megatron's selective activation recomputation,
// ATorch's checkpoint method): part of a layer runs without keeping its
// activations and reruns in backward.
//
//   at::Tensor y = RecomputeInBackward([&](const Values& in) { return Values{Attention(in[0])}; }, {x})[0];
#ifndef TRIDENT_BASE_RECOMPUTE_H_
#define TRIDENT_BASE_RECOMPUTE_H_

#include <functional>

#include "base/tensors.h"

namespace trident {

// Runs `forward` on `inputs` keeping only the inputs and the CPU RNG state
// (so dropout draws the same masks again); backward reruns it with gradients
// and backpropagates through the rerun: parameters' gradients accumulate as
// they would without recomputation, and the inputs get theirs. Without
// gradients (no_grad, evaluation) it just runs `forward`. The rerun sees the
// autocast state the forward saw (backward may run in another thread).
// `parameters` are the tensors `forward` reads besides its inputs: where none
// of the inputs needs a gradient (an embedding's token ids) but one of them
// does, the outputs still need gradients, so backward reruns the forward.
Values RecomputeInBackward(const std::function<Values(const Values&)>& forward, const Values& inputs,
                           const Values& parameters = {});

// A module whose forward can recompute itself in backward (the zoo's
// attention and MLP blocks); ParallelPlan::checkpoint_modules turns it on.
class RecomputableModule {
 public:
  virtual ~RecomputableModule() = default;
  void set_recompute(bool recompute) { recompute_ = recompute; }
  bool recompute() const { return recompute_; }

 private:
  bool recompute_ = false;
};

}  // namespace trident

#endif  // TRIDENT_BASE_RECOMPUTE_H_
