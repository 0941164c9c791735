// The rewrite of the planned graph for one tensor-parallel rank.
#include "tensor_parallel/internal/auto_planner.h"

#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/passes/dead_code_elimination.h>

#include "absl/strings/str_cat.h"

namespace trident {
namespace internal {
namespace auto_tp {

std::vector<ParameterLayout> Planner::Apply(int64_t rank, const std::string& group, AutoTensorParallelPlan& plan) {
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
      node->replaceInput(
          1, graph_->insert(c10::aten::masked_fill, {graph_->insert(c10::aten::sub, {ids, start}), outside, 0}));
    }
    torch::jit::WithInsertPoint after(node->next());
    Value* mine =
        graph_->insert(c10::aten::masked_fill, {rows, graph_->insert(c10::aten::unsqueeze, {outside, -1}), 0.0});
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
    plan.collectives.push_back(
        absl::StrCat("vocab_parallel_cross_entropy at node ", position_[node], " (all-reduces two values per token)"));
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

}  // namespace auto_tp
}  // namespace internal
}  // namespace trident
