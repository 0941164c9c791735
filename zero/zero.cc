#include "zero/zero.h"

#include <algorithm>
#include <optional>
#include <unordered_set>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "absl/strings/str_cat.h"
#include "base/host_copy.h"
#include "base/status.h"

namespace trident {
namespace {

int64_t Bytes(const at::Tensor& t) { return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0; }

// Columns [offset, offset + length) of a bucket seen as [group size, chunk]:
// element offset.. of every rank's chunk.
struct ChunkColumns {
  int64_t offset = 0, length = 0;
};

// A chunk of `chunk` elements in column ranges of at most `most` elements.
std::vector<ChunkColumns> SplitChunk(int64_t chunk, int64_t most) {
  std::vector<ChunkColumns> columns;
  for (int64_t offset = 0; offset < chunk; offset += most) {
    columns.push_back({offset, std::min(most, chunk - offset)});
  }
  return columns;
}

}  // namespace

struct ZeroOptimizer::Bucket {
  std::vector<at::Tensor> params;
  std::vector<int64_t> offsets;
  int64_t numel = 0;       // padded to a multiple of the group size
  bool keep_full = false;  // gradients accumulate whole until FinishBackward
  at::Tensor buffer;       // the parameters' values, flat
  at::Tensor chunk;        // this rank's chunk of `buffer`: what the optimizer updates
  // The averaged gradient of `chunk`: from the first reduction of a step to
  // ZeroGrad (a keep_full bucket's is its part of full_grad, always there).
  at::Tensor chunk_grad;
  at::Tensor full_grad;  // whole gradients (kept, or stage 2 while the bucket fills)
  // The chunk's elements [begin, end) that belong to parameters counted in the
  // gradient norm (ranges, not a mask: a mask would be as large as the chunk).
  std::vector<std::pair<int64_t, int64_t>> counted;
  // Stage 2 and 3: a round is complete when every parameter's gradient has
  // arrived (backward accumulates each once; a further arrival before the
  // round completes is summed into it too).
  int pending = 0;            // parameters whose gradient has not arrived in this round
  std::vector<bool> arrived;  // per parameter, in this round
  void StartRound() {
    pending = static_cast<int>(params.size());
    arrived.assign(params.size(), false);
  }
  bool gradients_arrived = false;  // every gradient of this backward has arrived
  // Stage 3: the parameters are released at rest (empty tensors, `buffer`'s
  // storage freed, `chunk` a tensor of its own), gathered while `holders` > 0.
  bool sharded = false;
  std::vector<std::vector<int64_t>> shapes;  // the parameters' shapes
  int holders = 0;
  // A tensor sharing `buffer`'s storage left the layer that gathered it (a
  // transposed weight passed to the next traced shard), or backward may reach
  // that layer unannounced: Release then leaves the storage to that tensor
  // and gives the bucket a new one.
  bool escaped = false;
  std::optional<PendingWork> prefetch;  // an all-gather into `buffer` under way
  // Stage 2 and 3: a reduce-scatter into `reduced` under way (issued from the
  // gradient hook, so backward goes on while the gradients travel).
  std::optional<PendingWork> reducing;
  at::Tensor reduced;
};

// One all-gather of Step's updated chunks: columns of one bucket (straight
// into its buffer) or of several (through `gathered`).
struct ZeroOptimizer::Gathering {
  struct Piece {
    int bucket;
    ChunkColumns columns;
  };
  std::vector<Piece> pieces;
  at::Tensor gathered;  // [group size, the pieces' columns], where there are several
  PendingWork work;
};

// Stage 3 frees a released bucket's memory inside its buffer's storage
// instead of dropping the buffer: views autograd saved of the gathered
// parameters (a transposed weight) share that storage, so they hold no memory
// while the bucket is released, and see the values again once Gather has
// refilled it, as it does before the layer's backward (BackwardReached).
void FreeStorage(const at::Tensor& buffer) {
  c10::StorageImpl* storage = buffer.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, buffer.device()));
  storage->set_nbytes(0);
}

// A buffer of `numel` elements whose storage holds no memory yet.
at::Tensor UnallocatedBuffer(int64_t numel, const at::TensorOptions& options) {
  at::Tensor buffer = at::empty({0}, options);
  buffer.unsafeGetTensorImpl()->set_sizes_contiguous({numel});
  return buffer;
}

bool HasStorage(const at::Tensor& buffer) { return buffer.storage().nbytes() > 0; }

void AllocateStorage(const at::Tensor& buffer) {
  if (HasStorage(buffer)) return;
  c10::StorageImpl* storage = buffer.storage().unsafeGetStorageImpl();
  const size_t bytes = buffer.numel() * buffer.element_size();
  storage->set_data_ptr_noswap(storage->allocator()->allocate(bytes));
  storage->set_nbytes(bytes);
}

