// ZeRO stage 3 in backward: which buckets are gathered when, and released
// when. A bucket whose every reading node the forward found is gathered just
// before the first of them runs, so a layer's backward holds about one of
// its buckets (and the next, prefetched) instead of the whole layer.
#include <algorithm>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>

#include "base/status.h"
#include "zero/internal/buckets.h"
#include "zero/zero.h"

namespace trident {
namespace {

// Runs `callback` before the node it is added to (a pre-hook: before the
// node reads its saved tensors).
class BeforeNode : public torch::autograd::FunctionPreHook {
 public:
  explicit BeforeNode(std::function<void()> callback) : callback_(std::move(callback)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    callback_();
    return grads;
  }

 private:
  std::function<void()> callback_;
};

// Nodes through which a value of a parameter reaches the node reading it
// without being copied (a transpose, a view, an expand) have one input; so
// does an operator on the parameter alone, which may keep it too. Counted
// from the reader's edge.
constexpr int kMostNodesToParameter = 8;

}  // namespace

void ZeroOptimizer::BackwardReached(int64_t layer) {
  const int64_t unit = UnitOf(layer);
  for (int b : layout_.layer_buckets[unit]) {
    if (!buckets_[b].hooked) HoldForBackward(buckets_[b]);
  }
  // Backward goes down the units: prefetch those below (their buckets
  // without reader hooks: the others are prefetched along their readers).
  auto below = layout_.layer_buckets.lower_bound(unit);
  for (int k = 0; k < ZeroPrefetchDepth(options_.spec) && below != layout_.layer_buckets.begin(); ++k) {
    Prefetch((--below)->first, /*unhooked_only=*/true);
  }
  if (below != layout_.layer_buckets.begin()) ReadAhead(std::prev(below)->first);
  // Units two or more above are done with backward: release what they still
  // hold (a parameter that got no gradient this time keeps its bucket until here).
  for (Bucket& bucket : buckets_) {
    if (bucket.unit > UnitLast(unit) + 1) ReleaseAfterBackward(bucket);
  }
}

// The nodes backward runs for `layer` are those its forward made (sequence
// numbers from layer_first_node_ on), reached from its outputs. A node reads
// a parameter where one of its edges leads to the parameter's grad
// accumulator through nodes of one input each: every node that may hold the
// parameter's storage (a saved weight, or a view of it) is such a node, or
// runs after one. A bucket read by this layer alone, every parameter of
// which has a reader here, is gathered by its readers in backward.
void ZeroOptimizer::HookBackwardReaders(int64_t layer, const Values& outputs) {
  using torch::autograd::Node;
  std::vector<Node*> stack;
  std::unordered_set<Node*> seen;
  auto visit = [&](Node* node) {
    const bool made_here = node != nullptr && node->sequence_nr() >= layer_first_node_ &&
                           node->sequence_nr() != std::numeric_limits<uint64_t>::max();  // not an accumulator
    if (made_here && seen.insert(node).second) stack.push_back(node);
  };
  for (const at::Tensor& output : outputs) {
    if (output.defined()) visit(output.grad_fn().get());
  }
  std::map<Node*, std::vector<int>> readers;        // node -> buckets it reads
  std::map<int, std::set<int>> slots_with_readers;  // bucket -> its parameters read here
  while (!stack.empty()) {
    Node* node = stack.back();
    stack.pop_back();
    for (const torch::autograd::Edge& edge : node->next_edges()) {
      Node* next = edge.function.get();
      for (int k = 0; next != nullptr && k < kMostNodesToParameter; ++k) {
        auto slot = slot_of_accumulator_.find(next);
        if (slot != slot_of_accumulator_.end()) {
          const auto [bucket, index] = slot->second;
          std::vector<int>& read = readers[node];
          if (std::find(read.begin(), read.end(), bucket) == read.end()) read.push_back(bucket);
          slots_with_readers[bucket].insert(index);
          break;
        }
        if (next->next_edges().size() != 1) break;
        next = next->next_edges()[0].function.get();
      }
      visit(edge.function.get());
    }
  }
  std::set<int> hooked;
  for (int b : layout_.layer_buckets[UnitOf(layer)]) {
    Bucket& bucket = buckets_[b];
    if (!bucket.sharded || bucket.read_by != layer) continue;
    bucket.hooked = slots_with_readers[b].size() == bucket.params.size();
    if (bucket.hooked) hooked.insert(b);
  }
  for (auto& [node, buckets] : readers) {
    buckets.erase(std::remove_if(buckets.begin(), buckets.end(), [&](int b) { return !hooked.count(b); }),
                  buckets.end());
    if (buckets.empty()) continue;
    node->add_pre_hook(std::make_unique<BeforeNode>([this, buckets = buckets] { GatherForReaders(buckets); }));
  }
}

void ZeroOptimizer::GatherForReaders(const std::vector<int>& buckets) {
  // The node about to run makes a gradient of a bucket's size: first free
  // those already reduced.
  absl::Status finished = FinishCompletedReduceScatters();
  if (!finished.ok() && first_error_.ok()) first_error_ = finished;
  for (int b : buckets) {
    if (buckets_[b].backward_held) continue;
    HoldForBackward(buckets_[b]);
    if (last_reader_gather_ >= 0) buckets_[last_reader_gather_].next_in_backward = b;
    last_reader_gather_ = b;
    PrefetchAlongBackward(b, ZeroPrefetchDepth(options_.spec));
  }
  // The gradient it makes counts as one in flight: wait for older ones to
  // leave room (a prefetch travels meanwhile).
  finished = LimitReduceScatters(options_.spec.max_inflight_reduce_scatters() - 1);
  if (!finished.ok() && first_error_.ok()) first_error_ = finished;
}

void ZeroOptimizer::PrefetchAlongBackward(int bucket, int count) {
  for (int k = 0, next = bucket; k < count; ++k) {
    next = buckets_[next].next_in_backward;
    if (next < 0) return;
    PrefetchBucket(next);
  }
}

absl::Status ZeroOptimizer::FinishCompletedReduceScatters() {
  for (; !reducing_.empty(); reducing_.pop_front()) {
    Bucket& bucket = buckets_[reducing_.front()];
    if (bucket.reducing && !bucket.reducing->IsCompleted()) break;
    TRIDENT_RETURN_IF_ERROR(FinishReduceScatter(bucket));
  }
  return absl::OkStatus();
}

void ZeroOptimizer::HoldForBackward(Bucket& bucket) {
  if (bucket.backward_held) return;
  absl::Status status = Gather(bucket);  // thrown: backward cannot go on without it
  TORCH_CHECK(status.ok(), std::string(status.message()));
  bucket.backward_held = true;
}

void ZeroOptimizer::ReleaseAfterBackward(Bucket& bucket) {
  if (!bucket.backward_held) return;
  bucket.backward_held = false;
  Release(bucket);
}

}  // namespace trident
