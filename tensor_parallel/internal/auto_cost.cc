// The cost model: the compute a split saves against the collectives it costs.
#include "tensor_parallel/internal/auto_planner.h"

#include <algorithm>
#include <functional>

#include "absl/strings/str_format.h"

namespace trident {
namespace internal {
namespace auto_tp {

void Planner::RecordWork(Node* node) {
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

bool Planner::KeepUnprofitableRegionsWhole() {
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

int64_t Planner::AllReduceBytes(const Value* value) const {
  auto type = value->type()->cast<c10::TensorType>();
  int64_t elements = 1;
  for (int64_t size : ShapeOf(value)) elements *= size;
  const int64_t element = type && type->scalarType() ? c10::elementSize(*type->scalarType()) : 4;
  return 2 * (tp_ - 1) * elements * element / tp_;
}

}  // namespace auto_tp
}  // namespace internal
}  // namespace trident