absl::StatusOr<std::unique_ptr<ZeroOptimizer>> ZeroOptimizer::Create(std::vector<std::vector<at::Tensor>> groups,
                                                                     const ProcessGroup* data_parallel,
                                                                     ZeroOptions options,
                                                                     const OptimizerFactory& make_optimizer) {
  if (options.spec.stage() < 1 || options.spec.stage() > 3) {
    return absl::InvalidArgumentError(absl::StrCat("zero_stage=", options.spec.stage(),
                                                   " is not available; choose 1 (optimizer states), 2 "
                                                   "(and gradients) or 3 (and parameters)"));
  }
  if (options.spec.stage() == 3 && (options.layers == nullptr || options.layer_indices.empty())) {
    return absl::InvalidArgumentError("ZeRO stage 3 needs the model's layers (ZeroOptions::layers)");
  }
  if (data_parallel == nullptr) {
    return absl::InvalidArgumentError("ZeRO needs a data-parallel group: pass the topology's \"dp\" group");
  }
  std::unique_ptr<ZeroOptimizer> zero(new ZeroOptimizer());
  zero->group_ = data_parallel;
  zero->options_ = std::move(options);
  const ZeroOptions& o = zero->options_;
  const int64_t parts = data_parallel->size(), rank = data_parallel->rank();
  std::vector<std::vector<at::Tensor>> shards(groups.size());
  c10::NoGradGuard no_grad;
  auto keep_full = [&](const at::Tensor& p) {
    return o.spec.stage() == 1 || (o.keep_full_gradient && o.keep_full_gradient(p));
  };
  // The parameters by index (groups in order), and for stage 3 which each
  // layer reads; the bucket layout follows from their sizes alone.
  std::vector<at::Tensor> flat;
  std::vector<ZeroParameter> planned;
  std::unordered_map<const c10::TensorImpl*, int> index_of;
  for (size_t g = 0; g < groups.size(); ++g) {
    for (const at::Tensor& p : groups[g]) {
      index_of[p.unsafeGetTensorImpl()] = static_cast<int>(flat.size());
      flat.push_back(p);
      planned.push_back({p.numel(), static_cast<int64_t>(p.element_size()), static_cast<int>(g), keep_full(p)});
    }
  }
  std::vector<std::pair<int64_t, std::vector<int>>> layer_reads;
  if (o.layers != nullptr) {
    TRIDENT_RETURN_IF_ERROR(CatchExceptions("listing the layers' parameters", [&] {
      for (int64_t layer : o.layer_indices) {
        layer_reads.emplace_back(layer, std::vector<int>());
        for (const auto& [name, p] : o.layers->LayerParameters(layer)) {
          auto found = index_of.find(p.unsafeGetTensorImpl());
          if (found != index_of.end()) layer_reads.back().second.push_back(found->second);
        }
      }
    }));
  }
  TRIDENT_ASSIGN_OR_RETURN(ZeroLayout layout, PlanZeroBuckets(planned, o.spec.stage(), o.spec.reduce_bucket_bytes(),
                                                              static_cast<int>(parts), layer_reads));
  zero->layout_ = std::move(layout);
  std::vector<std::vector<at::Tensor>> members;
  std::vector<size_t> member_group;
  for (const ZeroBucket& planned_bucket : zero->layout_.buckets) {
    members.emplace_back();
    for (int i : planned_bucket.parameters) members.back().push_back(flat[i]);
    member_group.push_back(static_cast<size_t>(planned_bucket.group));
  }
  // Stage 2 and 3: each gradient moves into its bucket as soon as it is
  // accumulated. Adding the hook makes the parameter's grad accumulator,
  // which records its shape: before a stage-3 parameter is released.
  auto add_gradient_hooks = [&zero](int index) {
    Bucket& bucket = zero->buckets_[index];
    bucket.StartRound();
    if (bucket.keep_full) return;
    ZeroOptimizer* self = zero.get();
    for (size_t i = 0; i < bucket.params.size(); ++i) {
      const int slot = static_cast<int>(i);
      zero->hooks_.Add(bucket.params[i], [self, index, slot] {
        Bucket& bucket = self->buckets_[index];
        at::Tensor param = bucket.params[slot];
        if (!bucket.full_grad.defined()) bucket.full_grad = at::zeros({bucket.numel}, bucket.chunk.options());
        bucket.full_grad.narrow(0, bucket.offsets[slot], param.numel()).add_(param.grad().reshape({-1}));
        param.mutable_grad() = at::Tensor();  // the whole gradient is not kept
        self->OnGradientReady(index, slot);
      });
    }
  };
  // Stage 3: a part built with deferred values draws a layer's values just
  // before the first bucket it reads is sliced (and its parameters freed).
  std::map<int, int64_t> first_reader;
  for (const auto& [layer, buckets] : zero->layout_.layer_buckets) {
    for (int b : buckets) first_reader.emplace(b, layer);
  }
  for (size_t m = 0; m < members.size(); ++m) {
    if (o.spec.stage() == 3) {
      const int64_t layer = first_reader.at(static_cast<int>(m));
      TRIDENT_RETURN_IF_ERROR(
          CatchExceptions("drawing the parameters' values", [&] { o.layers->MaterializeLayer(layer); }));
    }
    Bucket bucket;
    bucket.params = members[m];
    bucket.keep_full = keep_full(bucket.params.front());
    bucket.sharded = o.spec.stage() == 3 && !bucket.keep_full;
    for (const at::Tensor& p : bucket.params) {
      bucket.offsets.push_back(bucket.numel);
      bucket.shapes.push_back(p.sizes().vec());
      bucket.numel += p.numel();
    }
    bucket.numel = (bucket.numel + parts - 1) / parts * parts;
    const int64_t chunk = bucket.numel / parts, chunk_begin = rank * chunk;
    const at::TensorOptions options = bucket.params.front().options();
    // Stage 3 copies this rank's chunk straight from the parameters: no whole
    // bucket is made, and each parameter is released once its bucket is built.
    bucket.buffer = bucket.sharded ? UnallocatedBuffer(bucket.numel, options) : at::zeros({bucket.numel}, options);
    bucket.chunk = bucket.sharded ? at::zeros({chunk}, options) : bucket.buffer.narrow(0, chunk_begin, chunk);
    for (size_t i = 0; i < bucket.params.size(); ++i) {
      at::Tensor param = bucket.params[i];
      // The part of the parameter inside this rank's chunk: [begin, end) of the bucket.
      const int64_t begin = std::max(bucket.offsets[i], chunk_begin);
      const int64_t end = std::min(bucket.offsets[i] + param.numel(), chunk_begin + chunk);
      if (!bucket.sharded) {
        at::Tensor slot = bucket.buffer.narrow(0, bucket.offsets[i], param.numel());
        slot.copy_(param.reshape({-1}));
        param.set_data(slot.view(param.sizes()));  // the parameter now lives in the bucket
      } else if (begin < end) {
        bucket.chunk.narrow(0, begin - chunk_begin, end - begin)
            .copy_(param.reshape({-1}).narrow(0, begin - bucket.offsets[i], end - begin));
      }
      if (begin < end && (!o.counted_in_norm || o.counted_in_norm(param))) {
        bucket.counted.emplace_back(begin - chunk_begin, end - chunk_begin);
      }
    }
    if (bucket.keep_full) {
      // The whole gradient stays, and the reduced chunk replaces this rank's
      // part of it (no second copy of the chunk).
      bucket.full_grad = at::zeros({bucket.numel}, options);
      bucket.chunk_grad = bucket.full_grad.narrow(0, chunk_begin, chunk);
      for (size_t i = 0; i < bucket.params.size(); ++i) {
        at::Tensor param = bucket.params[i];
        param.mutable_grad() = bucket.full_grad.narrow(0, bucket.offsets[i], param.numel()).view(param.sizes());
      }
      bucket.chunk.mutable_grad() = bucket.chunk_grad;
    }
    shards[member_group[m]].push_back(bucket.chunk);
    zero->buckets_.push_back(std::move(bucket));
    add_gradient_hooks(static_cast<int>(m));
    if (zero->buckets_.back().sharded) {  // released: the parameters' storage goes (Release)
      zero->buckets_.back().holders = 1;
      zero->Release(zero->buckets_.back());
    }
  }
  // Which (bucket, parameter) each layer reads, for Step's all-gathers.
  std::vector<std::pair<int, int>> slot_of(flat.size());
  for (size_t b = 0; b < zero->layout_.buckets.size(); ++b) {
    const std::vector<int>& in_bucket = zero->layout_.buckets[b].parameters;
    for (size_t k = 0; k < in_bucket.size(); ++k) slot_of[in_bucket[k]] = {static_cast<int>(b), static_cast<int>(k)};
  }
  std::vector<std::pair<int64_t, std::vector<std::pair<int, int>>>> layer_slots;
  for (const auto& [layer, reads] : layer_reads) {
    layer_slots.emplace_back(layer, std::vector<std::pair<int, int>>());
    for (int i : reads) layer_slots.back().second.push_back(slot_of[i]);
  }
  zero->PlanGathers(layer_slots);
  if (o.spec.stage() == 3 || !zero->gathers_before_layer_.empty()) o.layers->SetObserver(zero.get());
  TRIDENT_RETURN_IF_ERROR(
      CatchExceptions("building the sharded optimizer", [&] { zero->optimizer_ = make_optimizer(shards); }));
  if (!ElementwiseStateNames(*zero->optimizer_).ok() && !o.spec.allow_untested_optimizer()) {
    return absl::InvalidArgumentError(
        "ZeRO shards optimizer state element by element, which is known to be exact for Adam, "
        "AdamW and SGD only; this optimizer is untested: set zero_allow_untested_optimizer to "
        "use it anyway");
  }
  return zero;
}

