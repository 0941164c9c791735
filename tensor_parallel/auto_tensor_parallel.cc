// The automatic tensor-parallel pass: sharding propagation over a traced
// graph, the choice of column and row products, and the rewrite.
#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/passes/dead_code_elimination.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "graph/model_graph.h"
#include "tensor_parallel/tensor_parallel.h"

namespace trident {
namespace {

using torch::jit::Graph;
using torch::jit::Node;
using torch::jit::Value;

std::string KindOf(const Node* node) { return node->kind().toQualString(); }

std::vector<int64_t> ShapeOf(const Value* value) {
  auto type = value->type()->cast<c10::TensorType>();
  if (!type) return {};
  auto sizes = type->sizes().concrete_sizes();
  return sizes ? *sizes : std::vector<int64_t>{};
}

int64_t RankOf(const Value* value) { return static_cast<int64_t>(ShapeOf(value).size()); }

int64_t Normalized(int64_t dim, int64_t rank) { return dim < 0 ? dim + rank : dim; }

std::optional<int64_t> IntOf(const Value* value) {
  auto constant = torch::jit::toIValue(value);
  if (constant && constant->isInt()) return constant->toInt();
  return std::nullopt;
}

std::optional<std::vector<int64_t>> IntsOf(const Value* value) {
  auto constant = torch::jit::toIValue(value);
  if (constant && constant->isIntList()) return constant->toIntVector();
  if (value->node()->kind() != c10::prim::ListConstruct) return std::nullopt;
  std::vector<int64_t> ints;
  for (const Value* element : value->node()->inputs()) {
    std::optional<int64_t> i = IntOf(element);
    if (!i) return std::nullopt;
    ints.push_back(*i);
  }
  return ints;
}

bool IsNone(const Value* value) { return value->type()->kind() == c10::TypeKind::NoneType; }

// Operators whose output is split where their split inputs are (after
// broadcasting), as long as every replicated tensor input broadcasts along
// the split dimension (size 1 there, or no such dimension).
const std::set<std::string>& ElementWise() {
  static const auto* kinds = new std::set<std::string>{
      "aten::add", "aten::add_", "aten::sub", "aten::rsub", "aten::mul", "aten::mul_", "aten::div",
      "aten::div_", "aten::masked_fill", "aten::masked_fill_", "aten::where", "aten::maximum",
      "aten::minimum", "aten::pow", "aten::neg", "aten::exp", "aten::log", "aten::sqrt", "aten::rsqrt",
      "aten::abs", "aten::sigmoid", "aten::tanh", "aten::relu", "aten::gelu", "aten::silu",
      "aten::softplus", "aten::erf", "aten::sin", "aten::cos", "aten::contiguous", "aten::clone",
      "aten::dropout", "aten::feature_dropout", "aten::to", "aten::type_as", "aten::detach",
      "aten::eq", "aten::ne", "aten::gt", "aten::lt", "aten::ge", "aten::le", "aten::square",
      "aten::reciprocal", "aten::sign", "aten::clamp"};
  return *kinds;
}

// How a value is laid out over the group: replicated (no entry), or split
// along `dim` into tp equal parts of each of `blocks` equal pieces.
struct Split {
  int64_t dim = 0;
  int64_t blocks = 1;
  std::set<Node*> origins;  // the column products the split comes from
  // Sequence parallelism: activations between the split products, split
  // along the sequence (no origins: nothing can be kept whole for them).
  bool sequence = false;
};

// A replicated operand narrowed to this rank's sequence shard where it meets
// sequence-split activations (a position embedding added to the tokens').
struct OperandNarrowing {
  Node* node;
  size_t input;
  int64_t dim;
};

// The rewrite of one integer (or integer list) argument that holds a size the
// split divides.
struct ArgumentRewrite {
  Node* node;
  size_t input;
  c10::IValue value;
};

class Planner {
 public:
  Planner(std::shared_ptr<Graph> graph, std::vector<std::string> parameter_names, const TensorParallelism& tp,
          const AutoTensorParallelOptions& options)
      : graph_(std::move(graph)),
        names_(std::move(parameter_names)),
        tp_(tp.size),
        sequence_(tp.sequence_parallel),
        vocabulary_(tp.parallel_vocab),
        options_(options) {
    const size_t first_parameter = graph_->inputs().size() - names_.size();
    for (size_t i = 0; i < names_.size(); ++i) parameter_index_[graph_->inputs()[first_parameter + i]] = i;
    int64_t position = 0;
    for (Node* node : graph_->nodes()) {
      if (node->kind() != c10::prim::Constant && node->kind() != c10::prim::ListConstruct) {
        position_[node] = position++;
      }
    }
  }

  // Propagates splits until no split reaches an operator the pass cannot
  // split: the column products whose splits would are kept whole.
  absl::Status Plan() {
    for (;;) {
      splits_.clear();
      columns_.clear();
      rows_.clear();
      narrowings_.clear();
      sequence_inputs_.clear();
      replicated_sequence_inputs_.clear();
      embeddings_.clear();
      sequence_embeddings_.clear();
      cross_entropies_.clear();
      sequence_cross_entropies_.clear();
      rewrites_.clear();
      work_.clear();
      conflict_ = nullptr;
      for (Node* node : graph_->nodes()) {
        TRIDENT_ASSIGN_OR_RETURN(bool handled, Propagate(node));
        if (!handled) {
          conflict_ = node;
          break;
        }
        RecordWork(node);
      }
      if (conflict_ == nullptr) {
        for (const Value* output : graph_->outputs()) {
          if (splits_.count(output)) {
            conflict_ = graph_->return_node();
            break;
          }
        }
      }
      if (conflict_ == nullptr) {
        if (KeepUnprofitableRegionsWhole()) continue;
        return CheckPinnedRows();
      }
      const std::string where = conflict_ == graph_->return_node()
                                    ? "the model's outputs"
                                    : absl::StrCat(KindOf(conflict_), " (node ", position_[conflict_], ")");
      bool kept_whole = false;
      for (const Value* input : conflict_->inputs()) {
        auto it = splits_.find(input);
        if (it == splits_.end()) continue;
        for (Node* origin : it->second.origins) {
          if (Pinned(origin) == Pin::kColumn) {
            return absl::InvalidArgumentError(absl::StrCat(
                "automatic tensor parallelism: the layer lists pin ", Describe(origin),
                " column-parallel, but its split output would reach ", where,
                ", which the pass cannot split; pin the product that should end the split region "
                "row-parallel, or unpin this one"));
          }
          kept_whole = true;
          whole_[origin] = absl::StrCat("its split output would reach ", where, ", which the pass cannot split");
        }
      }
      if (!kept_whole) {
        return absl::InvalidArgumentError(absl::StrCat(
            "sequence parallelism: ", where, " cannot run on sequence shards of its input; turn "
            "sequence_parallel off for this model"));
      }
    }
  }

