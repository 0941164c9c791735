// The replacement-pair registry, the built-in pairs, and applying pairs to
// modules and to traced graphs.
#include <cmath>
#include <limits>
#include <optional>

#include <ATen/ATen.h>
#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/ir/irparser.h>
#include <torch/csrc/jit/ir/subgraph_matcher.h>
#include <torch/csrc/jit/passes/constant_pooling.h>
#include <torch/csrc/jit/passes/constant_propagation.h>
#include <torch/csrc/jit/passes/subgraph_rewrite.h>
#include <torch/nn/module.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "base/status.h"
#include "replace/replace.h"

namespace trident {

Registry<ReplacePair>& ReplacePairRegistry() {
  static auto* registry = new Registry<ReplacePair>("replacement pair (module_replace)");
  return *registry;
}

bool UseBuiltInPair(const std::string& pair, torch::nn::Module& module) {
  auto* replaceable = dynamic_cast<ReplaceableModule*>(&module);
  if (replaceable == nullptr || !replaceable->Offers(pair)) return false;
  replaceable->Use(pair);
  return true;
}

std::string ReplaceReport::Summary() const {
  std::vector<std::string> parts;
  for (size_t i = 0; i < pairs.size(); ++i) parts.push_back(absl::StrCat(pairs[i], " ", hits[i]));
  std::string summary = absl::StrCat("module_replace: ", absl::StrJoin(parts, ", "));
  if (!unsupported.empty()) {
    absl::StrAppend(&summary, " (left out for the compute dtype: ", absl::StrJoin(unsupported, ", "), ")");
  }
  return summary;
}

namespace {

using torch::jit::Value;
using ValueMap = std::unordered_map<std::string, Value*>;

// ---- the built-in pairs' graph patterns ----

Value* Matched(const torch::jit::Match& match, const ValueMap& vmap, const char* name) {
  return match.values_map.at(vmap.at(name));
}

std::optional<double> NumberOf(const Value* v) {
  // NOTE: auto, not std::optional<IValue>: an empty c10::optional would
  // convert to an IValue holding None.
  const auto constant = torch::jit::toIValue(v);
  if (!constant.has_value() || !(constant->isDouble() || constant->isInt())) return std::nullopt;
  return constant->toScalar().toDouble();
}

std::vector<int64_t> SizesOf(const Value* v) {
  auto type = v->type()->cast<c10::TensorType>();
  if (!type) return {};
  auto sizes = type->sizes().concrete_sizes();
  return sizes ? *sizes : std::vector<int64_t>{};
}

bool IsNone(const Value* v) {
  const auto constant = torch::jit::toIValue(v);
  return constant.has_value() && constant->isNone();
}

// Dimension `d` of a `rank`-dimensional tensor counted from the end (-1: the last).
std::optional<int64_t> FromEnd(const Value* d, int64_t rank) {
  std::optional<double> n = NumberOf(d);
  if (!n) return std::nullopt;
  const int64_t i = static_cast<int64_t>(*n);
  return i < 0 ? i : i - rank;
}

// The explicit form of causal attention, as models write it (minGPT, nanoGPT
// without SDPA): softmax(masked_fill(q k^T * scale, mask, -inf)) v, with
// `scale` a product by 1/sqrt(D) or a quotient by sqrt(D).
std::string AttentionPattern(const char* scaling) {
  return absl::StrReplaceAll(R"IR(
graph(%q, %k, %d0, %d1, %scale, %mask, %fill, %dim, %dtype, %v):
  %kt = aten::transpose(%k, %d0, %d1)
  %scores = aten::matmul(%q, %kt)
  %scaled = aten::SCALING(%scores, %scale)
  %masked = aten::masked_fill(%scaled, %mask, %fill)
  %p = aten::softmax(%masked, %dim, %dtype)
  %y = aten::matmul(%p, %v)
  return (%y))IR",
                             {{"SCALING", scaling}});
}

constexpr const char* kAttentionReplacement = R"IR(
graph(%q, %k, %d0, %d1, %scale, %mask, %fill, %dim, %dtype, %v):
  %y = trident::causal_attention(%q, %k, %v)
  return (%y))IR";