// All-gathers still under way are not waited for (a peer may be gone): each
// holds the tensors it writes.
ZeroOptimizer::~ZeroOptimizer() {
  if (options_.spec.stage() == 3 || !gathers_before_layer_.empty()) options_.layers->SetObserver(nullptr);
}

absl::Status ZeroOptimizer::Gather(Bucket& bucket) {
  if (!bucket.sharded || bucket.holders++ > 0) return absl::OkStatus();
  if (!bucket.prefetch) {
    AllocateStorage(bucket.buffer);
    TRIDENT_ASSIGN_OR_RETURN(bucket.prefetch, group_->IAllGather(bucket.chunk, bucket.buffer));
  }
  absl::Status waited = bucket.prefetch->Wait();
  bucket.prefetch.reset();
  TRIDENT_RETURN_IF_ERROR(waited);
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < bucket.params.size(); ++i) {
    at::Tensor param = bucket.params[i];
    const int64_t n = c10::multiply_integers(bucket.shapes[i]);
    param.set_data(bucket.buffer.narrow(0, bucket.offsets[i], n).view(bucket.shapes[i]));
  }
  return absl::OkStatus();
}

void ZeroOptimizer::Release(Bucket& bucket) {
  if (!bucket.sharded || --bucket.holders > 0) return;
  c10::NoGradGuard no_grad;
  for (at::Tensor param : bucket.params) param.set_data(at::empty({0}, bucket.chunk.options()));
  if (bucket.escaped) {
    bucket.buffer = UnallocatedBuffer(bucket.numel, bucket.chunk.options());
    bucket.escaped = false;
  } else {
    FreeStorage(bucket.buffer);
  }
}