  // Rewrites the graph for tensor-parallel rank `rank` (group `group`) and
  // returns the parameters' layouts.
  std::vector<ParameterLayout> Apply(int64_t rank, const std::string& group, AutoTensorParallelPlan& plan) {
    for (const ArgumentRewrite& r : rewrites_) {
      torch::jit::WithInsertPoint here(r.node);
      r.node->replaceInput(r.input, graph_->insertConstant(r.value));
    }
    const c10::Symbol copy = c10::Symbol::fromQualString("trident::copy_to_tp_region");
    const c10::Symbol reduce = c10::Symbol::fromQualString("trident::reduce_from_tp_region");
    const c10::Symbol gather_sequence = c10::Symbol::fromQualString("trident::gather_from_sequence_region");
    const torch::jit::NamedValue group_name{c10::IValue(group)};
    const c10::Symbol reduce_scatter = c10::Symbol::fromQualString("trident::reduce_scatter_to_sequence_region");
    // Sums `value` (shaped as the traced `shaped`) over the group:
    // all-reduced, or with sequence parallelism reduce-scattered into
    // sequence shards.
    auto summed = [&](Value* value, const Value* shaped, const Node* after, const std::string& what) {
      Value* result;
      if (sequence_) {
        result = graph_->insert(reduce_scatter, {value, group_name, RankOf(shaped) - 2});
        plan.collectives.push_back(absl::StrCat("reduce_scatter_to_sequence_region after node ", position_[after], " (",
                                                what, "reduce-scatters ", Describe(shaped), ")"));
      } else {
        result = graph_->insert(reduce, {value, group_name});
        plan.collectives.push_back(absl::StrCat("reduce_from_tp_region after node ", position_[after], " (", what,
                                                "all-reduces ", Describe(shaped), ")"));
      }
      plan.bytes_per_micro_batch += AllReduceBytes(shaped);
      return result;
    };
    // One copy per input of column products (its backward sums their input
    // gradients once), before the first of them.
    std::map<Value*, std::vector<Node*>> by_input;
    std::vector<Value*> inputs_in_order;
    for (Node* node : graph_->nodes()) {
      if (!columns_.count(node)) continue;
      if (by_input[node->input(0)].empty()) inputs_in_order.push_back(node->input(0));
      by_input[node->input(0)].push_back(node);
    }
    for (Value* input : inputs_in_order) {
      Node* first = by_input[input].front();
      torch::jit::WithInsertPoint here(first);
      auto sequence = sequence_inputs_.find(input);
      Value* copied;
      if (sequence != sequence_inputs_.end()) {
        Value* shard = input;
        if (replicated_sequence_inputs_.count(input)) {
          const int64_t length = ShapeOf(input)[sequence->second] / tp_;
          shard = graph_->insert(c10::aten::narrow, {input, sequence->second, rank * length, length});
        }
        copied = graph_->insert(gather_sequence, {shard, group_name, sequence->second});
        plan.collectives.push_back(absl::StrCat("gather_from_sequence_region before node ", position_[first],
                                                " (all-gathers ", Describe(input), "; its backward reduce-scatters)"));
      } else {
        copied = graph_->insert(copy, {input, group_name});
        plan.collectives.push_back(absl::StrCat("copy_to_tp_region before node ", position_[first],
                                                " (its backward all-reduces ", Describe(input), ")"));
      }
      for (Node* node : by_input[input]) node->replaceInput(0, copied);
      plan.bytes_per_micro_batch += AllReduceBytes(input);  // all-gather + reduce-scatter move as much
    }
    for (const OperandNarrowing& n : narrowings_) {
      torch::jit::WithInsertPoint here(n.node);
      Value* operand = n.node->input(n.input);
      const int64_t length = ShapeOf(operand)[n.dim] / tp_;
      n.node->replaceInput(n.input, graph_->insert(c10::aten::narrow, {operand, n.dim, rank * length, length}));
    }
    for (Node* node : rows_) {
      Value* product = node->output();
      const std::vector<torch::jit::Use> uses = product->uses();
      Value* bias = node->input(2);
      {
        torch::jit::WithInsertPoint here(node);
        node->replaceInput(2, graph_->insertConstant(c10::IValue()));
      }
      torch::jit::WithInsertPoint after(node->next());
      Value* result = summed(product, product, node, "");
      if (!IsNone(bias)) result = graph_->insert(c10::aten::add, {result, bias});
      for (const torch::jit::Use& use : uses) use.user->replaceInput(use.offset, result);
    }
    for (Node* node : embeddings_) {
      const int64_t vocabulary = ShapeOf(node->input(0))[0] / tp_, start = rank * vocabulary;
      Value* ids = node->input(1);
      Value* rows = node->output();
      const std::vector<torch::jit::Use> uses = rows->uses();
      Value* outside;
      {
        torch::jit::WithInsertPoint here(node);
        outside = graph_->insert(c10::aten::logical_or, {graph_->insert(c10::aten::lt, {ids, start}),
                                                         graph_->insert(c10::aten::ge, {ids, start + vocabulary})});
        node->replaceInput(1, graph_->insert(c10::aten::masked_fill,
                                             {graph_->insert(c10::aten::sub, {ids, start}), outside, 0}));
      }
      torch::jit::WithInsertPoint after(node->next());
      Value* mine = graph_->insert(c10::aten::masked_fill,
                                   {rows, graph_->insert(c10::aten::unsqueeze, {outside, -1}), 0.0});
      Value* result = summed(mine, rows, node, "vocabulary-parallel embedding; ");
      for (const torch::jit::Use& use : uses) use.user->replaceInput(use.offset, result);
    }
    for (Node* node : sequence_embeddings_) {
      torch::jit::WithInsertPoint here(node);
      Value* ids = node->input(1);
      const int64_t length = ShapeOf(ids)[1] / tp_;
      node->replaceInput(1, graph_->insert(c10::aten::narrow, {ids, 1, rank * length, length}));
    }
    // 1 where cross_entropy_loss `node`'s whole targets are not its
    // ignore_index (ignored targets count for nothing), in `like`'s dtype.
    auto counted_targets = [&](Node* node, Value* targets, Value* like) {
      Value* kept = graph_->insert(c10::aten::ne, {targets, *IntOf(node->input(4))});
      return graph_->insert(c10::aten::type_as, {kept, like});
    };
    for (const auto& [node, blocks] : sequence_cross_entropies_) {
      // This rank's rows: the targets' sequence shard in each of `blocks`
      // pieces; their summed loss over every rank's count, summed over the group.
      Value* targets = node->input(1);
      const int64_t count = ShapeOf(targets)[0], length = count / blocks / tp_;
      const std::vector<torch::jit::Use> uses = node->output()->uses();
      const bool mean = *IntOf(node->input(3)) == 1;
      {
        torch::jit::WithInsertPoint here(node);
        Value* pieces = graph_->insert(c10::aten::reshape, {targets, std::vector<int64_t>{blocks, count / blocks}});
        Value* mine = graph_->insert(c10::aten::narrow, {pieces, 1, rank * length, length});
        node->replaceInput(1, graph_->insert(c10::aten::reshape, {mine, std::vector<int64_t>{-1}}));
        node->replaceInput(3, graph_->insertConstant(int64_t{2}));  // sum
      }
      torch::jit::WithInsertPoint after(node->next());
      Value* loss = node->output();
      if (mean) {
        Value* counted = counted_targets(node, targets, loss);
        loss = graph_->insert(c10::aten::div, {loss, graph_->insert(c10::aten::sum, {counted})});
      }
      loss = graph_->insert(reduce, {loss, group_name});
      for (const torch::jit::Use& use : uses) use.user->replaceInput(use.offset, loss);
      plan.collectives.push_back(absl::StrCat("reduce_from_tp_region after node ", position_[node],
                                              " (sums the sequence shards' cross-entropy)"));
      plan.bytes_per_micro_batch += AllReduceBytes(node->output());
    }
    for (Node* node : cross_entropies_) {
      torch::jit::WithInsertPoint here(node);
      Value* logits = node->input(0);
      Value* targets = node->input(1);
      Value* per_token = graph_->insert(c10::Symbol::fromQualString("trident::vocab_parallel_cross_entropy"),
                                        {logits, targets, group_name});
      Value* counted = counted_targets(node, targets, per_token);
      Value* losses = graph_->insert(c10::aten::mul, {per_token, counted});
      const int64_t reduction = *IntOf(node->input(3));  // 0 none, 1 mean, 2 sum
      Value* loss = losses;
      if (reduction != 0) loss = graph_->insert(c10::aten::sum, {losses});
      if (reduction == 1) loss = graph_->insert(c10::aten::div, {loss, graph_->insert(c10::aten::sum, {counted})});
      node->output()->replaceAllUsesWith(loss);
      plan.collectives.push_back(absl::StrCat("vocab_parallel_cross_entropy at node ", position_[node],
                                              " (all-reduces two values per token)"));
      plan.bytes_per_micro_batch += 3 * AllReduceBytes(targets) / 2;  // max, then the two sums, in fp32
    }
    torch::jit::EliminateDeadCode(graph_);

    std::vector<ParameterLayout> layouts(names_.size());
    for (size_t i = 0; i < names_.size(); ++i) layouts[i].name = names_[i];
    auto parameter = [&](const Value* value) -> ParameterLayout* {
      auto it = parameter_index_.find(value);
      return it == parameter_index_.end() ? nullptr : &layouts[it->second];
    };
    for (const auto& [node, blocks] : columns_) {
      for (size_t input : {size_t{1}, size_t{2}}) {
        if (ParameterLayout* p = parameter(node->input(input))) {
          p->role = ParameterLayout::Role::kColumn;
          p->shard = ShardSpec{0, tp_, rank, blocks};
        }
      }
    }
    for (Node* node : rows_) {
      if (ParameterLayout* p = parameter(node->input(1))) {
        p->role = ParameterLayout::Role::kRow;
        p->shard = ShardSpec{1, tp_, rank, 1};
      }
    }
    for (Node* node : embeddings_) {
      if (ParameterLayout* p = parameter(node->input(0))) {
        p->role = ParameterLayout::Role::kVocabulary;
        p->shard = ShardSpec{0, tp_, rank, 1};
      }
    }
    for (const auto& [node, why] : whole_) {
      if (ParameterLayout* p = parameter(node->input(1))) p->why = why;
    }
    return layouts;
  }

