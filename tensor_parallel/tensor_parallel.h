// tensor_parallel: Megatron-style tensor and sequence parallelism.
//
// Collectives with autograd are registered operators (namespace `trident`, CPU,
// CUDA and Autograd kernels) that take their process group by name, so traced
// graphs keep them as single nodes:
//
//   copy_to_tp_region        identity forward, all-reduce backward
//   reduce_from_tp_region    all-reduce forward, identity backward
//   gather_from_tp_region    all-gather of the last dimension forward, own slice backward
//   scatter_to_tp_region     own slice of the last dimension forward, all-gather backward
//   gather_from_sequence_region       all-gather along `dim` forward, reduce-scatter backward
//   reduce_scatter_to_sequence_region reduce-scatter along `dim` forward, all-gather backward
//   vocab_parallel_cross_entropy      per-token loss of vocabulary-sharded logits
//
// Layers built on them: ColumnParallelLinear, RowParallelLinear,
// VocabParallelEmbedding. Every shard is the slice (ShardSpec) of the weight
// the single-process model would hold.
//
//   TensorParallelism tp{.size = 2, .rank = tp_group.rank(), .group = "tp"};
//   ColumnParallelLinear fc1(tp, 64, 256);
//   RowParallelLinear fc2(tp, 256, 64);
//   at::Tensor y = fc2->forward(at::gelu(fc1->forward(x)));  // == the unsharded MLP
#ifndef TRIDENT_TENSOR_PARALLEL_TENSOR_PARALLEL_H_
#define TRIDENT_TENSOR_PARALLEL_TENSOR_PARALLEL_H_

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "absl/status/statusor.h"
#include "tensor_parallel/tensor_parallel.pb.h"