// Gathers a layer's buckets and starts the all-gathers of the next layer's.
void ZeroOptimizer::GatherLayer(int64_t layer) {
  for (int b : layout_.layer_buckets[layer]) {
    absl::Status status = Gather(buckets_[b]);  // thrown: the layer cannot run without it
    TORCH_CHECK(status.ok(), std::string(status.message()));
  }
}

void ZeroOptimizer::Prefetch(int64_t layer) {
  for (int b : layout_.layer_buckets[layer]) {
    Bucket& bucket = buckets_[b];
    if (!bucket.sharded || bucket.holders > 0 || bucket.prefetch) continue;
    AllocateStorage(bucket.buffer);
    auto started = group_->IAllGather(bucket.chunk, bucket.buffer);
    TORCH_CHECK(started.ok(), std::string(started.status().message()));
    bucket.prefetch = *std::move(started);
  }
}

void ZeroOptimizer::BeforeLayer(int64_t layer) {
  auto needed = gathers_before_layer_.find(layer);  // the updated values it reads, from the last Step
  while (needed != gathers_before_layer_.end() && gathered_ < std::min(needed->second, gathering_.size())) {
    absl::Status finished = FinishOldestGather();  // thrown: the layer cannot run without it
    TORCH_CHECK(finished.ok(), std::string(finished.message()));
  }
  if (options_.spec.stage() < 3) return;
  GatherLayer(layer);
  // The next layer's chunks travel while this one computes.
  auto next = layout_.layer_buckets.upper_bound(layer);
  if (next != layout_.layer_buckets.end()) Prefetch(next->first);
}

void ZeroOptimizer::AfterLayer(int64_t layer, const Values& inputs, const Values& outputs) {
  if (options_.spec.stage() < 3) return;
  bool announced = false;
  for (const at::Tensor& output : outputs) {
    if (!output.defined() || !output.requires_grad()) continue;
    // An output passed on unchanged from an earlier layer belongs to that layer.
    const bool passed_on =
        std::any_of(inputs.begin(), inputs.end(), [&](const at::Tensor& input) { return input.is_same(output); });
    if (passed_on) continue;
    // Backward of this layer starts when an output's gradient is ready.
    output.register_hook([this, layer](const at::Tensor& grad) {
      BackwardReached(layer);
      return grad;
    });
    announced = true;
  }
  for (int b : layout_.layer_buckets[layer]) {
    Bucket& bucket = buckets_[b];
    bucket.escaped |= !announced && at::GradMode::is_enabled();
    for (const at::Tensor& output : outputs) {
      bucket.escaped |= output.defined() && output.storage().is_alias_of(bucket.buffer.storage());
    }
    Release(bucket);
  }
}

void ZeroOptimizer::BackwardReached(int64_t layer) {
  if (backward_held_.insert(layer).second) GatherLayer(layer);
  // Backward goes down the layers: prefetch the one below.
  auto below = layout_.layer_buckets.lower_bound(layer);
  if (below != layout_.layer_buckets.begin()) Prefetch(std::prev(below)->first);
  // Layers two or more above are done with backward: release those still held
  // (a parameter that got no gradient this time keeps its layer until here).
  for (auto it = backward_held_.upper_bound(layer + 1); it != backward_held_.end();) {
    for (int b : layout_.layer_buckets[*it]) Release(buckets_[b]);
    it = backward_held_.erase(it);
  }
}

