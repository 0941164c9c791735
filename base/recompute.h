// Activation recomputation (Megatron's activation checkpointing, ATorch's
// checkpoint method): part of a model runs without keeping its activations
// and reruns in backward.
//
//   at::Tensor y = RecomputeInBackward([&](const Values& in) { return Values{attn(in[0])}; },
//                                      {x}, attn->parameters())[0];
#ifndef TRIDENT_BASE_RECOMPUTE_H_
#define TRIDENT_BASE_RECOMPUTE_H_

#include <functional>

#include "base/tensors.h"

namespace trident {

// Runs `forward` on `inputs` without gradients, keeping only the inputs;
// backward reruns it with gradients and backpropagates through the rerun
// within the same backward pass: the gradients of the inputs and of
// `parameters` leave the rerun as this node's own, so autograd sums every
// contribution to a parameter (a tied weight read here and elsewhere) and
// accumulates it once, as without recomputation, and hooks on a parameter's
// accumulation fire once per backward.
//
// The rerun computes what the first run did: the same inputs (modifying one
// in place in between is an error), the CPU and GPU generators' states (the
// same dropout masks) and autocast's state as the first run saw them
// (backward may run in another thread). Autocast's cache of weight casts:
// the first run neither reads nor fills it (a cast made without gradients,
// read later, would cut its weight's gradient off); the rerun shares its
// casts among its own reads, as the first run's plain equivalent would, and
// empties the cache before and after (a backward thread's cache is never
// emptied otherwise, and would serve stale weights in the next step). A
// weight cast both inside and outside the recomputed part has its
// lower-precision gradients summed in two parts instead of one.
//
// `parameters` must list every tensor needing a gradient that `forward`
// reads besides `inputs` (a module's parameters() will do; one listed twice,
// or also an input, counts once); backward throws, naming the tensor's
// shape, for one that is missing, whose gradient would otherwise be lost.
//
// Where backward asks for only some of the gradients (a split backward that
// computes the inputs' gradients first and the parameters' later), the rerun
// happens at the first request for any gradient and the rest wait in the
// node for theirs. Each gradient is handed out once: a second backward
// through the same node (retain_graph) throws.
//
// Without gradients (no_grad, evaluation) it just runs `forward`. With
// `ahead`, it is set to a function that reruns the forward now (a pipeline
// schedule that recomputes before the gradient arrives); backward then uses
// that rerun. Calling it more than once, or after backward, does nothing.
Values RecomputeInBackward(const std::function<Values(const Values&)>& forward, const Values& inputs,
                           const Values& parameters, std::function<void()>* ahead = nullptr);

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