namespace trident {

class ModelGraph;  // graph/model_graph.h

// This process's place in its tensor-parallel group.
struct TensorParallelism {
  int64_t size = 1;
  int64_t rank = 0;
  std::string group = "tp";  // a name FindProcessGroup knows
  // Norms, dropout and residuals run on sequence shards [B, T / size, C]
  // between the parallel layers; their parameters' gradients are partial and
  // must be summed over the group (see SequenceParallelGradients).
  bool sequence_parallel = false;
  // Merak's parallel_vocab: the token embedding's rows and the head's outputs
  // split over the group (the vocabulary-parallel embedding, head and loss);
  // false keeps both whole on every rank.
  bool parallel_vocab = true;
  // Merak's tp_overlapping_level: 0 none; 1 sub-pipelined products inside each
  // column- and row-parallel layer (without sequence parallelism or an
  // adapter): the product runs in row blocks and each block's all-reduce
  // travels while the next block, or the weight's gradient, is computed;
  // 2 also sub-pipelines the transformer blocks written for it (the zoo's:
  // RunSubPipelinedBlock), the other layers as 1.
  int overlapping_level = 0;
};

// The operators, called through the dispatcher (so they trace and autograd).
at::Tensor CopyToTensorParallelRegion(const at::Tensor& x, const std::string& group);
at::Tensor ReduceFromTensorParallelRegion(const at::Tensor& x, const std::string& group);
at::Tensor GatherFromTensorParallelRegion(const at::Tensor& x, const std::string& group);
at::Tensor ScatterToTensorParallelRegion(const at::Tensor& x, const std::string& group);
at::Tensor GatherFromSequenceParallelRegion(const at::Tensor& x, const std::string& group, int64_t dim);
at::Tensor ReduceScatterToSequenceParallelRegion(const at::Tensor& x, const std::string& group, int64_t dim);
// Cross-entropy of logits [N, V / size] (this rank's vocabulary slice) against
// global target ids [N]: the per-token losses [N] in fp32 (as autocast runs
// cross-entropy; bf16 logits too), equal on every rank. The full logits are
// never gathered.
at::Tensor VocabParallelCrossEntropy(const at::Tensor& logits, const at::Tensor& targets, const std::string& group);

// The input of a column-parallel product: `x` copied into the region
// (replicated input), or gathered from sequence shards; `x` itself at tp = 1.
at::Tensor ColumnParallelInput(const at::Tensor& x, const TensorParallelism& tp);
// The output of a row-parallel product: summed over the group, or
// reduce-scattered into sequence shards; `y` itself at tp = 1.
at::Tensor RowParallelOutput(const at::Tensor& y, const TensorParallelism& tp);

// Merak's sub-pipelined tensor parallelism (overlapping_level 1): a layer's
// product in row blocks, each block's all-reduce started as soon as the block
// is computed. Column: `x` replicated, returns linear(x, weight, bias) on this
// rank's columns; backward sums x's gradient over `group` block by block while
// the weight's gradient is computed. Row: `x` this rank's input features,
// returns linear(x, weight) summed over `group`, each block travelling while
// the next is multiplied; backward has no collective. Values equal the
// blocking layers' (ColumnParallelInput + linear; linear + RowParallelOutput);
// under autocast the operands are cast as linear's would be.
at::Tensor SubPipelinedColumnProduct(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                     const std::string& group);
at::Tensor SubPipelinedRowProduct(const at::Tensor& x, const at::Tensor& weight, const std::string& group);

// Merak's tp_overlapping_level 2, for a transformer block written for it: the
// block's micro-batch runs as two sub-micro-batches (halves of the batch
// dimension), and each one's all-reduces travel while the other's products
// run, forward and backward. A block is a sequence of regions, each a
// column-parallel input and a row-parallel output (attention, MLP):
//   enter   the residual stream to the region's input (a norm)
//   partial that input, already inside the region, to this rank's product of
//           the row-parallel layer: not summed, without its bias
//           (ColumnParallelLinear::ForwardInRegion, RowParallelLinear::PartialForward)
//   leave   the residual stream and the summed output to the next residual
//           stream (bias, dropout, residual add)
struct BlockRegion {
  std::function<at::Tensor(const at::Tensor&)> enter, partial;
  std::function<at::Tensor(const at::Tensor&, const at::Tensor&)> leave;
};
// Whether RunSubPipelinedBlock applies: overlapping_level >= 2, tp > 1,
// without sequence parallelism, a batch `x` of at least 2.
bool SubPipelinesBlock(const TensorParallelism& tp, const at::Tensor& x);
// The block's output for `x` [B, ...]: the regions in order on each half of
// the batch, the values of running each region as
// leave(x, RowParallelOutput(partial(ColumnParallelInput(enter(x))))).
// Forward sums one half's partial output while the other half's products run;
// backward starts each half's input-gradient sum as soon as it is computed
// and awaits it only once the rest of the block's ready backward has run.
// Dropout inside the regions draws per half (other masks than a whole batch's).
at::Tensor RunSubPipelinedBlock(const at::Tensor& x, const std::vector<BlockRegion>& regions, const std::string& group);
// How many of this process's backward gradient sums of RunSubPipelinedBlock
// were still travelling when the next one started: the overlap it achieved.
int64_t SubPipelinedGradientSumsOverlapped();

// Bytes this process has sent through the operators above (all-reduce counted
// as 2 (p-1)/p of the tensor, all-gather and reduce-scatter as (p-1)/p of the
// full tensor, as ring algorithms move them).
int64_t TensorParallelBytesCommunicated();

// Which part of a full tensor a rank holds: the full tensor is cut into
// `blocks` equal pieces along `dim` (3 for a fused q, k, v projection), each
// piece into `parts` equal slices, and the rank holds slice `index` of every
// piece, concatenated.
struct ShardSpec {
  int64_t dim = 0;
  int64_t parts = 1;
  int64_t index = 0;
  int64_t blocks = 1;
  // This rank's shard of `full`.
  at::Tensor Slice(const at::Tensor& full) const;
  // The full tensor from every rank's shard, in rank order.
  at::Tensor Unslice(const std::vector<at::Tensor>& shards) const;
  // The shard's shape for a full shape (errors when a size does not divide).
  absl::StatusOr<std::vector<int64_t>> ShardShape(const std::vector<int64_t>& full) const;
};

// A LoRA adapter of a linear layer: y += scale * dropout(x) A^T B^T, with A
// [r, in] and B [out, r] sliced as the layer's weight is. Column-parallel
// layers keep A whole and their rows of B: the rank-r product x A^T enters
// the layer's region as its input does (copied, or gathered from sequence
// shards), so its gradient is summed there. Row-parallel layers keep their
// columns of A and B whole: x A^T is partial and reduced the way the layer's
// output is (all-reduced, or reduce-scattered into sequence shards). Each
// adds one collective of [tokens, r] (r / out of the layer's own); under
// sequence parallelism the replicated factor's gradient is partial, as the
// norms' are, and summed with them.
struct LowRankAdapter {
  at::Tensor a, b;  // undefined: no adapter
  double scale = 1.0;
  double dropout = 0.0;
  bool defined() const { return a.defined(); }
};

// Output features split over the group. Input: full (replicated) activations,
// or with sequence parallelism sequence shards [B, T / size, C] that are
// gathered first. Output: this rank's features, or all of them with
// `gather_output`.
class ColumnParallelLinearImpl : public torch::nn::Module {
 public:
  ColumnParallelLinearImpl(const TensorParallelism& tp, int64_t in_features, int64_t out_features, bool bias = true,
                           bool gather_output = false, int64_t blocks = 1);
  at::Tensor forward(const at::Tensor& x);
  // This rank's output without the bias (Megatron's skip_bias_add), for a
  // caller that adds it fused with what follows (fused_bias_gelu).
  at::Tensor ForwardSkipBias(const at::Tensor& x);
  // The product of an input already inside the region (RunSubPipelinedBlock:
  // replicated, its gradient summed by the caller), with the bias or not.
  // Without an adapter.
  at::Tensor ForwardInRegion(const at::Tensor& x, bool add_bias = true);
  // How weight (and bias) shard the full parameter.
  ShardSpec weight_shard() const { return {0, tp_.size, tp_.rank, blocks_}; }
  at::Tensor weight, bias;
  LowRankAdapter adapter;