// Every node of backward that reads a parameter has run once its gradient is
// accumulated, so a layer whose gradients have all arrived needs its
// parameters no more in this backward.
void ZeroOptimizer::ReleaseLayersWithGradients() {
  for (auto it = backward_held_.begin(); it != backward_held_.end();) {
    const std::vector<int>& needed = layout_.layer_buckets[*it];
    const bool done = std::all_of(needed.begin(), needed.end(),
                                  [&](int b) { return !buckets_[b].sharded || buckets_[b].gradients_arrived; });
    if (!done) {
      ++it;
      continue;
    }
    for (int b : needed) Release(buckets_[b]);
    it = backward_held_.erase(it);
  }
}

absl::Status ZeroOptimizer::GatherAllParameters() {
  TRIDENT_RETURN_IF_ERROR(WaitForUpdatedParameters());
  for (Bucket& bucket : buckets_) TRIDENT_RETURN_IF_ERROR(Gather(bucket));
  return absl::OkStatus();
}

absl::Status ZeroOptimizer::ReleaseAllParameters(bool keep_changes) {
  const int64_t rank = group_->rank();
  for (Bucket& bucket : buckets_) {
    if (!bucket.sharded) continue;
    if (keep_changes && HasStorage(bucket.buffer)) {
      bucket.chunk.detach().copy_(bucket.buffer.narrow(0, rank * bucket.chunk.numel(), bucket.chunk.numel()));
    }
    Release(bucket);
  }
  return absl::OkStatus();
}

void ZeroOptimizer::ZeroGrad() {
  for (Bucket& bucket : buckets_) {
    if (bucket.keep_full) {
      bucket.full_grad.zero_();
    } else {
      // Between steps a chunk gradient holds no memory: while backward fills
      // a bucket's whole gradient, the chunk's is not there beside it yet.
      bucket.chunk_grad = at::Tensor();
      bucket.chunk.mutable_grad() = at::Tensor();
      bucket.full_grad = at::Tensor();
      bucket.StartRound();
    }
  }
}

at::Tensor& ZeroOptimizer::ChunkGrad(Bucket& bucket, const at::Tensor& first) {
  if (!bucket.chunk_grad.defined()) {
    bucket.chunk_grad = first.defined() ? first : at::zeros_like(bucket.chunk);
    bucket.chunk.mutable_grad() = bucket.chunk_grad;
  }
  return bucket.chunk_grad;
}

void ZeroOptimizer::PrepareForBackward(bool last_micro_batch) {
  last_micro_batch_ = last_micro_batch;
  for (Bucket& bucket : buckets_) bucket.gradients_arrived = false;
}

void ZeroOptimizer::OnGradientReady(int index, int slot) {
  Bucket& bucket = buckets_[index];
  if (bucket.arrived[slot]) return;
  bucket.arrived[slot] = true;
  if (--bucket.pending > 0) return;
  // A large bucket is reduced now, a slice at a time (in flight, it would
  // hold a second whole copy of its gradient).
  const bool in_slices = bucket.numel > 4 * options_.max_message_elements;
  absl::Status status =
      in_slices ? ReduceScatterInSlices(bucket, bucket.full_grad) : StartReduceScatter(bucket, bucket.full_grad);
  bucket.full_grad = at::Tensor();
  bucket.StartRound();
  bucket.gradients_arrived = true;
  ReleaseLayersWithGradients();
  if (!in_slices) reducing_.push_back(index);
  for (; status.ok() && reducing_.size() > kReduceScattersInFlight; reducing_.pop_front()) {
    status = FinishReduceScatter(buckets_[reducing_.front()]);
  }
  if (!status.ok() && first_error_.ok()) first_error_ = status;
}

absl::Status ZeroOptimizer::StartReduceScatter(Bucket& bucket, const at::Tensor& full) {
  TRIDENT_RETURN_IF_ERROR(FinishReduceScatter(bucket));  // the last micro-batch's, if still travelling
  const double f = options_.spec.gradient_predivide_factor();
  bucket.reduced = at::empty_like(bucket.chunk);
  TRIDENT_ASSIGN_OR_RETURN(PendingWork started, group_->IReduceScatter(f == 1.0 ? full : full / f, bucket.reduced));
  bucket.reducing = std::move(started);
  return absl::OkStatus();
}

absl::Status ZeroOptimizer::FinishReduceScatter(Bucket& bucket) {
  if (!bucket.reducing) return absl::OkStatus();
  absl::Status waited = bucket.reducing->Wait();
  bucket.reducing.reset();
  if (waited.ok() && bucket.chunk_grad.defined()) {
    bucket.chunk_grad.add_(bucket.reduced);
  } else if (waited.ok()) {
    ChunkGrad(bucket, bucket.reduced);  // the step's first: taken as it is
  }
  bucket.reduced = at::Tensor();
  return waited;
}

