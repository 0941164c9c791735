// zero: ZeRO-sharded optimizer states (stage 1), gradients (stage 2) and
// parameters (stage 3) across a data-parallel group, around any element-wise
// torch::optim optimizer.
//
// Parameters are packed, in reverse order (roughly the order backward produces
// their gradients), into buckets of at most `reduce_bucket_bytes`; each bucket
// is one flat buffer the parameters become views of, padded to a multiple of
// the group size. Rank r owns chunk r of every bucket: its optimizer holds
// state for those chunks only, its gradients are reduce-scattered into them,
// and after the update every bucket is all-gathered back: given the model's
// layers (ZeroOptions::layers), Step only starts those all-gathers, first
// the columns the first layers read, and each finishes just before the next
// forward reaches a layer that reads it (or at WaitForUpdatedParameters), so
// the updated values travel while the step ends and the next one begins.
//
//   stage 1  gradients accumulate whole (as in plain data parallelism) and are
//            reduce-scattered into the chunks after the last backward
//   stage 2  each gradient is moved into its bucket as soon as backward makes
//            it; a complete bucket is reduce-scattered at once and only this
//            rank's chunk is kept (parameters named `keep_full_gradient`, such
//            as pipeline-tied embeddings that are summed between stages first,
//            follow stage 1)
//   stage 3  buckets are a layer's parameters (in buckets of at most
//            gather_bucket_bytes), and at rest each rank holds only its
//            chunks: a layer's buckets are all-gathered just before it runs
//            and released after; in backward each is gathered again just
//            before the first node reading it runs (or when backward reaches
//            the layer, where the forward could not find those nodes) and
//            released as soon as its gradients have all arrived (two layers
//            later where one got none); the next layer's all-gathers (in
//            backward, the next bucket's) start early (prefetch). Gradients
//            as in stage 2, no all-gather after the update. A released bucket
//            frees the memory
//            inside its buffer's storage, so the views autograd saves of a
//            layer's weights (a transposed matrix) hold none either until
//            backward gathers the layer again (a view that leaves the layer,
//            passed on to the next, keeps its memory: the bucket takes a new
//            storage instead). Each rank copies its chunks straight from the
//            parameters it is given, freeing them bucket by bucket; a model
//            built with deferred values (LayerSequence::MaterializeLayer) draws
//            each layer's values just before, so no rank holds the whole model.
//
//   auto zero = ZeroOptimizer::Create({decayed, not_decayed}, &dp, options,
//       [](const std::vector<std::vector<at::Tensor>>& shards) { ...AdamW over them... });
//   zero->ZeroGrad(); zero->PrepareForBackward(true); loss.backward();
//   zero->FinishBackward(); zero->Step(lr);
#ifndef TRIDENT_ZERO_ZERO_H_
#define TRIDENT_ZERO_ZERO_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include "absl/status/statusor.h"
#include "base/gradient_hooks.h"
#include "base/tensors.h"
#include "graph/graph.h"
#include "topology/topology.h"
#include "zero/zero.pb.h"

