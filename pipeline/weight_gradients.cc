#include "pipeline/weight_gradients.h"

#include <unordered_map>
#include <unordered_set>

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

namespace trident {
namespace internal {
namespace {

using torch::autograd::Edge;
using torch::autograd::Node;

// Keeps the first gradients an operator receives (later replays pass the same).
class CaptureIncoming : public torch::autograd::FunctionPreHook {
 public:
  explicit CaptureIncoming(std::shared_ptr<std::vector<at::Tensor>> into) : into_(std::move(into)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (into_->empty()) *into_ = grads;
    return grads;
  }

 private:
  std::shared_ptr<std::vector<at::Tensor>> into_;
};

// Whether every path out of `node` ends in a parameter's gradient accumulator.
class ParameterOnly {
 public:
  explicit ParameterOnly(const DeferredWeightGradients::Parameters& parameters) : parameters_(parameters) {}
  bool operator()(Node* node) {
    auto found = memo_.find(node);
    if (found != memo_.end()) return found->second;
    bool result;
    if (auto* accumulate = dynamic_cast<torch::autograd::AccumulateGrad*>(node)) {
      result = parameters_.count(accumulate->variable.unsafeGetTensorImpl()) > 0;
    } else {
      result = false;
      for (const Edge& edge : node->next_edges()) {
        if (!edge.is_valid()) continue;
        result = (*this)(edge.function.get());
        if (!result) break;
      }
    }
    memo_.emplace(node, result);
    return result;
  }

 private:
  const DeferredWeightGradients::Parameters& parameters_;
  std::unordered_map<Node*, bool> memo_;
};

}  // namespace

bool DeferredWeightGradients::Defer(const std::vector<at::Tensor>& roots, const Parameters& parameters) {
  ParameterOnly parameter_only(parameters);
  std::vector<std::shared_ptr<Node>> stack;
  std::unordered_set<Node*> seen;
  for (const at::Tensor& root : roots) {
    std::shared_ptr<Node> start = root.grad_fn();
    if (start == nullptr || parameter_only(start.get()) || !seen.insert(start.get()).second) continue;
    stack.push_back(start);
  }
  if (stack.empty()) return false;
  while (!stack.empty()) {
    std::shared_ptr<Node> node = std::move(stack.back());
    stack.pop_back();
    Operator op{node, {}, std::make_shared<std::vector<at::Tensor>>()};
    for (uint32_t i = 0; i < node->num_outputs(); ++i) {
      const Edge& edge = node->next_edge(i);
      if (!edge.is_valid()) continue;
      if (parameter_only(edge.function.get())) {
        op.weight_edges.emplace_back(i, edge);
      } else if (seen.insert(edge.function.get()).second) {
        stack.push_back(edge.function);
      }
    }
    if (op.weight_edges.empty()) continue;
    // Edited in place: set_next_edge would recompute the topological order,
    // which only removing and later restoring the same edges cannot break.
    for (const auto& [i, edge] : op.weight_edges) node->next_edges()[i] = Edge();
    node->add_pre_hook(std::make_unique<CaptureIncoming>(op.incoming));
    deferred_.push_back(std::move(op));
  }
  return true;
}

void DeferredWeightGradients::Run() {
  // NOTE: one backward pass for all of them, so a parameter several operators
  // read (a tied weight, a weight used in two products) gets their gradients
  // summed and accumulated once, as an unsplit backward does.
  torch::autograd::edge_list roots;
  std::vector<at::Tensor> grads;
  for (Operator& op : deferred_) {
    if (op.incoming->empty()) continue;  // backward never reached it (no gradient flowed)
    // Keep only the weight edges, so the replay computes weight gradients alone.
    torch::autograd::edge_list& edges = op.node->next_edges();
    for (Edge& edge : edges) edge = Edge();
    for (auto& [i, edge] : op.weight_edges) edges[i] = std::move(edge);
    for (uint32_t k = 0; k < op.incoming->size(); ++k) {
      if (!(*op.incoming)[k].defined()) continue;
      roots.emplace_back(op.node, k);
      grads.push_back((*op.incoming)[k]);
    }
  }
  if (!roots.empty()) {
    torch::autograd::Engine::get_default_engine().execute(roots, grads, /*keep_graph=*/false,
                                                          /*create_graph=*/false,
                                                          /*accumulate_grad=*/true);
  }
  deferred_.clear();
}

}  // namespace internal
}  // namespace trident