 private:
  // The product on this rank's columns with bias `b` (may be undefined) and the adapter's output.
  at::Tensor LocalProduct(const at::Tensor& x, const at::Tensor& b);
  TensorParallelism tp_;
  bool gather_output_;
  int64_t blocks_;
};
TORCH_MODULE(ColumnParallelLinear);

// Input features split over the group. Input: this rank's features (the
// output of a ColumnParallelLinear), or full features sliced here unless
// `input_is_parallel`. Output: summed over the group, replicated, or with
// sequence parallelism reduce-scattered into sequence shards. The bias is
// replicated and added after the reduction.
class RowParallelLinearImpl : public torch::nn::Module {
 public:
  RowParallelLinearImpl(const TensorParallelism& tp, int64_t in_features, int64_t out_features, bool bias = true,
                        bool input_is_parallel = true);
  at::Tensor forward(const at::Tensor& x);
  // This rank's product, neither summed over the group nor with the bias
  // (RunSubPipelinedBlock's partial output). Without an adapter.
  at::Tensor PartialForward(const at::Tensor& x);
  ShardSpec weight_shard() const { return {1, tp_.size, tp_.rank, 1}; }
  at::Tensor weight, bias;
  LowRankAdapter adapter;

 private:
  TensorParallelism tp_;
  bool input_is_parallel_;
};
TORCH_MODULE(RowParallelLinear);

// Vocabulary rows split over the group: rank r holds rows [r V / size,
// (r + 1) V / size). Looks up ids anywhere in the vocabulary; the result is
// summed over the group (replicated), or with sequence parallelism
// reduce-scattered into sequence shards.
class VocabParallelEmbeddingImpl : public torch::nn::Module {
 public:
  VocabParallelEmbeddingImpl(const TensorParallelism& tp, int64_t vocab_size, int64_t dim);
  at::Tensor forward(const at::Tensor& ids);
  // The partial lookup before the reduction (zero rows for ids held elsewhere).
  at::Tensor LocalLookup(const at::Tensor& ids);
  ShardSpec weight_shard() const { return {0, tp_.size, tp_.rank, 1}; }
  at::Tensor weight;