namespace trident {

struct ZeroOptions {
  // The stage (1, 2 or 3), bucket sizes, untested optimizers and the
  // gradient predivide factor, as the plan gives them.
  ZeroSpec spec;
  // The collectives of FinishBackward and Step move at most this many
  // elements per message: Gloo stages a message whole, so a whole-model
  // message (the default bucket sizes) would cost the model's size again in
  // temporaries. A stage-2/3 bucket of more than 4 times this is reduced as
  // soon as it is complete, in such slices, rather than in flight (where its
  // reduction holds a second copy of its whole gradient).
  int64_t max_message_elements = int64_t{1} << 22;
  // Parameters whose gradients stay whole until FinishBackward (stage 2).
  std::function<bool(const at::Tensor&)> keep_full_gradient;
  // Parameters counted in the gradient norm (false: replicas counted elsewhere).
  std::function<bool(const at::Tensor&)> counted_in_norm;
  // The model and the layers of it this rank holds (in order), whose
  // parameters are gathered as they run: stage 3's before each layer, and
  // stages 1 and 2's after Step (as above). Without them (stages 1 and 2)
  // Step gathers every bucket before it returns.
  LayerSequence* layers = nullptr;
  std::vector<int64_t> layer_indices;
  // Hybrid sharding (spec.shard_group_size): the ranks holding the same
  // chunks as this one, whose chunk gradients are summed after the
  // reduce-scatter (nullptr or one rank: none).
  const ProcessGroup* replicas = nullptr;
  // This rank's place in the job, naming its offload file.
  int rank = 0;
};

// The ranks each shard group of `spec` has under `data_parallel_size` ranks
// (shard_group_size, or dp / num_shard_groups, or all of them); errors when
// the two disagree or do not divide the data-parallel ranks.
absl::StatusOr<int> ZeroShardGroupSize(const ZeroSpec& spec, int data_parallel_size);
// Whether `spec.ignored` keeps the parameter `name` whole (a name given, or a
// module name prefix of it).
bool ZeroKeepsWhole(const ZeroSpec& spec, const std::string& name);

namespace zero_internal {
class OffloadedTensors;
}  // namespace zero_internal

// The sequential bandwidth of the disk under `dir` as offload sees it:
// `bytes` written and synced, then read back with the page cache dropped (so
// the disk, not memory, is timed). The strategy's time model prices offload
// with it.
struct DiskBandwidth {
  double write_bytes_per_second = 0, read_bytes_per_second = 0;
};
absl::StatusOr<DiskBandwidth> MeasureOffloadBandwidth(const std::string& dir, int64_t bytes = int64_t{64} << 20);

// Builds an optimizer over lists of parameters, one list per parameter group
// (by convention [0] the parameters weight decay applies to, the matrices,
// and [1] the others): one torch::optim param group each. ZeRO calls it with
// this rank's chunks, plain data parallelism with the parameters themselves.
using OptimizerFactory =
    std::function<std::unique_ptr<torch::optim::Optimizer>(const std::vector<std::vector<at::Tensor>>& groups)>;

// Per-rank bytes held for training.
struct MemoryReport {
  int64_t parameter_bytes = 0;
  int64_t gradient_bytes = 0;
  int64_t optimizer_bytes = 0;
  // offload_optimizer=disk and offload_params=disk: the state and the
  // parameter chunks in their files (not counted above), and the bytes
  // written to and read from both files so far.
  int64_t offloaded_optimizer_bytes = 0;
  int64_t offloaded_parameter_bytes = 0;
  int64_t offload_bytes_written = 0, offload_bytes_read = 0;
  // Stages 2 and 3, the working set at its largest so far: gathered
  // parameters (stage 3's buffers) and whole gradients held while their
  // buckets fill or are reduce-scattered, at the same moment.
  int64_t peak_gathered_bytes = 0, peak_gradients_in_flight_bytes = 0;
  // Of gradient_bytes, the one bucket's whole gradient counted for a bucket
  // that fills (part of what is in flight).
  int64_t gradient_scratch_bytes = 0;
  int64_t total() const { return parameter_bytes + gradient_bytes + optimizer_bytes; }
  std::string ToString() const;
};

// ZeRO's bucket layout from parameter sizes alone: ZeroOptimizer builds its
// buckets from it, and the strategy's memory model predicts a rank's bytes
// with the same function.
struct ZeroParameter {
  int64_t numel = 0;
  int64_t element_size = 4;
  int group = 0;           // the optimizer param group it belongs to
  bool keep_full = false;  // its gradient stays whole until FinishBackward
};
struct ZeroBucket {
  std::vector<int> parameters;  // indices into the planned parameters, in bucket order
  int group = 0;
  bool keep_full = false;
  bool sharded = false;  // stage 3: only this rank's chunk exists at rest
  int64_t numel = 0;     // padded to a multiple of the group size
  int64_t element_size = 4;
};
struct ZeroLayout {
  std::vector<ZeroBucket> buckets;
  std::map<int64_t, std::vector<int>> layer_buckets;  // stage 3: the buckets each layer reads
};
// Stages 1 and 2: each group's parameters, in reverse order, in buckets of at
// most `bucket_bytes` of one gradient kind. Stage 3: a layer's parameters
// (each in the first of `layer_reads` that reads it; `layer_reads` lists the
// layers in order, each with the parameters it reads), by group and kind, in
// reverse order in buckets of at most `bucket_bytes`. Stage 1 keeps every
// gradient whole. ZeroBucketBytes gives `bucket_bytes` for a spec.
int64_t ZeroBucketBytes(const ZeroSpec& spec);
absl::StatusOr<ZeroLayout> PlanZeroBuckets(const std::vector<ZeroParameter>& parameters, int stage,
                                           int64_t bucket_bytes, int group_size,
                                           const std::vector<std::pair<int64_t, std::vector<int>>>& layer_reads);
// Stage 3's gather units (ZeroSpec's wrap and min_num_params) over
// `layer_reads` (as PlanZeroBuckets takes them, in order); `names` and
// `numels` describe the parameters by index. `layers` lists each unit's
// layers in order; `reads` each unit's parameters under its first layer (what
// PlanZeroBuckets takes to make a unit's buckets). A layer without parameters
// joins the unit before it.
struct ZeroGatherUnits {
  std::vector<std::vector<int64_t>> layers;
  std::vector<std::pair<int64_t, std::vector<int>>> reads;
};
ZeroGatherUnits PlanGatherUnits(const ZeroSpec& spec,
                                const std::vector<std::pair<int64_t, std::vector<int>>>& layer_reads,
                                const std::vector<std::string>& names, const std::vector<int64_t>& numels);
// Stage 3's units gathered ahead of the one running: prefetch_layers, at
// most 1 under limit_all_gathers.
int ZeroPrefetchDepth(const ZeroSpec& spec);
// A rank's parameter, gradient and optimizer bytes under `layout` before the
// first step, `state_per_element` state values per parameter value (Adam: 2).
MemoryReport ZeroLayoutMemory(const ZeroLayout& layout, int group_size, int state_per_element);

// Bytes of the state tensors `optimizer` holds (Adam, AdamW and SGD state;
// before the first step, their state per element times `parameter_bytes`).
int64_t OptimizerStateBytes(const torch::optim::Optimizer& optimizer, int64_t parameter_bytes);

// An optimizer's own serialisation as one byte tensor called `name` (so any
// optimizer restores exactly), and its restoration from `state`.
NamedTensors SerializeOptimizer(const torch::optim::Optimizer& optimizer, const std::string& name);
absl::Status DeserializeOptimizer(const NamedTensors& state, const std::string& name,
                                  torch::optim::Optimizer& optimizer);

// The key LibTorch's optimizers file a parameter's state under: the address
// of its TensorImpl, printed (LibTorch 1.x) or as it is (2.x).
template <typename Key>
Key OptimizerStateKey(c10::TensorImpl* impl) {
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream printed;
    printed << impl;
    return printed.str();
  } else {
    return impl;
  }
}

