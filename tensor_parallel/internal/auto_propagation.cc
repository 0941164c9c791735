// Sharding propagation: how each operator passes on the splits of its inputs.
#include "tensor_parallel/internal/auto_planner.h"

#include <algorithm>

#include <torch/csrc/jit/ir/constants.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace trident {
namespace internal {
namespace auto_tp {
namespace {

// Operators whose output is split where their split inputs are (after
// broadcasting), as long as every replicated tensor input broadcasts along
// the split dimension (size 1 there, or no such dimension).
const std::set<std::string>& ElementWise() {
  static const auto* kinds =
      new std::set<std::string>{"aten::add",          "aten::add_",       "aten::sub",
                                "aten::rsub",         "aten::mul",        "aten::mul_",
                                "aten::div",          "aten::div_",       "aten::masked_fill",
                                "aten::masked_fill_", "aten::where",      "aten::maximum",
                                "aten::minimum",      "aten::pow",        "aten::neg",
                                "aten::exp",          "aten::log",        "aten::sqrt",
                                "aten::rsqrt",        "aten::abs",        "aten::sigmoid",
                                "aten::tanh",         "aten::relu",       "aten::gelu",
                                "aten::silu",         "aten::softplus",   "aten::erf",
                                "aten::sin",          "aten::cos",        "aten::contiguous",
                                "aten::clone",        "aten::dropout",    "aten::feature_dropout",
                                "aten::to",           "aten::type_as",    "aten::detach",
                                "aten::eq",           "aten::ne",         "aten::gt",
                                "aten::lt",           "aten::ge",         "aten::le",
                                "aten::square",       "aten::reciprocal", "aten::sign",
                                "aten::clamp"};
  return *kinds;
}

}  // namespace

absl::StatusOr<bool> Planner::Propagate(Node* node) {
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
    const std::optional<int64_t> start = IntOf(node->input(2)), end = IntOf(node->input(3)),
                                 step = IntOf(node->input(4));
    const bool all = (IsNone(node->input(2)) || start == 0) &&
                     (IsNone(node->input(3)) || (end && *end >= ShapeOf(x)[d])) && step == 1;
    return all && set(node->output(), d, blocks);
  }
  if (kind == "aten::select" || kind == "aten::unbind") {  // unbind: a list of all the selects
    const int64_t at = dim_argument(1, rank);
    return at != d && set(node->output(), d > at ? d - 1 : d, blocks);
  }
  if (kind == "aten::split" || kind == "aten::unsafe_split" || kind == "aten::chunk" || kind == "aten::unsafe_chunk") {
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

absl::StatusOr<bool> Planner::Linear(Node* node) {
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
      whole_[node] =
          absl::StrCat(weight[0], " output features", blocks > 1 ? absl::StrCat(" in ", blocks, " pieces") : "",
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
        return absl::InvalidArgumentError(
            absl::StrCat("sequence parallelism: ", Describe(node), " reads [", absl::StrJoin(shape, ", "),
                         "], whose sequence (the dimension before the features) tp=", tp_, " does not divide"));
      }
      sequence_inputs_[node->input(0)] = static_cast<int64_t>(shape.size()) - 2;
      replicated_sequence_inputs_.insert(node->input(0));
    }
    return true;
  }
  if (!shardable || x->second.blocks != 1 || x->second.dim != RankOf(node->input(0)) - 1) return false;
  if (weight[1] % tp_ != 0) {
    return absl::InvalidArgumentError(absl::StrCat("automatic tensor parallelism: ", Describe(node), " has ", weight[1],
                                                   " input features, which tp=", tp_, " does not divide"));
  }
  rows_.push_back(node);
  return SequenceShards(node, node->output());
}

absl::StatusOr<bool> Planner::SequenceShards(const Node* node, Value* value) {
  if (!sequence_) return true;
  const std::vector<int64_t> shape = ShapeOf(value);
  if (shape.size() < 2 || shape[shape.size() - 2] % tp_ != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence parallelism: ", Describe(node), " makes [", absl::StrJoin(shape, ", "),
                     "], whose sequence (the dimension before the features) tp=", tp_, " does not divide"));
  }
  splits_[value] = Split{static_cast<int64_t>(shape.size()) - 2, 1, {}, /*sequence=*/true};
  return true;
}

bool Planner::TiedToEmbeddings(const Node* node) const {
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

bool Planner::VocabularySplits(const Node* embedding) const {
  const std::vector<int64_t> weight = ShapeOf(embedding->input(0));
  return vocabulary_ && weight.size() == 2 && weight[0] % tp_ == 0 && IntOf(embedding->input(2)).value_or(0) == -1 &&
         parameter_index_.count(embedding->input(0)) && embedding->input(1)->node()->kind() == c10::prim::Param;
}

absl::StatusOr<bool> Planner::Embedding(Node* node) {
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

absl::StatusOr<bool> Planner::WholeOnSequenceShards(Node* node) {
  const Value* ids = node->input(1);
  if (!sequence_ || ids->node()->kind() != c10::prim::Param || RankOf(ids) != 2) return true;
  sequence_embeddings_.push_back(node);
  return SequenceShards(node, node->output());
}

bool Planner::CrossEntropy(Node* node) {
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

bool Planner::SequenceCrossEntropy(Node* node, const Split& logits) {
  const std::optional<int64_t> reduction = IntOf(node->input(3));
  const std::vector<int64_t> rows = ShapeOf(node->input(0)), targets = ShapeOf(node->input(1));
  const bool fits = RankOf(node->input(0)) == 2 && logits.dim == 0 && !splits_.count(node->input(1)) &&
                    targets.size() == 1 && targets[0] == rows[0] && rows[0] % (logits.blocks * tp_) == 0 &&
                    IsNone(node->input(2)) && (reduction == 1 || reduction == 2) && IntOf(node->input(4));
  if (!fits) return false;
  sequence_cross_entropies_.emplace_back(node, logits.blocks);
  return true;
}

int64_t Planner::PiecesTakenApart(const Node* node) const {
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

bool Planner::IsOwnParameter(const Value* value) const {
  return parameter_index_.count(value) && value->uses().size() == 1;
}

bool Planner::Broadcasts(const Value* value, int64_t dim, int64_t rank) {
  const std::vector<int64_t> shape = ShapeOf(value);
  const int64_t at = dim - (rank - static_cast<int64_t>(shape.size()));
  return at < 0 || shape[at] == 1;
}

bool Planner::FitsSplit(const Value* value, int64_t dim, int64_t rank) {
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

bool Planner::Broadcast(Node* node, const std::set<Node*>& origins) {
  const int64_t rank = RankOf(node->output());
  std::optional<Split> split;
  for (const Value* input : node->inputs()) {
    auto it = splits_.find(input);
    if (it == splits_.end()) continue;
    const int64_t aligned = it->second.dim + rank - RankOf(input);
    if (split &&
        (split->dim != aligned || split->blocks != it->second.blocks || split->sequence != it->second.sequence)) {
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

bool Planner::MatrixProduct(Node* node, const std::set<Node*>& origins) {
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

absl::StatusOr<bool> Planner::View(Node* node, const Split& split) {
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
        return absl::InvalidArgumentError(
            absl::StrCat("automatic tensor parallelism: ", Describe(node), ", on the split output of ",
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

}  // namespace auto_tp
}  // namespace internal
}  // namespace trident