 private:
  // Whether `node` splits as the pass knows (recording its outputs' splits),
  // false where a split input reaches it and it cannot; errors where a split
  // dimension does not divide.
  absl::StatusOr<bool> Propagate(Node* node) {
    const std::string kind = KindOf(node);
    if (kind == "aten::linear") return Linear(node);
    if (kind == "aten::embedding") return Embedding(node);
    if (kind == "aten::cross_entropy_loss" && splits_.count(node->input(0))) return CrossEntropy(node);
    const Split* split = nullptr;
    std::set<Node*> origins;
    for (const Value* input : node->inputs()) {
      auto it = splits_.find(input);
      if (it == splits_.end()) continue;
      if (split == nullptr) split = &it->second;
      origins.insert(it->second.origins.begin(), it->second.origins.end());
    }
    if (split == nullptr) return true;  // all inputs replicated: so are the outputs
    const Split first = *split;
    auto set = [&](Value* value, int64_t dim, int64_t blocks) {
      splits_[value] = Split{dim, blocks, origins, first.sequence};
      return true;
    };
    if (kind == "prim::ListUnpack") {
      for (Value* output : node->outputs()) set(output, first.dim, first.blocks);
      return true;
    }
    if (kind == "prim::ListConstruct") {  // tensors for cat or stack: split alike
      for (const Value* input : node->inputs()) {
        auto it = splits_.find(input);
        if (it == splits_.end() || it->second.dim != first.dim || it->second.blocks != first.blocks) return false;
      }
      return set(node->output(), first.dim, first.blocks);
    }
    if (ElementWise().count(kind)) return Broadcast(node, origins);
    if (kind == "aten::matmul" || kind == "aten::bmm" || kind == "aten::baddbmm") return MatrixProduct(node, origins);
    Value* x = node->input(0);
    if (!splits_.count(x)) return false;  // below, the split input is the first
    const int64_t rank = RankOf(x);
    const int64_t d = first.dim, blocks = first.blocks;
    auto dim_argument = [&](size_t input, int64_t of_rank) { return Normalized(*IntOf(node->input(input)), of_rank); };
    if (kind == "aten::transpose") {
      const int64_t a = dim_argument(1, rank), b = dim_argument(2, rank);
      return set(node->output(), d == a ? b : d == b ? a : d, blocks);
    }
    if (kind == "aten::t") return set(node->output(), rank == 2 ? 1 - d : d, blocks);
    if (kind == "aten::permute") {
      const std::vector<int64_t> dims = *IntsOf(node->input(1));
      for (size_t i = 0; i < dims.size(); ++i) {
        if (Normalized(dims[i], rank) == d) return set(node->output(), static_cast<int64_t>(i), blocks);
      }
      return false;
    }
    if (kind == "aten::view" || kind == "aten::reshape" || kind == "aten::_unsafe_view") return View(node, first);
    if (kind == "aten::expand") {
      if (blocks != 1) return false;
      const int64_t out_dim = d + RankOf(node->output()) - rank;
      std::vector<int64_t> sizes = *IntsOf(node->input(1));
      if (sizes[out_dim] != -1) {
        sizes[out_dim] /= tp_;
        rewrites_.push_back({node, 1, c10::IValue(sizes)});
      }
      return set(node->output(), out_dim, 1);
    }
    if (kind == "aten::unsqueeze") {
      const int64_t at = dim_argument(1, rank + 1);
      return set(node->output(), d >= at ? d + 1 : d, blocks);
    }
    if (kind == "aten::squeeze" && node->inputs().size() == 2 && IntOf(node->input(1))) {
      const int64_t at = dim_argument(1, rank);
      return at != d && set(node->output(), d > at ? d - 1 : d, blocks);
    }
    if (kind == "aten::slice" || kind == "aten::narrow") {  // along another dimension, or all of the split one
      if (dim_argument(1, rank) != d) return set(node->output(), d, blocks);
      if (kind == "aten::narrow") return false;
      const std::optional<int64_t> start = IntOf(node->input(2)), end = IntOf(node->input(3)), step = IntOf(node->input(4));
      const bool all = (IsNone(node->input(2)) || start == 0) &&
                       (IsNone(node->input(3)) || (end && *end >= ShapeOf(x)[d])) && step == 1;
      return all && set(node->output(), d, blocks);
    }
    if (kind == "aten::select" || kind == "aten::unbind") {  // unbind: a list of all the selects
      const int64_t at = dim_argument(1, rank);
      return at != d && set(node->output(), d > at ? d - 1 : d, blocks);
    }
    if (kind == "aten::split" || kind == "aten::unsafe_split" || kind == "aten::chunk" ||
        kind == "aten::unsafe_chunk") {
      if (dim_argument(2, rank) != d) return set(node->output(), d, blocks);
      // Taking a fused product apart into its pieces.
      const bool by_size = kind == "aten::split" || kind == "aten::unsafe_split";
      const std::optional<int64_t> argument = IntOf(node->input(1));
      if (!argument) return false;
      const int64_t pieces = by_size ? ShapeOf(x)[d] / *argument : *argument;
      if (pieces != blocks || pieces == 1) return false;
      if (by_size) rewrites_.push_back({node, 1, c10::IValue(*argument / tp_)});
      return set(node->output(), d, 1);
    }
    if (kind == "aten::cat" || kind == "aten::stack") {
      const int64_t at = dim_argument(1, RankOf(node->output()));
      if (kind == "aten::cat") return at != d && set(node->output(), d, blocks);
      return set(node->output(), d >= at ? d + 1 : d, blocks);
    }
    if (kind == "aten::softmax" || kind == "aten::log_softmax" || kind == "aten::_softmax") {
      return dim_argument(1, rank) != d && set(node->output(), d, blocks);
    }
    if (kind == "aten::layer_norm") {
      const int64_t normalized = static_cast<int64_t>(IntsOf(node->input(1))->size());
      for (size_t i = 1; i < node->inputs().size(); ++i) {
        if (splits_.count(node->input(i))) return false;
      }
      return d < rank - normalized && set(node->output(), d, blocks);
    }
    if (kind == "aten::scaled_dot_product_attention") {
      for (size_t i = 0; i < 3; ++i) {
        auto it = splits_.find(node->input(i));
        if (it == splits_.end() || it->second.dim != d || it->second.blocks != blocks) return false;
      }
      if (d >= rank - 2) return false;
      const Value* mask = node->input(3);
      if (!IsNone(mask) && !Broadcasts(mask, d, rank)) return false;
      return set(node->output(), d, blocks);
    }
    if (kind == "aten::repeat_interleave" && node->inputs().size() >= 3 && IntOf(node->input(1))) {
      // Grouped-query attention: each rank's key/value heads serve its query heads.
      if (blocks != 1) return false;
      if (node->inputs().size() >= 4 && !IsNone(node->input(3))) {
        const std::optional<int64_t> size = IntOf(node->input(3));
        if (!size) return false;
        rewrites_.push_back({node, 3, c10::IValue(*size / tp_)});
      }
      return set(node->output(), d, 1);
    }
    if (kind == "aten::mean" || kind == "aten::sum") {
      if (node->inputs().size() < 3) return false;  // a full reduction
      const std::optional<std::vector<int64_t>> dims = IntsOf(node->input(1));
      const std::optional<int64_t> keep = IntOf(node->input(2));
      if (!dims) return false;
      int64_t out = d;
      for (int64_t reduced : *dims) {
        reduced = Normalized(reduced, rank);
        if (reduced == d) return false;
        if (reduced < d && !(keep && *keep)) --out;
      }
      return set(node->output(), out, blocks);
    }
    return false;
  }
  // What the layer lists (Merak's set_tp_layer_lists) pin linear `node` to:
  // a name in col_para_list / row_para_list (part of its weight's name), or
  // an input:output feature ratio in input_output_mapping.
  enum class Pin { kNone, kColumn, kRow };
  Pin Pinned(const Node* node) const {
    if (KindOf(node) != "aten::linear") return Pin::kNone;
    const std::string name = ParameterName(node->input(1));
    auto listed = [&](const std::vector<std::string>& patterns) {
      return !name.empty() && std::any_of(patterns.begin(), patterns.end(), [&](const std::string& pattern) {
               return name.find(pattern) != std::string::npos;
             });
    };
    if (listed(options_.layers.column)) return Pin::kColumn;
    if (listed(options_.layers.row)) return Pin::kRow;
    const std::vector<int64_t> weight = ShapeOf(node->input(1));
    if (weight.size() != 2) return Pin::kNone;
    for (const TensorParallelLayerLists::Mapping& m : options_.layers.input_output_mapping) {
      if (weight[1] * m.output == weight[0] * m.input) return m.column ? Pin::kColumn : Pin::kRow;
    }
    return Pin::kNone;
  }