// Whether a match is causal self-attention over [B, H, T, D]: the scale is
// D's, the fill -inf, and the mask (a constant once folded) is true exactly
// above the diagonal.
bool IsCausalAttention(const torch::jit::Match& match, const ValueMap& vmap, bool divides) {
  const std::vector<int64_t> q = SizesOf(Matched(match, vmap, "q"));
  if (q.size() != 4 || SizesOf(Matched(match, vmap, "k")) != q || SizesOf(Matched(match, vmap, "v")) != q) {
    return false;
  }
  const int64_t T = q[2], D = q[3];
  const auto d0 = FromEnd(Matched(match, vmap, "d0"), 4), d1 = FromEnd(Matched(match, vmap, "d1"), 4);
  if (!d0 || !d1 || std::min(*d0, *d1) != -2 || std::max(*d0, *d1) != -1) return false;
  const std::optional<double> scale = NumberOf(Matched(match, vmap, "scale"));
  const double expected = divides ? std::sqrt(static_cast<double>(D)) : 1.0 / std::sqrt(static_cast<double>(D));
  if (!scale || std::abs(*scale - expected) > 1e-6 * expected) return false;
  const std::optional<double> fill = NumberOf(Matched(match, vmap, "fill"));
  if (!fill || !(std::isinf(*fill) && *fill < 0)) return false;
  if (FromEnd(Matched(match, vmap, "dim"), 4) != -1 || !IsNone(Matched(match, vmap, "dtype"))) return false;
  const auto mask = torch::jit::toIValue(Matched(match, vmap, "mask"));
  if (!mask.has_value() || !mask->isTensor()) return false;
  const at::Tensor m = mask->toTensor();
  if (m.dim() < 2 || m.size(-1) != T || m.size(-2) != T) return false;
  const at::Tensor flat = m.to(at::kCPU).to(at::kBool).reshape({-1, T, T});
  return at::equal(flat, at::ones({T, T}, at::kBool).triu(1).expand_as(flat));
}

// The match starts from the first output: the norm, then back to the sum.
constexpr const char* kAddLayerNormPattern = R"IR(
graph(%x, %r, %alpha, %shape, %w, %b, %eps, %cudnn):
  %s = aten::add(%x, %r, %alpha)
  %y = aten::layer_norm(%s, %shape, %w, %b, %eps, %cudnn)
  return (%y, %s))IR";

constexpr const char* kAddLayerNormReplacement = R"IR(
graph(%x, %r, %alpha, %shape, %w, %b, %eps, %cudnn):
  %s : Tensor, %y : Tensor = trident::add_layer_norm(%x, %r, %alpha, %shape, %w, %b, %eps)
  return (%y, %s))IR";

// Both summands are tensors of one shape (no broadcasting).
bool IsResidualAdd(const torch::jit::Match& match, const ValueMap& vmap) {
  const std::vector<int64_t> x = SizesOf(Matched(match, vmap, "x"));
  return !x.empty() && SizesOf(Matched(match, vmap, "r")) == x;
}

constexpr const char* kBiasGeluPattern = R"IR(
graph(%x, %w, %b, %approximate):
  %y = aten::linear(%x, %w, %b)
  %z = aten::gelu(%y, %approximate)
  return (%z))IR";

constexpr const char* kBiasGeluReplacement = R"IR(
graph(%x, %w, %b, %approximate):
  %none : NoneType = prim::Constant()
  %y = aten::linear(%x, %w, %none)
  %z = trident::bias_gelu(%y, %b, %approximate)
  return (%z))IR";

bool HasBias(const torch::jit::Match& match, const ValueMap& vmap) {
  const std::vector<int64_t> b = SizesOf(Matched(match, vmap, "b"));
  return b.size() == 1 && !IsNone(Matched(match, vmap, "b"));
}