// The state Adam, AdamW and SGD keep per parameter, by name: tensors shaped
// like the parameter ("exp_avg", "exp_avg_sq", "max_exp_avg_sq",
// "momentum_buffer") and the step count ("step", a 0-d int64 tensor).
// ElementwiseStateNames lists the names `optimizer` keeps (Unimplemented for
// other optimizers); ElementwiseState returns `param`'s (empty before its
// first update); SetElementwiseState replaces it.
absl::StatusOr<std::vector<std::string>> ElementwiseStateNames(const torch::optim::Optimizer& optimizer);
std::map<std::string, at::Tensor> ElementwiseState(const torch::optim::Optimizer& optimizer, const at::Tensor& param);
absl::Status SetElementwiseState(torch::optim::Optimizer& optimizer, const at::Tensor& param,
                                 const std::map<std::string, at::Tensor>& state);

// The elements of a parameter a rank's optimizer updates: elements [begin,
// end) of the row-major flattening of `parameter` (of shape `shape`) are
// elements [offset, offset + end - begin) of `updated`, the tensor the
// optimizer holds state for (the parameter itself, whole, under plain data
// parallelism; a ZeRO chunk). `only_chunk`: at rest the parameter exists
// only as this part (ZeRO stage 3); otherwise it is whole on this rank.
// `values` holds `updated`'s values to read or overwrite: `updated` itself, or
// with offload_params=disk its file, mapped (writes reach the file).
struct ParameterPart {
  at::Tensor parameter;
  std::vector<int64_t> shape;
  int64_t begin = 0, end = 0;
  at::Tensor updated;
  int64_t offset = 0;
  bool only_chunk = false;
  at::Tensor values;
};

