// The automatic tensor-parallel pass's planner (private to //tensor_parallel):
// sharding propagation over a traced graph (auto_propagation.cc), the
// choice of regions by cost (auto_cost.cc) and the rewrite for one rank
// (auto_rewrite.cc); auto_tensor_parallel.cc drives it.
#ifndef TRIDENT_TENSOR_PARALLEL_INTERNAL_AUTO_PLANNER_H_
#define TRIDENT_TENSOR_PARALLEL_INTERNAL_AUTO_PLANNER_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <torch/csrc/jit/ir/ir.h>

#include "absl/status/statusor.h"
#include "tensor_parallel/tensor_parallel.h"

namespace trident {
namespace internal {
namespace auto_tp {

using torch::jit::Graph;
using torch::jit::Node;
using torch::jit::Value;

std::string KindOf(const Node* node);
// The traced shape of a tensor value (empty where unknown), and its rank.
std::vector<int64_t> ShapeOf(const Value* value);
int64_t RankOf(const Value* value);
// `dim` counted from the front (a negative one from the back).
int64_t Normalized(int64_t dim, int64_t rank);
// A constant int (or int list, also one built by prim::ListConstruct) argument.
std::optional<int64_t> IntOf(const Value* value);
std::optional<std::vector<int64_t>> IntsOf(const Value* value);
bool IsNone(const Value* value);

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
  absl::Status Plan();

  // Rewrites the graph for tensor-parallel rank `rank` (group `group`) and
  // returns the parameters' layouts.
  std::vector<ParameterLayout> Apply(int64_t rank, const std::string& group, AutoTensorParallelPlan& plan);

 private:
  // Whether `node` splits as the pass knows (recording its outputs' splits),
  // false where a split input reaches it and it cannot; errors where a split
  // dimension does not divide.
  absl::StatusOr<bool> Propagate(Node* node);
  // What the layer lists (Merak's set_tp_layer_lists) pin linear `node` to:
  // a name in col_para_list / row_para_list (part of its weight's name), or
  // an input:output feature ratio in input_output_mapping.
  enum class Pin { kNone, kColumn, kRow };
  Pin Pinned(const Node* node) const;

  absl::Status CheckPinnedRows();

  // Records the split work of `node` after Propagate: the region (column
  // products) it belongs to, the compute a split saves and the collectives
  // it costs.
  void RecordWork(Node* node);

  // With a cost model (options_.flops_per_second > 0): groups the split work
  // into regions (column products whose splits meet), and keeps whole every
  // region whose communication takes longer than the compute its split saves
  // (forward and backward, 3x the forward FLOPs). Whether any was.
  bool KeepUnprofitableRegionsWhole();

  // aten::linear(x, weight, bias): a column product where x is replicated,
  // a row product where x is split along its features.
  absl::StatusOr<bool> Linear(Node* node);

  // With sequence parallelism, `value` (the output of a row product or a
  // vocabulary-parallel embedding, [B, T, C]) is reduce-scattered into
  // sequence shards; errors where tp does not divide the sequence.
  absl::StatusOr<bool> SequenceShards(const Node* node, Value* value);

  // Whether the weight of linear `node` is otherwise read only by embeddings
  // that can split their vocabulary (a head tied to the token embedding).
  bool TiedToEmbeddings(const Node* node) const;

  // An embedding of the model's input ids (token embeddings, not position
  // tables indexed by computed positions) whose vocabulary tp divides and
  // that has no padding row.
  bool VocabularySplits(const Node* embedding) const;

  // aten::embedding(weight, ids, ...): vocabulary-parallel (each rank looks
  // up the ids in its rows, the rows summed over the group), unless its
  // weight is tied to a head kept whole, or read otherwise.
  absl::StatusOr<bool> Embedding(Node* node);