constexpr const char* kCrossEntropyPattern = R"IR(
graph(%logits, %targets, %weight, %reduction, %ignore_index, %smoothing):
  %loss = aten::cross_entropy_loss(%logits, %targets, %weight, %reduction, %ignore_index, %smoothing)
  return (%loss))IR";

constexpr const char* kCrossEntropyReplacement = R"IR(
graph(%logits, %targets, %weight, %reduction, %ignore_index, %smoothing):
  %loss = trident::cross_entropy(%logits, %targets, %ignore_index)
  return (%loss))IR";

// Class ids against logits [N, C], unweighted, averaged, without smoothing.
bool IsPlainMeanCrossEntropy(const torch::jit::Match& match, const ValueMap& vmap) {
  return SizesOf(Matched(match, vmap, "logits")).size() == 2 && SizesOf(Matched(match, vmap, "targets")).size() == 1 &&
         IsNone(Matched(match, vmap, "weight")) && NumberOf(Matched(match, vmap, "reduction")) == 1.0 &&
         NumberOf(Matched(match, vmap, "smoothing")) == 0.0;
}

const std::set<at::ScalarType> kFloatingTypes = {at::kFloat, at::kBFloat16, at::kHalf};

// A built-in pair: the zoo's modules that offer `name`, and `rewrites` in traced graphs.
ReplacePair BuiltInPair(const std::string& name, std::vector<GraphRewrite> rewrites) {
  return {kFloatingTypes, [name](torch::nn::Module& m) { return UseBuiltInPair(name, m); }, std::move(rewrites)};
}

TRIDENT_REGISTER(
    ReplacePairRegistry, "fused_attention",
    BuiltInPair("fused_attention",
                {{AttentionPattern("mul"), kAttentionReplacement,
                  [](const auto& match, const auto& vmap) { return IsCausalAttention(match, vmap, false); }},
                 {AttentionPattern("div"), kAttentionReplacement,
                  [](const auto& match, const auto& vmap) { return IsCausalAttention(match, vmap, true); }}}));
TRIDENT_REGISTER(ReplacePairRegistry, "fused_layer_norm",
                 BuiltInPair("fused_layer_norm", {{kAddLayerNormPattern, kAddLayerNormReplacement, IsResidualAdd}}));
TRIDENT_REGISTER(ReplacePairRegistry, "fused_bias_gelu",
                 BuiltInPair("fused_bias_gelu", {{kBiasGeluPattern, kBiasGeluReplacement, HasBias}}));
TRIDENT_REGISTER(ReplacePairRegistry, "fused_cross_entropy",
                 BuiltInPair("fused_cross_entropy",
                             {{kCrossEntropyPattern, kCrossEntropyReplacement, IsPlainMeanCrossEntropy}}));

// The registered pairs `names` asks for, each with its index in the report;
// pairs that do not support `dtype` are reported and left out.
absl::StatusOr<std::vector<std::pair<size_t, ReplacePair>>> ResolvePairs(const std::vector<std::string>& names,
                                                                         at::ScalarType dtype, ReplaceReport* report) {
  std::vector<std::pair<size_t, ReplacePair>> pairs;
  for (const std::string& name : names) {
    TRIDENT_ASSIGN_OR_RETURN(ReplacePair pair, ReplacePairRegistry().Find(name));
    if (!pair.supported_dtypes.count(dtype)) {
      report->unsupported.push_back(absl::StrCat(name, " (", c10::toString(dtype), ")"));
      continue;
    }
    report->pairs.push_back(name);
    report->hits.push_back(0);
    pairs.emplace_back(report->pairs.size() - 1, std::move(pair));
  }
  return pairs;
}

// Operator kinds of `ir`'s nodes, with multiplicity.
std::multiset<c10::Symbol> KindsOf(const std::string& ir) {
  auto graph = std::make_shared<torch::jit::Graph>();
  torch::jit::parseIR(ir, graph.get());
  std::multiset<c10::Symbol> kinds;
  for (const torch::jit::Node* node : graph->nodes()) {
    if (node->kind() != c10::prim::Constant) kinds.insert(node->kind());
  }
  return kinds;
}