class ZeroOptimizer : private LayerObserver {
 public:
  // `groups` partition the parameters (for example decayed / not decayed);
  // `data_parallel` is the group the state is sharded over.
  static absl::StatusOr<std::unique_ptr<ZeroOptimizer>> Create(std::vector<std::vector<at::Tensor>> groups,
                                                               const ProcessGroup* data_parallel, ZeroOptions options,
                                                               const OptimizerFactory& make_optimizer);
  ~ZeroOptimizer();

  void ZeroGrad();
  // Call before each backward (stage 2 moves gradients during every backward).
  void PrepareForBackward(bool last_micro_batch);
  // After the last backward of a step: every rank's chunk holds the gradient
  // averaged over the group.
  absl::Status FinishBackward();
  // Squared L2 norm of the counted gradients in this rank's chunks: a
  // one-element fp64 tensor where they lie, not read (a GPU keeps working).
  at::Tensor LocalSquaredGradNorm() const;
  // Sums the chunks' gradients of `parameters` over `group` (another group with
  // the same bucket layout on every rank, such as the tensor-parallel ranks for
  // sequence-parallel norms, whose gradients each rank holds in part).
  absl::Status SumGradientsOver(const ProcessGroup& group, const std::vector<at::Tensor>& parameters);
  // Multiplies the chunks' gradients (clipping, loss-scale removal).
  void ScaleGradients(double factor);
  // The same by a one-element tensor, not read on the host (MultiplyWithoutReading).
  void ScaleGradients(const at::Tensor& factor);
  // Whether any chunk gradient is inf or NaN on this rank.
  bool LocalGradientsNonFinite() const;
  // Updates this rank's chunks with learning rate `lr`, then all-gathers them
  // (stages 1 and 2; given the layers, only starts to: see the top). The
  // chunks' gradients go (stage 1's whole ones stay until ZeroGrad).
  absl::Status Step(double lr);
  // Stages 1 and 2: finishes the all-gathers Step left under way, so every
  // parameter holds its updated value: before reading or writing parameters
  // other than through the layers. Waits only (no rank need call it with
  // another); a failure is also returned by the next FinishBackward or Step.
  // offload_params=disk: the chunks read ahead go back to their file only.
  absl::Status WaitForUpdatedParameters();
  // How many of those all-gathers are not finished yet.
  size_t GathersUnderWay() const;
  // Stages 2 and 3: the reduce-scatters backward issued that are not yet
  // added to their chunks' gradients (each holds a bucket's whole gradient).
  size_t ReduceScattersUnderWay() const { return reducing_.size(); }
  // Stage 3: gives every parameter its full value (to save, load or export),
  // and back to the chunks; `keep_changes` first copies the (possibly
  // overwritten) full values into the chunks. Stages 1 and 2: the first is
  // WaitForUpdatedParameters, the second a no-op.
  absl::Status GatherAllParameters();
  absl::Status ReleaseAllParameters(bool keep_changes);

