// replace: module replacement (ATorch's module_replace): parts of a model's
// forward swapped for optimized implementations that compute the same thing.
//
// Four pairs are built in, each a registered operator with its own forward
// and backward (trident::causal_attention, trident::add_layer_norm,
// trident::bias_gelu, trident::cross_entropy):
//
//   fused_attention   causal softmax attention computed in blocks of queries:
//                     no scores above the diagonal outside a block are
//                     computed. fp32 on the CPU: one task per batch and head
//                     whose blocks of 64 queries stay in the caches, keeping
//                     only each query's log-sum-exp for backward (which
//                     recomputes the probabilities); other CPU dtypes: ATen
//                     operators on blocks of 128 queries; on CUDA (LibTorch 2)
//                     the SDPA kernels
//   fused_layer_norm  residual add + LayerNorm as one operator with one
//                     backward (the sum's gradient goes to both summands)
//   fused_bias_gelu   bias add + GELU written once (GELU in place in the sum's
//                     buffer); backward adds again instead of keeping the sum
//   fused_cross_entropy  the mean cross-entropy of logits [N, C] as one
//                     operator: log-softmax in fp32 and, in the same forward, the
//                     logits' gradient in that buffer, which is all backward
//                     keeps (unfused, the log-softmax is kept and backward makes
//                     two more buffers of the logits' size); on CUDA (the CMake
//                     GPU build) two kernels: each row's log-sum-exp in one pass
//                     over the logits, and backward's gradient written in the
//                     logits' precision in one more, nothing else of their size
//
// A pair replaces two kinds of originals:
//   - modules, by type: each module of a model is offered to the pair's
//     `replace_module`, which switches it over when it is one of its originals.
//     The zoo's attention, MLP and blocks are ReplaceableModules.
//   - traced operator patterns: TorchScript IR rewritten in a traced graph
//     (a C++ module or a TorchScript file traced by Parallelize).
//
//   ReplaceReport report = *ReplaceModules(*model, {"fused_attention"}, at::kFloat);
//
// Users register their own pairs from C++, as ATorch's register_replace_pair:
//
//   TRIDENT_REGISTER(trident::ReplacePairRegistry, "my_norm", trident::ReplacePair{
//       {at::kFloat, at::kBFloat16},
//       [](torch::nn::Module& m) {  // the module side: MyNorm modules switch to their fast path
//         auto* norm = dynamic_cast<MyNormImpl*>(&m);
//         if (norm != nullptr) norm->use_fast = true;
//         return norm != nullptr;
//       },
//       {{"graph(%x, ...): ... original IR ...", "graph(%x, ...): ... replacement IR ..."}}});
#ifndef TRIDENT_REPLACE_REPLACE_H_
#define TRIDENT_REPLACE_REPLACE_H_

#include <functional>
#include <memory>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include "absl/status/statusor.h"
#include "base/registry.h"
#include "graph/model_graph.h"

namespace torch {
namespace jit {  // torch::jit::Graph and torch::nn::Module come with model_graph.h
struct Match;
struct Value;
}  // namespace jit
}  // namespace torch

namespace trident {

// One rewrite of a traced graph: every match of `pattern` (TorchScript IR,
// torch::jit::SubgraphRewriter's syntax) that `filter` accepts (none: all)
// becomes `replacement`.
struct GraphRewrite {
  using Filter =
      std::function<bool(const torch::jit::Match&, const std::unordered_map<std::string, torch::jit::Value*>&)>;
  std::string pattern;
  std::string replacement;
  Filter filter;
};

// A replacement pair (ATorch's register_replace_pair), registered by name in
// ReplacePairRegistry.
struct ReplacePair {
  // The compute dtypes it is exact for; under any other it is left out (and
  // the report says so).
  std::set<at::ScalarType> supported_dtypes;
  // Switches `module` to the optimized implementation when it is one of the
  // pair's originals; returns whether it did. May be empty (graph-only pair).
  std::function<bool(torch::nn::Module& module)> replace_module;
  // The pair's operator patterns in traced graphs. May be empty (module-only).
  std::vector<GraphRewrite> graph_rewrites;
};

// The pairs by name; the built-ins register here as users do.
Registry<ReplacePair>& ReplacePairRegistry();

// A module whose forward can switch parts of itself to replacement pairs (the
// zoo's attention, MLP and transformer blocks); the built-in pairs' module
// side. Offers(pair) says whether the pair applies to it as configured (fused
// attention does not apply to attention with dropout).
class ReplaceableModule {
 public:
  virtual ~ReplaceableModule() = default;
  virtual bool Offers(const std::string& pair) const = 0;
  void Use(const std::string& pair) { used_.insert(pair); }
  bool Uses(const std::string& pair) const { return used_.count(pair) > 0; }

 private:
  std::set<std::string> used_;
};

// The built-in pairs' module side: switches a ReplaceableModule that offers
// `pair` over to it.
bool UseBuiltInPair(const std::string& pair, torch::nn::Module& module);

// What a replacement did: per requested pair (in request order), how many
// modules or graph matches it replaced, and the pairs left out for the dtype.
struct ReplaceReport {
  std::vector<std::string> pairs;
  std::vector<int> hits;
  std::vector<std::string> unsupported;  // "fused_x (float16)"
  // "module_replace: fused_attention 4, fused_layer_norm 4 (left out: ...)".
  std::string Summary() const;
};

// Applies the named pairs (registry names; unknown names are errors that
// list the registered ones) to every module of `model` under `compute_dtype`.
absl::StatusOr<ReplaceReport> ReplaceModules(torch::nn::Module& model, const std::vector<std::string>& pairs,
                                             at::ScalarType compute_dtype);

// A traced model with the pairs' graph rewrites applied: trace `forward`
// (ModelGraph::Trace with `parameters`) for the rewritten graph.
struct ReplacedGraph {
  ModelGraph::Forward forward;
  std::vector<std::pair<std::string, at::Tensor>> parameters;
  ReplaceReport report;
};

// Applies the named pairs' graph rewrites to a copy of `model`'s graph
// (linear products canonicalized first, constants folded and pooled).
absl::StatusOr<ReplacedGraph> ReplaceInGraph(const ModelGraph& model, const std::vector<std::string>& pairs,
                                             at::ScalarType compute_dtype);

}  // namespace trident

#endif  // TRIDENT_REPLACE_REPLACE_H_