// One application of `rewrite`: how many matches it replaced, counted by an
// operator its replacement has and its pattern has not.
absl::StatusOr<int> Rewrite(std::shared_ptr<torch::jit::Graph>& graph, const GraphRewrite& rewrite,
                            const std::string& pair) {
  std::optional<c10::Symbol> marker;
  int per_match = 0;
  absl::Status parsed = CatchExceptions(absl::StrCat("module_replace: the graph pattern of '", pair, "'"), [&] {
    const std::multiset<c10::Symbol> pattern = KindsOf(rewrite.pattern), replacement = KindsOf(rewrite.replacement);
    for (c10::Symbol kind : replacement) {
      if (!pattern.count(kind)) {
        marker = kind;
        per_match = static_cast<int>(replacement.count(kind));
        break;
      }
    }
  });
  TRIDENT_RETURN_IF_ERROR(parsed);
  auto count = [&] {
    int n = 0;
    for (const torch::jit::Node* node : graph->nodes()) n += marker && node->kind() == *marker;
    return n;
  };
  const int before = count();
  TRIDENT_RETURN_IF_ERROR(CatchExceptions(absl::StrCat("module_replace: rewriting the graph with '", pair, "'"), [&] {
    torch::jit::SubgraphRewriter rewriter;
    rewriter.RegisterRewritePattern(rewrite.pattern, rewrite.replacement);
    if (rewrite.filter) {
      rewriter.runOnGraph(graph, rewrite.filter);
    } else {
      rewriter.runOnGraph(graph);
    }
    graph->lint();
  }));
  return per_match == 0 ? 0 : (count() - before) / per_match;
}

}  // namespace

absl::StatusOr<ReplaceReport> ReplaceModules(torch::nn::Module& model, const std::vector<std::string>& names,
                                             at::ScalarType compute_dtype) {
  ReplaceReport report;
  TRIDENT_ASSIGN_OR_RETURN(auto pairs, ResolvePairs(names, compute_dtype, &report));
  std::vector<std::shared_ptr<torch::nn::Module>> modules = model.modules(/*include_self=*/true);
  for (const auto& [index, pair] : pairs) {
    if (!pair.replace_module) continue;
    for (const auto& module : modules) report.hits[index] += pair.replace_module(*module);
  }
  return report;
}

absl::StatusOr<ReplacedGraph> ReplaceInGraph(const ModelGraph& model, const std::vector<std::string>& names,
                                             at::ScalarType compute_dtype) {
  ReplacedGraph result;
  TRIDENT_ASSIGN_OR_RETURN(auto pairs, ResolvePairs(names, compute_dtype, &result.report));
  std::shared_ptr<torch::jit::Graph> graph = model.jit_graph()->copy();
  const size_t first_parameter = graph->inputs().size() - model.parameters().size();
  TRIDENT_RETURN_IF_ERROR(CatchExceptions("module_replace: preparing the traced graph", [&] {
    ModelGraph::CanonicalizeLinearProducts(*graph, first_parameter);
    torch::jit::ConstantPropagation(graph);  // masks computed from constants become one
    torch::jit::ConstantPooling(graph);      // constants first, so a replacement may go anywhere
  }));
  for (const auto& [index, pair] : pairs) {
    for (const GraphRewrite& rewrite : pair.graph_rewrites) {
      TRIDENT_ASSIGN_OR_RETURN(int hits, Rewrite(graph, rewrite, result.report.pairs[index]));
      result.report.hits[index] += hits;
    }
  }
  std::vector<at::Tensor> tensors = model.parameters();
  for (size_t i = 0; i < tensors.size(); ++i) result.parameters.emplace_back(model.parameter_names()[i], tensors[i]);
  result.forward = ModelGraph::GraphForward(graph, std::move(tensors));
  return result;
}

}  // namespace trident