absl::Status ZeroOptimizer::ReduceScatterInSlices(Bucket& bucket, const at::Tensor& full) {
  TRIDENT_RETURN_IF_ERROR(FinishReduceScatter(bucket));  // the last micro-batch's, if still travelling
  const int64_t parts = group_->size(), chunk = bucket.chunk.numel();
  const double f = options_.spec.gradient_predivide_factor();
  at::Tensor rows = full.view({parts, chunk});
  for (const ChunkColumns& c : SplitChunk(chunk, std::max<int64_t>(1, options_.max_message_elements / parts))) {
    at::Tensor slice = rows.narrow(1, c.offset, c.length).contiguous();
    at::Tensor reduced = at::empty({c.length}, slice.options());
    TRIDENT_ASSIGN_OR_RETURN(PendingWork work, group_->IReduceScatter(f == 1.0 ? slice : slice / f, reduced));
    TRIDENT_RETURN_IF_ERROR(work.Wait());
    at::Tensor part = ChunkGrad(bucket).narrow(0, c.offset, c.length);
    bucket.keep_full ? part.copy_(reduced) : part.add_(reduced);  // keep_full: this rank's part of `full`
  }
  return absl::OkStatus();
}

absl::Status ZeroOptimizer::FinishBackward() {
  (void)WaitForUpdatedParameters();  // a failure is kept in first_error_, returned below
  for (int64_t layer : backward_held_) {
    for (int b : layout_.layer_buckets[layer]) Release(buckets_[b]);
  }
  backward_held_.clear();
  for (Bucket& bucket : buckets_) {
    if (!bucket.prefetch) continue;  // prefetched for a layer that did not run
    absl::Status waited = bucket.prefetch->Wait();
    bucket.prefetch.reset();
    FreeStorage(bucket.buffer);  // no holders: a Gather would have taken the prefetch
    if (!waited.ok() && first_error_.ok()) first_error_ = waited;
  }
  for (Bucket& bucket : buckets_) {
    absl::Status reduced = FinishReduceScatter(bucket);
    if (!reduced.ok() && first_error_.ok()) first_error_ = reduced;
  }
  reducing_.clear();
  absl::Status status = first_error_;
  first_error_ = absl::OkStatus();
  TRIDENT_RETURN_IF_ERROR(status);
  for (Bucket& bucket : buckets_) {
    // A stage-2 bucket left partly filled (parameters without a gradient this
    // round) is reduced here; every rank has the same ones.
    const bool partial = !bucket.keep_full && bucket.full_grad.defined();
    if (bucket.keep_full || partial) TRIDENT_RETURN_IF_ERROR(ReduceScatterInSlices(bucket, bucket.full_grad));
    if (partial) {
      bucket.full_grad = at::Tensor();
      bucket.StartRound();
    }
    const double f = options_.spec.gradient_predivide_factor();
    if (f == 1.0) {
      ChunkGrad(bucket).div_(group_->size());  // zeros where no gradient arrived
    } else {
      ChunkGrad(bucket).mul_(f / group_->size());
    }
  }
  return absl::OkStatus();
}

absl::Status ZeroOptimizer::SumGradientsOver(const ProcessGroup& group, const std::vector<at::Tensor>& parameters) {
  if (group.size() == 1) return absl::OkStatus();
  std::unordered_set<const c10::TensorImpl*> wanted;
  for (const at::Tensor& p : parameters) wanted.insert(p.unsafeGetTensorImpl());
  std::vector<at::Tensor> masks, parts;
  for (Bucket& bucket : buckets_) {
    at::Tensor mask = at::zeros({bucket.numel}, bucket.chunk_grad.options());
    for (size_t i = 0; i < bucket.params.size(); ++i) {
      if (!wanted.count(bucket.params[i].unsafeGetTensorImpl())) continue;
      mask.narrow(0, bucket.offsets[i], c10::multiply_integers(bucket.shapes[i])).fill_(1);
    }
    const int64_t chunk = bucket.chunk_grad.numel();
    masks.push_back(mask.narrow(0, group_->rank() * chunk, chunk));
    parts.push_back(bucket.chunk_grad * masks.back());
  }
  at::Tensor sum = at::cat(parts);
  TRIDENT_RETURN_IF_ERROR(group.AllReduce(sum));
  int64_t offset = 0;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    at::Tensor& grad = buckets_[b].chunk_grad;
    grad.mul_(1 - masks[b]).add_(sum.narrow(0, offset, grad.numel()));
    offset += grad.numel();
  }
  return absl::OkStatus();
}

at::Tensor ZeroOptimizer::LocalSquaredGradNorm() const {
  // Each counted range's norm in one pass over it, without temporaries (a
  // bucket may be the whole model, the default zero_reduce_bucket_size), then
  // their squares summed in fp64: as plain data parallelism sums its
  // parameters' norms.
  std::vector<at::Tensor> ranges;
  for (const Bucket& bucket : buckets_) {
    for (const auto& [begin, end] : bucket.counted) ranges.push_back(bucket.chunk_grad.narrow(0, begin, end - begin));
  }
  if (ranges.empty()) return at::zeros({1}, at::kDouble);
  return at::stack(at::_foreach_norm(ranges)).to(at::kDouble).pow(2).sum().reshape({1});
}