 private:
  TensorParallelism tp_;
  int64_t vocab_start_, vocab_end_;
};
TORCH_MODULE(VocabParallelEmbedding);

// Gives `linear` (a ColumnParallelLinear, RowParallelLinear or ParallelLinear,
// sharded or not) the LoRA adapter `name` of rank r: parameters
// "lora_A.<name>.weight" (from `full_a`, the [r, in] matrix of the whole
// layer, of which this rank keeps its slice) and "lora_B.<name>.weight"
// (zeros), replacing an adapter it had. Returns the specs of the adapter
// parameters split over the group, by their names relative to `linear`.
// Errors when `linear` is another kind of module or `full_a` does not fit.
absl::StatusOr<std::map<std::string, ShardSpec>> AddLowRankAdapter(torch::nn::Module& linear, const std::string& name,
                                                                   const at::Tensor& full_a, double scale,
                                                                   double dropout);
// The whole layer's [out, in] features of a linear module AddLowRankAdapter
// takes (nullopt for any other module).
std::optional<std::pair<int64_t, int64_t>> LinearFeatures(const torch::nn::Module& module);

// Sums the gradients of `parameters` over the tensor-parallel group in one
// message (sequence-parallel norms and biases, whose gradients each rank holds
// for its sequence shard only).
absl::Status SequenceParallelGradients(const std::vector<at::Tensor>& parameters, const std::string& group);

// A user model opts into tensor parallelism by building its linear layers as
// ParallelLinear and naming them, in the spirit of the reference design's
// set_tp_layer_lists:
//   column     ParallelLinear modules (by full module name, or a name suffix
//              after '.') made column-parallel (output features split)
//   row        those made row-parallel (input features split; output summed)
//   attributes integer buffers (registered with register_buffer, by full name
//              or suffix) divided by the group size, such as a head count
struct TensorParallelLayers {
  std::vector<std::string> column;
  std::vector<std::string> row;
  std::vector<std::string> attributes;
};

// A linear layer that is plain until ApplyTensorParallel makes it column- or
// row-parallel, keeping its slice of the weights it was built with.
class ParallelLinearImpl : public torch::nn::Module {
 public:
  ParallelLinearImpl(int64_t in_features, int64_t out_features, bool bias = true);
  at::Tensor forward(const at::Tensor& x);
  enum class Mode { kPlain, kColumn, kRow };
  Mode mode() const { return mode_; }
  // How weight shards the full parameter (whole in plain mode).
  ShardSpec weight_shard() const;
  at::Tensor weight, bias;
  LowRankAdapter adapter;