  absl::Status CheckPinnedRows() {
    for (Node* node : graph_->nodes()) {
      if (Pinned(node) != Pin::kRow || std::find(rows_.begin(), rows_.end(), node) != rows_.end()) continue;
      return absl::InvalidArgumentError(absl::StrCat(
          "automatic tensor parallelism: the layer lists pin ", Describe(node),
          " row-parallel, but its input is not split along its features (no column-parallel product "
          "feeds it through operators the pass can split); pin its partner column-parallel, or unpin it"));
    }
    return absl::OkStatus();
  }

  // Records the split work of `node` after Propagate: the region (column
  // products) it belongs to, the compute a split saves and the collectives
  // it costs.
  void RecordWork(Node* node) {
    Work work;
    for (const Value* input : node->inputs()) {
      auto it = splits_.find(input);
      if (it != splits_.end()) work.origins.insert(it->second.origins.begin(), it->second.origins.end());
    }
    if (columns_.count(node)) {
      work.origins.insert(node);
      work.bytes += AllReduceBytes(node->input(0));  // the copy's backward (shared inputs counted per product)
      ++work.collectives;
    }
    if (std::find(rows_.begin(), rows_.end(), node) != rows_.end()) {
      work.bytes += AllReduceBytes(node->output());
      ++work.collectives;
    }
    if (work.origins.empty()) return;
    int64_t elements = 0;
    for (const Value* output : node->outputs()) {
      int64_t count = 1;
      for (int64_t size : ShapeOf(output)) count *= size;
      elements += count;
    }
    const std::string kind = KindOf(node);
    const bool product = kind == "aten::linear" || kind == "aten::matmul" || kind == "aten::bmm" ||
                         kind == "aten::baddbmm" || kind == "aten::addmm";
    const std::vector<int64_t> operand = ShapeOf(node->input(kind == "aten::baddbmm" || kind == "aten::addmm" ? 1 : 0));
    work.flops = product && !operand.empty() ? 2.0 * elements * operand.back() : static_cast<double>(elements);
    work_.push_back(std::move(work));
  }