void ZeroOptimizer::ScaleGradients(double factor) {
  for (Bucket& bucket : buckets_) bucket.chunk_grad.mul_(factor);
}

void ZeroOptimizer::ScaleGradients(const at::Tensor& factor) {
  std::vector<at::Tensor> grads;
  for (const Bucket& bucket : buckets_) {
    if (bucket.chunk_grad.defined()) grads.push_back(bucket.chunk_grad);
  }
  MultiplyWithoutReading(grads, factor);
}

bool ZeroOptimizer::LocalGradientsNonFinite() const {
  for (const Bucket& bucket : buckets_) {
    if (!at::isfinite(bucket.chunk_grad).all().item<bool>()) return true;
  }
  return false;
}

absl::Status ZeroOptimizer::Step(double lr) {
  TRIDENT_RETURN_IF_ERROR(WaitForUpdatedParameters());  // the chunks are about to change
  TRIDENT_RETURN_IF_ERROR(std::exchange(first_error_, absl::OkStatus()));
  TRIDENT_RETURN_IF_ERROR(CatchExceptions("the sharded optimizer step", [&] {
    for (auto& group : optimizer_->param_groups()) group.options().set_lr(lr);
    optimizer_->step();
  }));
  TRIDENT_RETURN_IF_ERROR(StartGathers());
  // Without the layers nothing would finish them before they are read.
  if (gathers_before_layer_.empty()) TRIDENT_RETURN_IF_ERROR(WaitForUpdatedParameters());
  return absl::OkStatus();
}

// The updated chunks go back into every bucket's buffer (stage 3's sharded
// buckets are gathered as layers run instead) in messages of at most
// zero_allgather_bucket_size of chunks: columns of one bucket, straight into
// its buffer, or of several through a gathered copy. Given the layers, the
// columns go in the order the layers first read them (those no layer reads
// first), and each layer waits for the messages up to the last it reads.
void ZeroOptimizer::PlanGathers(const std::vector<std::pair<int64_t, std::vector<std::pair<int, int>>>>& layer_slots) {
  const int64_t parts = group_->size();
  struct Planned {
    Gathering::Piece piece;
    std::vector<int64_t> readers;  // the layers reading some of its columns, in order
  };
  std::vector<Planned> planned;
  for (int b = 0; b < static_cast<int>(buckets_.size()); ++b) {
    const Bucket& bucket = buckets_[b];
    if (bucket.sharded) continue;
    const int64_t chunk = bucket.chunk.numel();
    for (const ChunkColumns& c : SplitChunk(chunk, MostGatheredColumns(bucket))) {
      Planned p{{b, c}, {}};
      auto covers = [&](const std::pair<int, int>& slot) {
        if (slot.first != b) return false;
        const int64_t begin = bucket.offsets[slot.second], end = begin + bucket.params[slot.second].numel();
        for (int64_t r = 0; r < parts; ++r) {
          if (begin < r * chunk + c.offset + c.length && r * chunk + c.offset < end) return true;
        }
        return false;
      };
      for (const auto& [layer, slots] : layer_slots) {
        if (std::any_of(slots.begin(), slots.end(), covers)) p.readers.push_back(layer);
      }
      planned.push_back(std::move(p));
    }
  }
  if (!layer_slots.empty()) {
    const int64_t first_layer = layer_slots.front().first;
    for (Planned& p : planned) {
      if (p.readers.empty()) p.readers.push_back(first_layer);  // read by a loss, say: before any layer
    }
    std::stable_sort(planned.begin(), planned.end(),
                     [](const Planned& a, const Planned& b) { return a.readers.front() < b.readers.front(); });
  }
  int64_t in_message = 0;
  for (const Planned& p : planned) {
    const Bucket& bucket = buckets_[p.piece.bucket];
    if (gather_plan_.empty() || in_message + p.piece.columns.length > MostGatheredColumns(bucket) ||
        buckets_[gather_plan_.back().pieces.front().bucket].chunk.scalar_type() != bucket.chunk.scalar_type()) {
      gather_plan_.emplace_back();
      in_message = 0;
    }
    gather_plan_.back().pieces.push_back(p.piece);
    in_message += p.piece.columns.length;
    for (int64_t layer : p.readers) {
      size_t& needed = gathers_before_layer_[layer];
      needed = std::max(needed, gather_plan_.size());
    }
  }
}

int64_t ZeroOptimizer::MostGatheredColumns(const Bucket& bucket) const {
  const int64_t element_bytes = static_cast<int64_t>(bucket.chunk.element_size());
  return std::max<int64_t>(1, std::min(options_.spec.allgather_bucket_bytes() / element_bytes,
                                       options_.max_message_elements / group_->size()));
}