  // Bytes of parameters, gradients and optimizer state on this rank (the state
  // as the optimizer holds it after its first step, estimated before).
  MemoryReport Memory() const;
  // This rank's chunk of each parameter (only_chunk: stage 3's sharded
  // buckets, whose every parameter is listed, with begin == end where this
  // rank's chunk holds none of it). Call WaitForUpdatedParameters first.
  absl::StatusOr<std::vector<ParameterPart>> ChunkParts() const;
  torch::optim::Optimizer& optimizer() { return *optimizer_; }
  // The element-wise state (ElementwiseState) the optimizer keeps for `chunk`
  // (a ParameterPart's `updated`); with offload_optimizer=disk mapped
  // read-only from the file while the tensors live. SetChunkState replaces it
  // (and puts it back in the file).
  absl::StatusOr<std::map<std::string, at::Tensor>> ChunkState(const at::Tensor& chunk) const;
  absl::Status SetChunkState(const at::Tensor& chunk, const std::map<std::string, at::Tensor>& state);
  // The optimizer's state for this rank's chunks, and its restoration (the same
  // layout must load it).
  NamedTensors State() const;
  absl::Status LoadState(const NamedTensors& state);

 private:
  struct Bucket;
  struct Gathering;
  ZeroOptimizer() = default;
  void OnGradientReady(int bucket, int slot);  // slot: the parameter's place in the bucket
  // Starts reducing `full` (a bucket's whole gradient) into the bucket's
  // chunk, after finishing the reduction still under way; FinishReduceScatter
  // waits for it and adds it to chunk_grad.
  absl::Status StartReduceScatter(Bucket& bucket, const at::Tensor& full);
  absl::Status FinishReduceScatter(Bucket& bucket);
  // Reduces `full` into the bucket's chunk gradient now, a slice at a time
  // (added; a keep_full bucket's chunk gradient is its part of `full`, replaced).
  absl::Status ReduceScatterInSlices(Bucket& bucket, const at::Tensor& full);
  // The bucket's chunk gradient, made at its first use in a step: `first`
  // itself when given, else zeros.
  at::Tensor& ChunkGrad(Bucket& bucket, const at::Tensor& first = at::Tensor());
  // offload_params=disk: whether bucket b's chunk lives in the params file at
  // rest; starts reading it (where it has no memory); reads it and waits;
  // frees its memory (the file holds the same values).
  bool ChunkOffloaded(int b) const;
  void StartChunkRead(int b);
  absl::Status ReadChunk(int b);
  void DropChunk(int b);
  // Frees the chunks read ahead and not gathered (their all-gathers finished).
  absl::Status SettleOffloadedChunks();
  // Updates the working set's peaks (MemoryReport) from the buffers held now.
  void NoteWorkingSet();
  // Stage 3: reference-counted gathering and releasing of a bucket.
  absl::Status Gather(Bucket& bucket);
  void Release(Bucket& bucket);
  // Stage 3: the unit (its first layer) of `layer` (a layer in none: its
  // own), and the last layer of `unit`.
  int64_t UnitOf(int64_t layer) const;
  int64_t UnitLast(int64_t unit) const;
  void GatherLayer(int64_t layer);
  // Starts the all-gathers of a unit's buckets (`layer` its first; those
  // without reader hooks only), of one bucket.
  void Prefetch(int64_t layer, bool unhooked_only);
  void PrefetchBucket(int b);
  // offload_params=disk: starts reading `layer`'s chunks (the layer after
  // those prefetched), so the disk works while this layer computes.
  void ReadAhead(int64_t layer);
  void BeforeLayer(int64_t layer) override;
  void AfterLayer(int64_t layer, const Values& inputs, const Values& outputs) override;
  // Stage 3 in backward (zero_backward.cc). A unit's buckets are gathered
  // when backward reaches its last layer, except those whose reading nodes
  // the forward found (HookBackwardReaders): each of those is gathered just
  // before the first of its readers runs (GatherForReaders), and the next
  // one gathered that way in the last backward is prefetched. A bucket held
  // for backward is released once its gradients have all arrived
  // (ReleaseAfterBackward), or two units below, or at FinishBackward.
  void BackwardReached(int64_t layer);
  void HookBackwardReaders(int64_t layer, const Values& outputs);
  void GatherForReaders(const std::vector<int>& buckets);
  // Prefetches up to `count` buckets after `bucket` in the order readers
  // gathered them in the last backward.
  void PrefetchAlongBackward(int bucket, int count);
  void HoldForBackward(Bucket& bucket);
  // Adds the reduce-scatters issued in backward that have finished (oldest
  // first, up to the first still under way) to their chunks' gradients.
  absl::Status FinishCompletedReduceScatters();
  // Waits for the oldest reduce-scatters issued in backward until at most
  // `most` travel.
  absl::Status LimitReduceScatters(int most);
  void ReleaseAfterBackward(Bucket& bucket);
  // Step's all-gathers: planned once (the layers' (bucket, parameter index)
  // reads give their order), started by Step, finished oldest first.
  void PlanGathers(const std::vector<std::pair<int64_t, std::vector<std::pair<int, int>>>>& layer_slots);
  int64_t MostGatheredColumns(const Bucket& bucket) const;  // of each rank's chunk, in one message
  absl::Status StartGathers();
  absl::Status FinishOldestGather();
  // Hybrid sharding: sums `grad` (a chunk gradient) over the replicas.
  absl::Status SumOverReplicas(at::Tensor grad) const;
  // The optimizer step, a bucket at a time with its state and its chunk read
  // from and written back to their offload files.
  absl::Status OffloadedStep();
  int BucketOfChunk(const at::Tensor& chunk) const;  // -1: none
  // The state tensors of a bucket's chunk that offload moves (not the step).
  std::vector<at::Tensor> OffloadedStateOf(int bucket) const;