  // With a cost model (options_.flops_per_second > 0): groups the split work
  // into regions (column products whose splits meet), and keeps whole every
  // region whose communication takes longer than the compute its split saves
  // (forward and backward, 3x the forward FLOPs). Whether any was.
  bool KeepUnprofitableRegionsWhole() {
    if (options_.flops_per_second <= 0) return false;
    std::map<Node*, Node*> parent;
    std::function<Node*(Node*)> root = [&](Node* n) {
      if (!parent.count(n)) parent[n] = n;
      return parent[n] == n ? n : parent[n] = root(parent[n]);
    };
    for (const Work& w : work_) {
      for (Node* origin : w.origins) parent[root(origin)] = root(*w.origins.begin());
    }
    struct Region {
      double flops = 0;
      int64_t bytes = 0;
      int collectives = 0;
    };
    std::map<Node*, Region> regions;
    for (const Work& w : work_) {
      Region& r = regions[root(*w.origins.begin())];
      r.flops += w.flops;
      r.bytes += w.bytes;
      r.collectives += w.collectives;
    }
    std::set<Node*> pinned_regions;
    for (const auto& [node, blocks] : columns_) {
      if (Pinned(node) == Pin::kColumn) pinned_regions.insert(root(node));
    }
    for (Node* node : rows_) {
      auto it = splits_.find(node->input(0));
      if (Pinned(node) == Pin::kRow && it != splits_.end() && !it->second.origins.empty()) {
        pinned_regions.insert(root(*it->second.origins.begin()));
      }
    }
    bool changed = false;
    for (const auto& [representative, r] : regions) {
      if (pinned_regions.count(representative)) continue;
      const double saved = 3 * r.flops * (1.0 - 1.0 / tp_) / options_.flops_per_second;
      const double cost = r.collectives * options_.collective_latency_s + r.bytes / options_.bytes_per_second;
      if (cost <= saved) continue;
      for (const auto& [node, blocks] : columns_) {
        if (root(node) != representative) continue;
        whole_[node] = absl::StrFormat(
            "splitting its region would save %.3f ms of compute per micro-batch and cost %.3f ms of "
            "communication",
            1e3 * saved, 1e3 * cost);
        changed = true;
      }
    }
    return changed;
  }

  // aten::linear(x, weight, bias): a column product where x is replicated,
  // a row product where x is split along its features.
  absl::StatusOr<bool> Linear(Node* node) {
    auto x = splits_.find(node->input(0));
    const bool own_bias = IsNone(node->input(2)) || IsOwnParameter(node->input(2));
    const bool shardable = IsOwnParameter(node->input(1)) && own_bias;
    const bool tied = !shardable && own_bias && TiedToEmbeddings(node);  // a head tied to the embedding
    const std::vector<int64_t> weight = ShapeOf(node->input(1));
    const bool on_sequence_shards = x != splits_.end() && x->second.sequence;
    if (x == splits_.end() || on_sequence_shards) {  // replicated input, or gathered from sequence shards
      auto whole = [&] {
        if (on_sequence_shards) splits_[node->output()] = x->second;  // a whole product on sequence shards
        return true;
      };
      if (!shardable && !tied && weight.size() == 2) whole_[node] = "its weight is read by other operators too";
      if ((!shardable && !tied) || whole_.count(node) || weight.size() != 2 || Pinned(node) == Pin::kRow) {
        return whole();
      }
      const int64_t blocks = PiecesTakenApart(node);
      if (weight[0] % (blocks * tp_) != 0) {
        whole_[node] = absl::StrCat(weight[0], " output features", blocks > 1 ? absl::StrCat(" in ", blocks, " pieces") : "",
                                    " do not split ", tp_, " ways");
        return whole();
      }
      columns_[node] = blocks;
      splits_[node->output()] = Split{RankOf(node->output()) - 1, blocks, {node}};
      if (on_sequence_shards) {
        sequence_inputs_[node->input(0)] = x->second.dim;
      } else if (sequence_) {
        // A replicated input enters the sequence-parallel region here: this
        // rank's sequence shard of it, gathered, so that its gradient is this
        // shard's too, as every replicated parameter's must be.
        const std::vector<int64_t> shape = ShapeOf(node->input(0));
        if (shape.size() < 2 || shape[shape.size() - 2] % tp_ != 0) {
          return absl::InvalidArgumentError(absl::StrCat(
              "sequence parallelism: ", Describe(node), " reads [", absl::StrJoin(shape, ", "),
              "], whose sequence (the dimension before the features) tp=", tp_, " does not divide"));
        }
        sequence_inputs_[node->input(0)] = static_cast<int64_t>(shape.size()) - 2;
        replicated_sequence_inputs_.insert(node->input(0));
      }
      return true;
    }
    if (!shardable || x->second.blocks != 1 || x->second.dim != RankOf(node->input(0)) - 1) return false;
    if (weight[1] % tp_ != 0) {
      return absl::InvalidArgumentError(absl::StrCat("automatic tensor parallelism: ", Describe(node), " has ",
                                                     weight[1], " input features, which tp=", tp_,
                                                     " does not divide"));
    }
    rows_.push_back(node);
    return SequenceShards(node, node->output());
  }