// At most kGatheredInFlight messages with a gathered copy travel at once.
absl::Status ZeroOptimizer::StartGathers() {
  c10::NoGradGuard no_grad;
  constexpr int kGatheredInFlight = 2;
  const int64_t parts = group_->size();
  gathering_.clear();
  gathered_ = 0;
  for (const Gathering& planned : gather_plan_) {
    Gathering message;
    message.pieces = planned.pieces;
    std::vector<at::Tensor> pieces, outputs;
    for (const Gathering::Piece& piece : message.pieces) {
      pieces.push_back(buckets_[piece.bucket].chunk.narrow(0, piece.columns.offset, piece.columns.length));
    }
    if (pieces.size() == 1) {
      const Bucket& bucket = buckets_[message.pieces.front().bucket];
      const ChunkColumns& c = message.pieces.front().columns;
      for (int64_t r = 0; r < parts; ++r) {
        outputs.push_back(bucket.buffer.narrow(0, r * bucket.chunk.numel() + c.offset, c.length));
      }
    } else {
      auto gathered_in_flight = [&] {
        return std::count_if(gathering_.begin() + gathered_, gathering_.end(),
                             [](const Gathering& g) { return g.gathered.defined(); });
      };
      while (gathered_in_flight() >= kGatheredInFlight) TRIDENT_RETURN_IF_ERROR(FinishOldestGather());
      pieces = {at::cat(pieces)};
      message.gathered = at::empty({parts, pieces.front().numel()}, pieces.front().options());
      outputs = message.gathered.unbind(0);
    }
    TRIDENT_ASSIGN_OR_RETURN(message.work, group_->IAllGather(pieces.front(), outputs));
    gathering_.push_back(std::move(message));
  }
  return absl::OkStatus();
}

absl::Status ZeroOptimizer::FinishOldestGather() {
  Gathering& message = gathering_[gathered_++];
  absl::Status waited = message.work.Wait();
  at::Tensor gathered = std::exchange(message.gathered, at::Tensor());
  if (!waited.ok()) {
    if (first_error_.ok()) first_error_ = waited;
    return waited;
  }
  if (!gathered.defined()) return absl::OkStatus();
  c10::NoGradGuard no_grad;
  int64_t offset = 0;
  for (const Gathering::Piece& piece : message.pieces) {
    const Bucket& bucket = buckets_[piece.bucket];
    bucket.buffer.view({group_->size(), bucket.chunk.numel()})
        .narrow(1, piece.columns.offset, piece.columns.length)
        .copy_(gathered.narrow(1, offset, piece.columns.length));
    offset += piece.columns.length;
  }
  return absl::OkStatus();
}

size_t ZeroOptimizer::GathersUnderWay() const { return gathering_.size() - gathered_; }

absl::Status ZeroOptimizer::WaitForUpdatedParameters() {
  while (gathered_ < gathering_.size()) TRIDENT_RETURN_IF_ERROR(FinishOldestGather());
  return absl::OkStatus();
}

MemoryReport ZeroOptimizer::Memory() const {
  MemoryReport report = ZeroLayoutMemory(layout_, group_->size(), /*state_per_element=*/0);
  int64_t chunk_bytes = 0;
  for (const Bucket& bucket : buckets_) chunk_bytes += Bytes(bucket.chunk);
  report.optimizer_bytes = OptimizerStateBytes(*optimizer_, chunk_bytes);
  return report;
}

std::vector<ParameterPart> ZeroOptimizer::ChunkParts() const {
  std::vector<ParameterPart> parts;
  const int64_t rank = group_->rank();
  for (const Bucket& bucket : buckets_) {
    const int64_t chunk_size = bucket.chunk.numel(), chunk_begin = rank * chunk_size;
    for (size_t i = 0; i < bucket.params.size(); ++i) {
      const int64_t numel = c10::multiply_integers(bucket.shapes[i]);
      const int64_t begin = std::max<int64_t>(chunk_begin, bucket.offsets[i]);
      const int64_t end = std::min<int64_t>(chunk_begin + chunk_size, bucket.offsets[i] + numel);
      if (begin >= end && !bucket.sharded) continue;
      // Stage 3 lists every sharded parameter, empty where the chunk misses it.
      parts.push_back({bucket.params[i], bucket.shapes[i], begin - bucket.offsets[i],
                       std::max(begin, end) - bucket.offsets[i], bucket.chunk, begin - chunk_begin, bucket.sharded});
    }
  }
  return parts;
}

NamedTensors ZeroOptimizer::State() const { return SerializeOptimizer(*optimizer_, "zero_optimizer"); }

absl::Status ZeroOptimizer::LoadState(const NamedTensors& state) {
  return DeserializeOptimizer(state, "zero_optimizer", *optimizer_);
}

}  // namespace trident