  const ProcessGroup* group_ = nullptr;
  ZeroOptions options_;
  std::vector<Bucket> buckets_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  GradientAccumulatedHooks hooks_;  // stage 2 and 3: gradients move into buckets
  // Stage 3: layout_.layer_buckets are the buckets each gather unit reads,
  // under the unit's first layer; unit_of_ maps every layer to that first
  // layer, unit_last_ each unit to its last layer.
  ZeroLayout layout_;
  std::map<int64_t, int64_t> unit_of_, unit_last_;
  // Stage 3: each sharded parameter's grad accumulator -> (bucket, slot);
  // the first sequence number of the nodes the running layer's forward
  // makes; the bucket a reader gathered last in this backward (-1: none yet).
  std::unordered_map<const torch::autograd::Node*, std::pair<int, int>> slot_of_accumulator_;
  uint64_t layer_first_node_ = 0;
  int last_reader_gather_ = -1;
  int64_t peak_gathered_bytes_ = 0, peak_gradients_in_flight_bytes_ = 0;
  bool last_micro_batch_ = false;
  absl::Status first_error_;
  // Buckets whose reduce-scatter was issued from the gradient hook, oldest
  // first: at most spec.max_inflight_reduce_scatters travel at once, since
  // each holds its bucket's whole gradient.
  std::deque<int> reducing_;
  // offload_optimizer=disk and offload_params=disk: slot b is bucket b's.
  std::unique_ptr<zero_internal::OffloadedTensors> offloaded_state_, offloaded_params_;
  // Step's all-gathers: the planned messages, how many of them each layer
  // needs finished before it runs (none without the layers: Step finishes
  // them), and those the last Step started, of which the first `gathered_`
  // are finished.
  std::vector<Gathering> gather_plan_;
  std::map<int64_t, size_t> gathers_before_layer_;
  std::vector<Gathering> gathering_;
  size_t gathered_ = 0;
};

}  // namespace trident

#endif  // TRIDENT_ZERO_ZERO_H_