  // With sequence parallelism, `value` (the output of a row product or a
  // vocabulary-parallel embedding, [B, T, C]) is reduce-scattered into
  // sequence shards; errors where tp does not divide the sequence.
  absl::StatusOr<bool> SequenceShards(const Node* node, Value* value) {
    if (!sequence_) return true;
    const std::vector<int64_t> shape = ShapeOf(value);
    if (shape.size() < 2 || shape[shape.size() - 2] % tp_ != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sequence parallelism: ", Describe(node), " makes [", absl::StrJoin(shape, ", "),
          "], whose sequence (the dimension before the features) tp=", tp_, " does not divide"));
    }
    splits_[value] = Split{static_cast<int64_t>(shape.size()) - 2, 1, {}, /*sequence=*/true};
    return true;
  }

  // Whether the weight of linear `node` is otherwise read only by embeddings
  // that can split their vocabulary (a head tied to the token embedding).
  bool TiedToEmbeddings(const Node* node) const {
    const Value* weight = node->input(1);
    if (!parameter_index_.count(weight)) return false;
    int linears = 0;
    for (const torch::jit::Use& use : weight->uses()) {
      const std::string kind = KindOf(use.user);
      if (kind == "aten::linear" && use.offset == 1) {
        ++linears;
      } else if (kind != "aten::embedding" || use.offset != 0 || !VocabularySplits(use.user)) {
        return false;
      }
    }
    return linears == 1;
  }

  // An embedding of the model's input ids (token embeddings, not position
  // tables indexed by computed positions) whose vocabulary tp divides and
  // that has no padding row.
  bool VocabularySplits(const Node* embedding) const {
    const std::vector<int64_t> weight = ShapeOf(embedding->input(0));
    return vocabulary_ && weight.size() == 2 && weight[0] % tp_ == 0 && IntOf(embedding->input(2)).value_or(0) == -1 &&
           parameter_index_.count(embedding->input(0)) &&
           embedding->input(1)->node()->kind() == c10::prim::Param;
  }

  // aten::embedding(weight, ids, ...): vocabulary-parallel (each rank looks
  // up the ids in its rows, the rows summed over the group), unless its
  // weight is tied to a head kept whole, or read otherwise.
  absl::StatusOr<bool> Embedding(Node* node) {
    if (splits_.count(node->input(1))) return false;
    const Value* weight = node->input(0);
    if (!VocabularySplits(node)) return WholeOnSequenceShards(node);
    for (const torch::jit::Use& use : weight->uses()) {
      const std::string kind = KindOf(use.user);
      if (kind == "aten::embedding") continue;
      if (kind != "aten::linear" || whole_.count(use.user) || !TiedToEmbeddings(use.user)) {
        return WholeOnSequenceShards(node);
      }
    }
    embeddings_.push_back(node);
    return SequenceShards(node, node->output());
  }

  // With sequence parallelism, an embedding kept whole looks up this rank's
  // sequence shard of the model's ids ([B, T]) only: what follows runs on
  // sequence shards from the start, and the embedding's gradient is this
  // shard's, as every replicated parameter's is.
  absl::StatusOr<bool> WholeOnSequenceShards(Node* node) {
    const Value* ids = node->input(1);
    if (!sequence_ || ids->node()->kind() != c10::prim::Param || RankOf(ids) != 2) return true;
    sequence_embeddings_.push_back(node);
    return SequenceShards(node, node->output());
  }

  // cross_entropy_loss of logits split along the vocabulary: the
  // vocabulary-parallel cross-entropy, which never gathers the logits.
  // Without parallel_vocab split logits are a conflict: the head stays whole.
  bool CrossEntropy(Node* node) {
    const Split& logits = splits_.at(node->input(0));
    if (logits.sequence) return SequenceCrossEntropy(node, logits);
    const bool plain = vocabulary_ && RankOf(node->input(0)) == 2 && logits.dim == 1 && logits.blocks == 1 &&
                       !splits_.count(node->input(1)) && IsNone(node->input(2)) &&
                       torch::jit::toIValue(node->input(5)).value_or(c10::IValue(1.0)).toDouble() == 0.0 &&
                       IntOf(node->input(3)).has_value() && IntOf(node->input(4)).has_value();
    if (!plain) return false;
    cross_entropies_.push_back(node);
    return true;
  }

  // cross_entropy_loss of logits whose rows are sequence shards (a whole
  // head on sequence shards, flattened [B * T, V]): each rank's loss over its
  // rows, summed over the group (a mean divides by every rank's count).
  bool SequenceCrossEntropy(Node* node, const Split& logits) {
    const std::optional<int64_t> reduction = IntOf(node->input(3));
    const std::vector<int64_t> rows = ShapeOf(node->input(0)), targets = ShapeOf(node->input(1));
    const bool fits = RankOf(node->input(0)) == 2 && logits.dim == 0 && !splits_.count(node->input(1)) &&
                      targets.size() == 1 && targets[0] == rows[0] && rows[0] % (logits.blocks * tp_) == 0 &&
                      IsNone(node->input(2)) && (reduction == 1 || reduction == 2) && IntOf(node->input(4));
    if (!fits) return false;
    sequence_cross_entropies_.emplace_back(node, logits.blocks);
    return true;
  }

  // How many equal pieces the only user of linear `node`'s output takes it
  // apart into along its last dimension (a fused q, k, v projection: 3):
  // split or chunk it there, or view it with the pieces as a dimension of
  // their own ([B, T, 3C] as [B, T, 3, H, D]) when it has that many times
  // the input's features. Else 1.
  int64_t PiecesTakenApart(const Node* node) const {
    const Value* product = node->output();
    if (product->uses().size() != 1) return 1;
    const Node* user = product->uses()[0].user;
    const std::string kind = KindOf(user);
    const int64_t rank = RankOf(product);
    const std::vector<int64_t> weight = ShapeOf(node->input(1));
    if (kind == "aten::view" || kind == "aten::reshape") {
      const std::vector<int64_t> in = ShapeOf(product), out = ShapeOf(user->output());
      const int64_t pieces = weight[0] % weight[1] == 0 ? weight[0] / weight[1] : 1;
      const bool leading_kept = out.size() > in.size() && std::equal(in.begin(), in.end() - 1, out.begin());
      return pieces > 1 && leading_kept && out[rank - 1] == pieces ? pieces : 1;
    }
    if (user->inputs().size() < 3 || user->input(0) != product) return 1;
    const std::optional<int64_t> argument = IntOf(user->input(1)), dim = IntOf(user->input(2));
    if (!argument || !dim || Normalized(*dim, rank) != rank - 1) return 1;
    if (kind == "aten::chunk" || kind == "aten::unsafe_chunk") return *argument;
    const int64_t features = ShapeOf(product).back();
    if ((kind == "aten::split" || kind == "aten::unsafe_split") && features % *argument == 0) {
      return features / *argument;
    }
    return 1;
  }

  // A parameter read by this operator alone (a shared or tied one stays whole).
  bool IsOwnParameter(const Value* value) const {
    return parameter_index_.count(value) && value->uses().size() == 1;
  }