 private:
  friend absl::Status ApplyTensorParallel(torch::nn::Module& model, const TensorParallelLayers& layers,
                                          const TensorParallelism& tp);
  Mode mode_ = Mode::kPlain;
  TensorParallelism tp_;
};
TORCH_MODULE(ParallelLinear);

// Shards `model` (built whole, with the weights the single-process model has)
// in place: every ParallelLinear named in `layers` keeps its slice, every
// attribute buffer named is divided by tp.size. Errors name a layer that is
// not found or not a ParallelLinear, and a dimension that does not divide.
absl::Status ApplyTensorParallel(torch::nn::Module& model, const TensorParallelLayers& layers,
                                 const TensorParallelism& tp);

// Automatic tensor parallelism of a traced model (no layer names needed).
//
// Sharding propagation over the traced graph: a linear product whose
// parameters no other operator reads becomes column-parallel where its input
// is replicated (its output split along the features: by heads after a view,
// each piece split when a fused q, k, v projection is taken apart), and
// row-parallel where its input is split along its features (its output
// all-reduced, the bias added after). Embeddings split their vocabulary (a
// head tied to one splits the same rows), and the cross-entropy of logits
// split along the vocabulary becomes the vocabulary-parallel cross-entropy.
// Element-wise operators, views,
// transposes, splits, batched products and softmax keep a split; sizes the
// split changes (a head count in a view) are rewritten. A column product
// whose split would reach an operator the pass cannot split (a norm over the
// features, the loss, the model's outputs) stays whole, and the report says
// why. With sequence parallelism the activations between the split products
// are split along the sequence: gathered before column products,
// reduce-scattered after row products and vocabulary-parallel embeddings,
// replicated operands (a position embedding) narrowed to the rank's shard;
// an embedding kept whole looks up the rank's shard of the ids, a replicated
// input enters at its first column product as the rank's shard, and the
// cross-entropy of sequence-shard logits (a whole head) is each shard's,
// summed over the group.
// Each shard is the slice (ShardSpec) of the single-process parameter.
//
//   auto graph = ModelGraph::Trace(...);                        // the whole model
//   auto tp_graph = AutoTensorParallel(**graph, {2, rank, "tp"});
//   std::cout << tp_graph->plan.Report();
//   auto part = ModelGraph::Trace(tp_graph->parameters, inputs, tp_graph->forward);
struct ParameterLayout {
  // kVocabulary: an embedding's rows (a head tied to it is column-parallel
  // over the same rows).
  enum class Role { kReplicated, kColumn, kRow, kVocabulary };
  std::string name;
  Role role = Role::kReplicated;
  ShardSpec shard;  // column and row parameters: this rank's slice
  std::string why;  // matrices kept whole: why
};

struct AutoTensorParallelPlan {
  std::vector<ParameterLayout> parameters;  // in the graph's order
  std::vector<std::string> collectives;     // the operators inserted, in order
  // Bytes this rank sends per micro-batch (forward and backward) through them.
  int64_t bytes_per_micro_batch = 0;
  // A table: parameter, layout, slice or why it stays whole; the collectives.
  std::string Report() const;
};

// A traced model rewritten for one rank of its tensor-parallel group.
struct TensorParallelGraph {
  AutoTensorParallelPlan plan;
  // This rank's parameters (slices of the split ones, leaves that require
  // gradients as the originals do; the replicated ones themselves), in the
  // graph's order, and the split ones' specifications.
  std::vector<std::pair<std::string, at::Tensor>> parameters;
  std::map<std::string, ShardSpec> shards;
  // Runs the rewritten graph on the model's inputs with `parameters`; trace
  // it (ModelGraph::Trace) for this rank's graph.
  std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)> forward;
};

struct AutoTensorParallelOptions {
  // Keep only the model's loss (its first scalar floating-point output):
  // other outputs (logits returned beside the loss) would hold the head's
  // split output, which training does not read.
  bool loss_only = false;
  // The cost model: a region of split products (an MLP; an attention block)
  // stays whole when its collectives (latency each, plus bytes at
  // bytes_per_second) take longer than the compute its split saves
  // (forward and backward at flops_per_second). flops_per_second 0: split
  // every product the pass can.
  double flops_per_second = 0;
  double bytes_per_second = 1e9;
  double collective_latency_s = 100e-6;
  TensorParallelLayerLists layers;
};

// Errors where a split dimension does not divide tp (naming the operator and
// the size), and where no product can be split at all.
absl::StatusOr<TensorParallelGraph> AutoTensorParallel(const ModelGraph& graph, const TensorParallelism& tp,
                                                       const AutoTensorParallelOptions& options = {});

}  // namespace trident

#endif  // TRIDENT_TENSOR_PARALLEL_TENSOR_PARALLEL_H_