  // With sequence parallelism, an embedding kept whole looks up this rank's
  // sequence shard of the model's ids ([B, T]) only: what follows runs on
  // sequence shards from the start, and the embedding's gradient is this
  // shard's, as every replicated parameter's is.
  absl::StatusOr<bool> WholeOnSequenceShards(Node* node);

  // cross_entropy_loss of logits split along the vocabulary: the
  // vocabulary-parallel cross-entropy, which never gathers the logits.
  // Without parallel_vocab split logits are a conflict: the head stays whole.
  bool CrossEntropy(Node* node);

  // cross_entropy_loss of logits whose rows are sequence shards (a whole
  // head on sequence shards, flattened [B * T, V]): each rank's loss over its
  // rows, summed over the group (a mean divides by every rank's count).
  bool SequenceCrossEntropy(Node* node, const Split& logits);

  // How many equal pieces the only user of linear `node`'s output takes it
  // apart into along its last dimension (a fused q, k, v projection: 3):
  // split or chunk it there, or view it with the pieces as a dimension of
  // their own ([B, T, 3C] as [B, T, 3, H, D]) when it has that many times
  // the input's features. Else 1.
  int64_t PiecesTakenApart(const Node* node) const;

  // A parameter read by this operator alone (a shared or tied one stays whole).
  bool IsOwnParameter(const Value* value) const;

  // Whether a replicated `value` broadcasts along dimension `dim` of a result
  // of rank `rank` (size 1 there, or no such dimension).
  static bool Broadcasts(const Value* value, int64_t dim, int64_t rank);

  // Whether replicated operand `value` fits a result split along `dim` (of
  // rank `rank`): it broadcasts there, or it is a broadcast made full-size by
  // expand (an attention mask expanded to every head), whose size there the
  // rewrite divides.
  bool FitsSplit(const Value* value, int64_t dim, int64_t rank);

  // Element-wise operators: every split operand split alike after
  // broadcasting; the replicated ones fit the split.
  bool Broadcast(Node* node, const std::set<Node*>& origins);

  // Batched products (matmul, bmm, baddbmm's two operands): both split along
  // the same batch dimension (attention heads), or one split there and the
  // other broadcast; or the rows of the first split against a replicated
  // second. baddbmm's added input must fit the split.
  bool MatrixProduct(Node* node, const std::set<Node*>& origins);

  // view / reshape. Within the group of input dimensions the split one
  // belongs to, the split is the middle factor of [outer][s][rest]
  // (outer: the dimensions before it times its pieces): it lands on the
  // output dimension t whose preceding dimensions (product p) divide outer,
  // as its middle factor after outer / p pieces; t's size is divided.
  absl::StatusOr<bool> View(Node* node, const Split& split);

  // The name of the parameter `value` is, or "" for other values.
  std::string ParameterName(const Value* value) const;
  // For messages: an operator with its position (and a product's weight), a value's shape.
  std::string Describe(const Node* node);
  std::string Describe(const Value* value);
  // Bytes a ring all-reduce of `value` sends per rank.
  int64_t AllReduceBytes(const Value* value) const;

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
  std::map<const Value*, int64_t> sequence_inputs_;    // column inputs on sequence shards -> their sequence dim
  std::set<const Value*> replicated_sequence_inputs_;  // of those, the replicated ones (narrowed first)
  std::vector<Node*> embeddings_;                      // vocabulary-parallel embeddings
  std::vector<Node*> sequence_embeddings_;             // kept whole, looking up sequence shards of the ids
  std::vector<Node*> cross_entropies_;                 // of vocabulary-split logits
  std::vector<std::pair<Node*, int64_t>> sequence_cross_entropies_;  // of sequence-shard rows, in pieces
  std::vector<ArgumentRewrite> rewrites_;
  std::map<Node*, std::string> whole_;  // products kept whole, and why
  Node* conflict_ = nullptr;
};

}  // namespace auto_tp
}  // namespace internal
}  // namespace trident

#endif  // TRIDENT_TENSOR_PARALLEL_INTERNAL_AUTO_PLANNER_H_