  // Whether a replicated `value` broadcasts along dimension `dim` of a result
  // of rank `rank` (size 1 there, or no such dimension).
  static bool Broadcasts(const Value* value, int64_t dim, int64_t rank) {
    const std::vector<int64_t> shape = ShapeOf(value);
    const int64_t at = dim - (rank - static_cast<int64_t>(shape.size()));
    return at < 0 || shape[at] == 1;
  }

  // Whether replicated operand `value` fits a result split along `dim` (of
  // rank `rank`): it broadcasts there, or it is a broadcast made full-size by
  // expand (an attention mask expanded to every head), whose size there the
  // rewrite divides.
  bool FitsSplit(const Value* value, int64_t dim, int64_t rank) {
    if (Broadcasts(value, dim, rank)) return true;
    Node* expand = const_cast<Value*>(value)->node();
    if (KindOf(expand) != "aten::expand" || value->uses().size() != 1) return false;
    const int64_t at = dim - (rank - RankOf(value));
    if (!Broadcasts(expand->input(0), at, RankOf(value))) return false;
    std::optional<std::vector<int64_t>> sizes = IntsOf(expand->input(1));
    if (!sizes || (*sizes)[at] % tp_ != 0) return false;
    (*sizes)[at] /= tp_;
    rewrites_.push_back({expand, 1, c10::IValue(*sizes)});
    return true;
  }

  // Element-wise operators: every split operand split alike after
  // broadcasting; the replicated ones fit the split.
  bool Broadcast(Node* node, const std::set<Node*>& origins) {
    const int64_t rank = RankOf(node->output());
    std::optional<Split> split;
    for (const Value* input : node->inputs()) {
      auto it = splits_.find(input);
      if (it == splits_.end()) continue;
      const int64_t aligned = it->second.dim + rank - RankOf(input);
      if (split && (split->dim != aligned || split->blocks != it->second.blocks ||
                    split->sequence != it->second.sequence)) {
        return false;
      }
      split = Split{aligned, it->second.blocks, origins, it->second.sequence};
    }
    for (size_t i = 0; i < node->inputs().size(); ++i) {
      const Value* input = node->input(i);
      if (!input->type()->cast<c10::TensorType>() || splits_.count(input)) continue;
      if (split->sequence && !Broadcasts(input, split->dim, rank)) {
        narrowings_.push_back({node, i, split->dim - (rank - RankOf(input))});
        continue;
      }
      if (!FitsSplit(input, split->dim, rank)) return false;
    }
    splits_[node->output()] = *split;
    return true;
  }

  // Batched products (matmul, bmm, baddbmm's two operands): both split along
  // the same batch dimension (attention heads), or one split there and the
  // other broadcast; or the rows of the first split against a replicated
  // second. baddbmm's added input must fit the split.
  bool MatrixProduct(Node* node, const std::set<Node*>& origins) {
    const int64_t rank = RankOf(node->output());
    const size_t first_operand = KindOf(node) == "aten::baddbmm" ? 1 : 0;
    std::optional<Split> split;
    for (size_t i = first_operand; i < first_operand + 2; ++i) {
      const Value* operand = node->input(i);
      auto it = splits_.find(operand);
      if (it == splits_.end()) continue;
      const int64_t own_rank = RankOf(operand);
      int64_t aligned;
      if (it->second.dim < own_rank - 2) {
        aligned = it->second.dim + rank - own_rank;
      } else if (i == first_operand && it->second.dim == own_rank - 2 && it->second.blocks == 1 &&
                 !splits_.count(node->input(i + 1))) {
        aligned = rank - 2;
      } else {
        return false;
      }
      if (split && (split->dim != aligned || split->blocks != it->second.blocks)) return false;
      if (split && split->sequence != it->second.sequence) return false;
      split = Split{aligned, it->second.blocks, origins, it->second.sequence};
    }
    if (!split) return false;  // only baddbmm's added input is split
    for (size_t i = 0; i < first_operand + 2; ++i) {
      const Value* operand = node->input(i);
      if (splits_.count(operand)) continue;
      if (i == 0 && first_operand == 1) {
        if (!FitsSplit(operand, split->dim, rank)) return false;
      } else if (split->dim < rank - 2 && !Broadcasts(operand, split->dim, rank)) {
        return false;
      }
    }
    splits_[node->output()] = *split;
    return true;
  }

  // view / reshape. Within the group of input dimensions the split one
  // belongs to, the split is the middle factor of [outer][s][rest]
  // (outer: the dimensions before it times its pieces): it lands on the
  // output dimension t whose preceding dimensions (product p) divide outer,
  // as its middle factor after outer / p pieces; t's size is divided.
  absl::StatusOr<bool> View(Node* node, const Split& split) {
    const std::vector<int64_t> in = ShapeOf(node->input(0)), out = ShapeOf(node->output());
    const int64_t dim = split.dim;
    size_t i = 0, j = 0;
    while (i < in.size() || j < out.size()) {
      const size_t group_in = i, group_out = j;
      int64_t a = i < in.size() ? in[i++] : 1, b = j < out.size() ? out[j++] : 1;
      while (a != b) {
        if (a < b && i < in.size()) {
          a *= in[i++];
        } else if (b < a && j < out.size()) {
          b *= out[j++];
        } else {
          return false;
        }
      }
      if (dim < static_cast<int64_t>(group_in) || dim >= static_cast<int64_t>(i)) continue;
      int64_t outer = split.blocks;
      for (size_t k = group_in; k < static_cast<size_t>(dim); ++k) outer *= in[k];
      int64_t before = 1;
      for (size_t t = group_out; t < j; before *= out[t++]) {
        if (outer % before != 0 || out[t] % (outer / before) != 0) continue;
        const int64_t pieces = outer / before, middle = out[t] / pieces;
        if (middle == 1) continue;
        if (middle % tp_ != 0) {
          std::vector<std::string> products;
          for (const Node* origin : split.origins) products.push_back(Describe(origin));
          return absl::InvalidArgumentError(absl::StrCat(
              "automatic tensor parallelism: ", Describe(node), ", on the split output of ",
              absl::StrJoin(products, " and "), ", makes a dimension of size ", middle,
              " from the split one (attention heads, for example), which tp=", tp_,
              " does not divide; choose a tp that divides ", middle));
        }
        std::optional<std::vector<int64_t>> sizes = IntsOf(node->input(1));
        if (!sizes) return false;  // sizes computed at run time: the pass cannot prove the rewrite
        if ((*sizes)[t] != -1) {
          (*sizes)[t] /= tp_;
          rewrites_.push_back({node, 1, c10::IValue(*sizes)});
        }
        splits_[node->output()] = Split{static_cast<int64_t>(t), pieces, split.origins, split.sequence};
        return true;
      }
      return false;
    }
    return false;
  }
  // The name of the parameter `value` is, or "" for other values.
  std::string ParameterName(const Value* value) const {
    auto it = parameter_index_.find(value);
    return it == parameter_index_.end() ? "" : names_[it->second];
  }

