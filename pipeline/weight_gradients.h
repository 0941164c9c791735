// Splitting a backward pass into its input-gradient part and its
// weight-gradient part, for zero-bubble schedules (private to //pipeline).
//
// Works on any autograd graph without model changes: before backward, every
// edge from an operator into a subgraph that leads only to parameters (a
// matrix product's weight operand, a bias, a norm's scale) is cut and the
// operator's incoming gradient is captured when backward reaches it; backward
// then computes input gradients only. Run() later reconnects those edges alone
// and replays the captured operators in one backward pass, which computes just
// the weight gradients and accumulates each parameter's once into its .grad.
// A recomputed segment (RecomputeInBackward) is one such operator: it reruns
// when the input part first reaches it and hands over its parameters'
// gradients in the replay.
#ifndef TRIDENT_PIPELINE_WEIGHT_GRADIENTS_H_
#define TRIDENT_PIPELINE_WEIGHT_GRADIENTS_H_

#include <memory>
#include <unordered_set>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/edge.h>

namespace trident {
namespace internal {

class DeferredWeightGradients {
 public:
  using Parameters = std::unordered_set<const c10::TensorImpl*>;
  // Cuts the weight-gradient edges of the graph ending in `roots`; the caller
  // then runs backward from them with retain_graph = true. False (nothing
  // cut) when the whole graph leads only to parameters, such as a first stage
  // fed token ids: its backward is all weight gradients and runs as one.
  bool Defer(const std::vector<at::Tensor>& roots, const Parameters& parameters);
  // Computes the deferred weight gradients and releases their graph.
  void Run();
  bool empty() const { return deferred_.empty(); }

 private:
  struct Operator {
    std::shared_ptr<torch::autograd::Node> node;
    std::vector<std::pair<uint32_t, torch::autograd::Edge>> weight_edges;
    std::shared_ptr<std::vector<at::Tensor>> incoming;  // captured by a pre-hook
  };
  std::vector<Operator> deferred_;
};

}  // namespace internal
}  // namespace trident

#endif  // TRIDENT_PIPELINE_WEIGHT_GRADIENTS_H_
