// The automatic tensor-parallel pass: plans the splits of a traced graph
// (internal/auto_planner.h: propagation, cost, rewrite), applies them for this
// rank and slices the parameters; the plan's report.
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
#include "tensor_parallel/internal/auto_planner.h"
#include "tensor_parallel/tensor_parallel.h"

namespace trident {
namespace internal {
namespace auto_tp {

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

absl::Status Planner::Plan() {
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
          return absl::InvalidArgumentError(
              absl::StrCat("automatic tensor parallelism: the layer lists pin ", Describe(origin),
                           " column-parallel, but its split output would reach ", where,
                           ", which the pass cannot split; pin the product that should end the split region "
                           "row-parallel, or unpin this one"));
        }
        kept_whole = true;
        whole_[origin] = absl::StrCat("its split output would reach ", where, ", which the pass cannot split");
      }
    }
    if (!kept_whole) {
      return absl::InvalidArgumentError(absl::StrCat("sequence parallelism: ", where,
                                                     " cannot run on sequence shards of its input; turn "
                                                     "sequence_parallel off for this model"));
    }
  }
}

Planner::Pin Planner::Pinned(const Node* node) const {
  if (KindOf(node) != "aten::linear") return Pin::kNone;
  const std::string name = ParameterName(node->input(1));
  auto listed = [&](const google::protobuf::RepeatedPtrField<std::string>& patterns) {
    return !name.empty() && std::any_of(patterns.begin(), patterns.end(), [&](const std::string& pattern) {
      return name.find(pattern) != std::string::npos;
    });
  };
  if (listed(options_.layers.column())) return Pin::kColumn;
  if (listed(options_.layers.row())) return Pin::kRow;
  const std::vector<int64_t> weight = ShapeOf(node->input(1));
  if (weight.size() != 2) return Pin::kNone;
  for (const TensorParallelLayerLists::Mapping& m : options_.layers.input_output_mapping()) {
    if (weight[1] * m.output() == weight[0] * m.input()) return m.column() ? Pin::kColumn : Pin::kRow;
  }
  return Pin::kNone;
}

absl::Status Planner::CheckPinnedRows() {
  for (Node* node : graph_->nodes()) {
    if (Pinned(node) != Pin::kRow || std::find(rows_.begin(), rows_.end(), node) != rows_.end()) continue;
    return absl::InvalidArgumentError(
        absl::StrCat("automatic tensor parallelism: the layer lists pin ", Describe(node),
                     " row-parallel, but its input is not split along its features (no column-parallel product "
                     "feeds it through operators the pass can split); pin its partner column-parallel, or unpin it"));
  }
  return absl::OkStatus();
}

std::string Planner::ParameterName(const Value* value) const {
  auto it = parameter_index_.find(value);
  return it == parameter_index_.end() ? "" : names_[it->second];
}

std::string Planner::Describe(const Node* node) {
  std::string what = absl::StrCat(KindOf(node), " (node ", position_[node]);
  if (KindOf(node) == "aten::linear") {
    const std::string weight = ParameterName(node->input(1));
    if (!weight.empty()) absl::StrAppend(&what, ", ", weight);
  }
  return what + ")";
}

std::string Planner::Describe(const Value* value) {
  return absl::StrCat("[", absl::StrJoin(ShapeOf(value), ", "), "]");
}

}  // namespace auto_tp
}  // namespace internal

namespace {

using internal::auto_tp::Graph;
using internal::auto_tp::Planner;
using internal::auto_tp::RankOf;
using internal::auto_tp::Value;

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
  absl::StrAppend(
      &report, absl::StrFormat("bytes sent per micro-batch and rank (ring all-reduce): %d\n", bytes_per_micro_batch));
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
    return absl::FailedPreconditionError(
        absl::StrCat("automatic tensor parallelism found no matrix product it can split, or whose split pays for "
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