  std::string Describe(const Node* node) {
    std::string what = absl::StrCat(KindOf(node), " (node ", position_[node]);
    if (KindOf(node) == "aten::linear") {
      const std::string weight = ParameterName(node->input(1));
      if (!weight.empty()) absl::StrAppend(&what, ", ", weight);
    }
    return what + ")";
  }
  std::string Describe(const Value* value) {
    return absl::StrCat("[", absl::StrJoin(ShapeOf(value), ", "), "]");
  }
  int64_t AllReduceBytes(const Value* value) const {
    auto type = value->type()->cast<c10::TensorType>();
    int64_t elements = 1;
    for (int64_t size : ShapeOf(value)) elements *= size;
    const int64_t element = type && type->scalarType() ? c10::elementSize(*type->scalarType()) : 4;
    return 2 * (tp_ - 1) * elements * element / tp_;
  }

  std::shared_ptr<Graph> graph_;
  std::vector<std::string> names_;
  int64_t tp_;
  std::map<const Value*, size_t> parameter_index_;  // graph input -> index into names_
  std::map<const Node*, int64_t> position_;
  std::map<const Value*, Split> splits_;
  std::map<Node*, int64_t> columns_;  // column products -> pieces of their output
  bool sequence_;
  bool vocabulary_;  // parallel_vocab: embeddings and heads may split their vocabulary
  AutoTensorParallelOptions options_;
  // Per operator that runs split: the column products it depends on, its
  // FLOPs and the bytes of the collectives it brings (forward and backward).
  struct Work {
    std::set<Node*> origins;
    double flops = 0;
    int64_t bytes = 0;
    int collectives = 0;
  };
  std::vector<Work> work_;
  std::vector<Node*> rows_;
  std::vector<OperandNarrowing> narrowings_;
  std::map<const Value*, int64_t> sequence_inputs_;  // column inputs on sequence shards -> their sequence dim
  std::set<const Value*> replicated_sequence_inputs_;  // of those, the replicated ones (narrowed first)
  std::vector<Node*> embeddings_;       // vocabulary-parallel embeddings
  std::vector<Node*> sequence_embeddings_;  // kept whole, looking up sequence shards of the ids
  std::vector<Node*> cross_entropies_;  // of vocabulary-split logits
  std::vector<std::pair<Node*, int64_t>> sequence_cross_entropies_;  // of sequence-shard rows, in pieces
  std::vector<ArgumentRewrite> rewrites_;
  std::map<Node*, std::string> whole_;  // products kept whole, and why
  Node* conflict_ = nullptr;
};

// Drops every output but the first scalar floating-point one (the loss).
void KeepOnlyTheLoss(Graph& graph) {
  for (size_t i = 0; i < graph.outputs().size(); ++i) {
    const Value* output = graph.outputs()[i];
    auto type = output->type()->cast<c10::TensorType>();
    if (!type || RankOf(output) != 0 || !type->scalarType() || !c10::isFloatingType(*type->scalarType())) continue;
    for (size_t j = graph.outputs().size(); j-- > 0;) {
      if (j != i) graph.eraseOutput(j);
    }
    torch::jit::EliminateDeadCode(graph.block());
    return;
  }
}

}  // namespace

std::string AutoTensorParallelPlan::Report() const {
  std::string report = absl::StrFormat("%-48s %-10s %s\n", "parameter", "layout", "slice / why it stays whole");
  int split = 0;
  for (const ParameterLayout& p : parameters) {
    std::string layout = "replicated", detail = p.why;
    if (p.role != ParameterLayout::Role::kReplicated) {
      ++split;
      layout = p.role == ParameterLayout::Role::kColumn ? "column"
               : p.role == ParameterLayout::Role::kRow  ? "row"
                                                        : "vocabulary";
      detail = absl::StrCat("dim ", p.shard.dim, ", part ", p.shard.index, " of ", p.shard.parts,
                            p.shard.blocks > 1 ? absl::StrCat(" in each of ", p.shard.blocks, " pieces") : "");
    }
    absl::StrAppend(&report, absl::StrFormat("%-48s %-10s %s\n", p.name, layout, detail));
  }
  absl::StrAppend(&report, split, " of ", parameters.size(), " parameters split; collectives per micro-batch:\n");
  for (const std::string& c : collectives) absl::StrAppend(&report, "  ", c, "\n");
  absl::StrAppend(&report, absl::StrFormat("bytes sent per micro-batch and rank (ring all-reduce): %d\n",
                                           bytes_per_micro_batch));
  return report;
}

absl::StatusOr<TensorParallelGraph> AutoTensorParallel(const ModelGraph& model, const TensorParallelism& tp,
                                                       const AutoTensorParallelOptions& options) {
  std::shared_ptr<Graph> graph = model.jit_graph()->copy();
  if (options.loss_only) KeepOnlyTheLoss(*graph);
  ModelGraph::CanonicalizeLinearProducts(*graph, graph->inputs().size() - model.parameters().size());
  Planner planner(graph, model.parameter_names(), tp, options);
  TRIDENT_RETURN_IF_ERROR(planner.Plan());
  TensorParallelGraph result;
  result.plan.parameters = planner.Apply(tp.rank, tp.group, result.plan);
  bool any = false;
  for (size_t i = 0; i < result.plan.parameters.size(); ++i) {
    const ParameterLayout& layout = result.plan.parameters[i];
    const at::Tensor& full = model.parameters()[i];
    if (layout.role == ParameterLayout::Role::kReplicated) {
      result.parameters.emplace_back(layout.name, full);
      continue;
    }
    any = true;
    at::Tensor shard;
    {
      c10::NoGradGuard no_grad;
      shard = layout.shard.Slice(full).clone();
    }
    shard.set_requires_grad(full.requires_grad());
    result.parameters.emplace_back(layout.name, shard);
    result.shards[layout.name] = layout.shard;
  }
  if (!any) {
    return absl::FailedPreconditionError(absl::StrCat(
        "automatic tensor parallelism found no matrix product it can split, or whose split pays for "
        "its communication, in this model:\n",
        result.plan.Report(),
        "use tp=1, set tp_split_all to split regardless of the cost model, or build the model's layers "
        "tensor-parallel"));
  }
  std::vector<at::Tensor> parameters;
  for (const auto& [name, p] : result.parameters) parameters.push_back(p);
  result.forward = ModelGraph::GraphForward(graph, std::move(parameters));
  return result;
}

}  // namespace trident
