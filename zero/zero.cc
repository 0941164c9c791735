#include "zero/zero.h"

#include <algorithm>
#include <unordered_set>

#include <ATen/ATen.h>
#include <ATen/SequenceNumber.h>
#include <c10/core/GradMode.h>

#include "absl/strings/str_cat.h"
#include "base/host_copy.h"
#include "base/module_names.h"
#include "base/status.h"
#include "zero/internal/buckets.h"
#include "zero/internal/offload.h"

namespace trident {
namespace {

// The one layer of `layer_reads` that reads all of `parameters` (indices),
// none of which another layer reads; -1 where there is none.
int64_t SoleReader(const std::vector<std::pair<int64_t, std::vector<int>>>& layer_reads,
                   const std::vector<int>& parameters) {
  int64_t reader = -1;
  for (const auto& [layer, reads] : layer_reads) {
    const auto read = std::count_if(parameters.begin(), parameters.end(),
                                    [&](int i) { return std::find(reads.begin(), reads.end(), i) != reads.end(); });
    if (read == 0) continue;
    if (reader >= 0 || read != static_cast<int64_t>(parameters.size())) return -1;
    reader = layer;
  }
  return reader;
}

}  // namespace

using zero_internal::AllocateStorage;
using zero_internal::ChunkColumns;
using zero_internal::FreeStorage;
using zero_internal::HasStorage;
using zero_internal::SplitChunk;
using zero_internal::UnallocatedBuffer;

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
  if (options.spec.prefetch_layers() < 0 || options.spec.max_inflight_reduce_scatters() < 1) {
    return absl::InvalidArgumentError(absl::StrCat("zero prefetch_layers=", options.spec.prefetch_layers(),
                                                   " must be at least 0 and max_inflight_reduce_scatters=",
                                                   options.spec.max_inflight_reduce_scatters(), " at least 1"));
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
  std::vector<std::string> names(flat.size());
  if (o.layers != nullptr) {
    TRIDENT_RETURN_IF_ERROR(CatchExceptions("listing the layers' parameters", [&] {
      for (int64_t layer : o.layer_indices) {
        layer_reads.emplace_back(layer, std::vector<int>());
        for (const auto& [name, p] : o.layers->LayerParameters(layer)) {
          auto found = index_of.find(p.unsafeGetTensorImpl());
          if (found == index_of.end()) continue;
          layer_reads.back().second.push_back(found->second);
          names[found->second] = name;
        }
      }
    }));
  }
  // A rank holding every layer can tell a wrap name that matches nothing.
  const bool whole_model = o.layers != nullptr && static_cast<int64_t>(o.layer_indices.size()) == o.layers->NumLayers();
  for (const std::string& wrap : whole_model ? o.spec.wrap() : google::protobuf::RepeatedPtrField<std::string>()) {
    const bool matches =
        std::any_of(names.begin(), names.end(), [&](const std::string& name) { return IsUnderModule(name, wrap); });
    if (!matches) {
      return absl::InvalidArgumentError(
          absl::StrCat("zero wrap (atorch_wrap_cls) '", wrap,
                       "' names no module of the layers this rank holds (their parameters are ",
                       names.empty() ? std::string("none") : absl::StrCat("named like '", names.front(), "'"),
                       "); give a module name or prefix of a layer's parameters"));
    }
  }
  // Stage 3 gathers units of layers (each layer, unless wrapped together).
  std::vector<int64_t> numels;
  for (const ZeroParameter& p : planned) numels.push_back(p.numel);
  const ZeroGatherUnits units = PlanGatherUnits(o.spec, layer_reads, names, numels);
  for (const std::vector<int64_t>& unit : units.layers) {
    for (int64_t layer : unit) zero->unit_of_[layer] = unit.front();
    zero->unit_last_[unit.front()] = unit.back();
  }
  TRIDENT_ASSIGN_OR_RETURN(ZeroLayout layout,
                           PlanZeroBuckets(planned, o.spec.stage(), ZeroBucketBytes(o.spec), static_cast<int>(parts),
                                           o.spec.stage() == 3 ? units.reads : layer_reads));
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
      const torch::autograd::Node* accumulator = zero->hooks_.Add(bucket.params[i], [self, index, slot] {
        Bucket& bucket = self->buckets_[index];
        at::Tensor param = bucket.params[slot];
        const at::Tensor& grad = param.grad();
        if (!bucket.full_grad.defined() && bucket.params.size() == 1 && grad.numel() == bucket.numel &&
            grad.is_contiguous() && grad.dtype() == bucket.chunk.dtype()) {
          bucket.full_grad = grad.view({-1});  // a bucket of one parameter, unpadded: its gradient as it is
          self->NoteWorkingSet();
        } else {
          if (!bucket.full_grad.defined()) {
            bucket.full_grad = at::zeros({bucket.numel}, bucket.chunk.options());
            self->NoteWorkingSet();
          }
          bucket.full_grad.narrow(0, bucket.offsets[slot], param.numel()).add_(grad.reshape({-1}));
        }
        param.mutable_grad() = at::Tensor();  // the whole gradient is not kept
        self->OnGradientReady(index, slot);
      });
      if (bucket.sharded) zero->slot_of_accumulator_[accumulator] = {index, slot};
    }
  };
  const bool on_cpu = std::all_of(flat.begin(), flat.end(), [](const at::Tensor& p) { return p.device().is_cpu(); });
  for (const auto& [knob, offload] : {std::pair("offload_optimizer", o.spec.offload_optimizer()),
                                      std::pair("offload_params", o.spec.offload_params())}) {
    if (offload != ZeroSpec::none && !on_cpu) {
      return absl::UnimplementedError(absl::StrCat(knob, "=", ZeroSpec::Offload_Name(offload),
                                                   " is implemented for CPU training only (the GPU's host-side "
                                                   "update is not written yet); use ",
                                                   knob, "=none"));
    }
  }
  if (o.spec.offload_params() != ZeroSpec::none && o.spec.stage() != 3) {
    return absl::InvalidArgumentError(absl::StrCat("offload_params=", ZeroSpec::Offload_Name(o.spec.offload_params()),
                                                   " needs zero_stage=3 (only stage 3 shards the parameters)"));
  }
  if (o.spec.offload_params() == ZeroSpec::disk) {
    TRIDENT_ASSIGN_OR_RETURN(zero->offloaded_params_,
                             zero_internal::OffloadedTensors::Create(o.spec.offload_dir(), o.rank, "params"));
  }
  // Stage 3: a part built with deferred values draws a layer's values just
  // before the first bucket it reads is sliced (and its parameters freed).
  std::map<int, int64_t> first_reader;
  for (const auto& [layer, buckets] : zero->layout_.layer_buckets) {
    for (int b : buckets) first_reader.emplace(b, layer);
  }
  for (size_t m = 0; m < members.size(); ++m) {
    if (o.spec.stage() == 3) {
      const int64_t unit = first_reader.at(static_cast<int>(m));
      TRIDENT_RETURN_IF_ERROR(CatchExceptions("drawing the parameters' values", [&] {
        for (int64_t layer = unit; layer <= zero->UnitLast(unit); ++layer) o.layers->MaterializeLayer(layer);
      }));
    }
    Bucket bucket;
    bucket.params = members[m];
    if (o.spec.stage() == 3) {
      bucket.unit = first_reader.at(static_cast<int>(m));
      bucket.read_by = SoleReader(layer_reads, zero->layout_.buckets[m].parameters);
    }
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
      if (zero->offloaded_params_)
        zero->offloaded_params_->StartWrite(static_cast<int>(m), {zero->buckets_.back().chunk});
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
  const bool elementwise = ElementwiseStateNames(*zero->optimizer_).ok();
  if (!elementwise && !o.spec.allow_untested_optimizer()) {
    return absl::InvalidArgumentError(
        "ZeRO shards optimizer state element by element, which is known to be exact for Adam, "
        "AdamW and SGD only; this optimizer is untested: set zero_allow_untested_optimizer to "
        "use it anyway");
  }
  if (!elementwise && (o.spec.offload_optimizer() != ZeroSpec::none || o.spec.offload_params() != ZeroSpec::none)) {
    return absl::UnimplementedError(
        "offload_optimizer and offload_params update a bucket at a time, which needs an optimizer with "
        "element-wise state (Adam, AdamW, SGD); use offload_optimizer=none and offload_params=none");
  }
  if (o.spec.offload_optimizer() == ZeroSpec::disk) {
    TRIDENT_ASSIGN_OR_RETURN(zero->offloaded_state_,
                             zero_internal::OffloadedTensors::Create(o.spec.offload_dir(), o.rank, "optimizer"));
  }
  if (zero->offloaded_params_) TRIDENT_RETURN_IF_ERROR(zero->offloaded_params_->WaitAll());
  return zero;
}

// All-gathers still under way are not waited for (a peer may be gone): each
// holds the tensors it writes.
ZeroOptimizer::~ZeroOptimizer() {
  if (options_.spec.stage() == 3 || !gathers_before_layer_.empty()) options_.layers->SetObserver(nullptr);
}

bool ZeroOptimizer::ChunkOffloaded(int b) const { return offloaded_params_ && buckets_[b].sharded; }

void ZeroOptimizer::StartChunkRead(int b) {
  if (ChunkOffloaded(b) && !HasStorage(buckets_[b].chunk)) offloaded_params_->StartRead(b, {buckets_[b].chunk});
}

absl::Status ZeroOptimizer::ReadChunk(int b) {
  if (!ChunkOffloaded(b)) return absl::OkStatus();
  StartChunkRead(b);
  return offloaded_params_->Wait(b);
}

void ZeroOptimizer::DropChunk(int b) {
  if (ChunkOffloaded(b)) FreeStorage(buckets_[b].chunk);
}

absl::Status ZeroOptimizer::SettleOffloadedChunks() {
  if (!offloaded_params_) return absl::OkStatus();
  TRIDENT_RETURN_IF_ERROR(offloaded_params_->WaitAll());
  for (int b = 0; b < static_cast<int>(buckets_.size()); ++b) {
    Bucket& bucket = buckets_[b];
    if (!ChunkOffloaded(b) || bucket.holders > 0) continue;
    if (bucket.prefetch) {  // its all-gather reads the chunk: finish it (it is gathered again when needed)
      absl::Status waited = bucket.prefetch->Wait();
      bucket.prefetch.reset();
      FreeStorage(bucket.buffer);
      TRIDENT_RETURN_IF_ERROR(waited);
    }
    DropChunk(b);
  }
  return absl::OkStatus();
}

absl::Status ZeroOptimizer::Gather(Bucket& bucket) {
  if (!bucket.sharded || bucket.holders++ > 0) return absl::OkStatus();
  const int b = static_cast<int>(&bucket - buckets_.data());
  if (!bucket.prefetch) {
    TRIDENT_RETURN_IF_ERROR(ReadChunk(b));
    AllocateStorage(bucket.buffer);
    TRIDENT_ASSIGN_OR_RETURN(bucket.prefetch, group_->IAllGather(bucket.chunk, bucket.buffer));
  }
  absl::Status waited = bucket.prefetch->Wait();
  bucket.prefetch.reset();
  TRIDENT_RETURN_IF_ERROR(waited);
  DropChunk(b);  // in the buffer now, and in its file
  NoteWorkingSet();
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

void ZeroOptimizer::NoteWorkingSet() {
  int64_t gathered = 0, in_flight = 0;
  for (const Bucket& bucket : buckets_) {
    if (bucket.sharded && HasStorage(bucket.buffer)) gathered += zero_internal::Bytes(bucket.buffer);
    if (!bucket.keep_full) in_flight += zero_internal::Bytes(bucket.full_grad);
    if (bucket.reducing) in_flight += bucket.numel * static_cast<int64_t>(bucket.chunk.element_size());
  }
  if (gathered + in_flight > peak_gathered_bytes_ + peak_gradients_in_flight_bytes_) {
    peak_gathered_bytes_ = gathered;
    peak_gradients_in_flight_bytes_ = in_flight;
  }
}

int64_t ZeroOptimizer::UnitOf(int64_t layer) const {
  auto found = unit_of_.find(layer);
  return found == unit_of_.end() ? layer : found->second;
}

int64_t ZeroOptimizer::UnitLast(int64_t unit) const {
  auto found = unit_last_.find(unit);
  return found == unit_last_.end() ? unit : found->second;
}

// Gathers the buckets of the unit whose first layer is `layer`.
void ZeroOptimizer::GatherLayer(int64_t layer) {
  for (int b : layout_.layer_buckets[layer]) {
    absl::Status status = Gather(buckets_[b]);  // thrown: the layer cannot run without it
    TORCH_CHECK(status.ok(), std::string(status.message()));
  }
}

void ZeroOptimizer::Prefetch(int64_t layer, bool unhooked_only) {
  for (int b : layout_.layer_buckets[layer]) {
    if (!unhooked_only || !buckets_[b].hooked) PrefetchBucket(b);
  }
}

void ZeroOptimizer::PrefetchBucket(int b) {
  Bucket& bucket = buckets_[b];
  if (!bucket.sharded || bucket.holders > 0 || bucket.prefetch) return;
  absl::Status read = ReadChunk(b);
  TORCH_CHECK(read.ok(), std::string(read.message()));
  AllocateStorage(bucket.buffer);
  auto started = group_->IAllGather(bucket.chunk, bucket.buffer);
  TORCH_CHECK(started.ok(), std::string(started.status().message()));
  bucket.prefetch = *std::move(started);
  NoteWorkingSet();
}

void ZeroOptimizer::BeforeLayer(int64_t layer) {
  layer_first_node_ = at::sequence_number::peek();  // the nodes this layer's forward makes come after
  auto needed = gathers_before_layer_.find(layer);  // the updated values it reads, from the last Step
  while (needed != gathers_before_layer_.end() && gathered_ < std::min(needed->second, gathering_.size())) {
    absl::Status finished = FinishOldestGather();  // thrown: the layer cannot run without it
    TORCH_CHECK(finished.ok(), std::string(finished.message()));
  }
  if (options_.spec.stage() < 3 || UnitOf(layer) != layer) return;  // a unit is gathered at its first layer
  GatherLayer(layer);
  // The next units' chunks travel while this one computes.
  auto next = layout_.layer_buckets.upper_bound(layer);
  for (int k = 0; k < ZeroPrefetchDepth(options_.spec) && next != layout_.layer_buckets.end(); ++k, ++next) {
    Prefetch(next->first, /*unhooked_only=*/false);
  }
  if (next != layout_.layer_buckets.end()) ReadAhead(next->first);
}

void ZeroOptimizer::ReadAhead(int64_t layer) {
  for (int b : layout_.layer_buckets[layer]) StartChunkRead(b);
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
  const int64_t unit = UnitOf(layer);
  for (int b : layout_.layer_buckets[unit]) {
    Bucket& bucket = buckets_[b];
    bucket.escaped |= !announced && at::GradMode::is_enabled();
    for (const at::Tensor& output : outputs) {
      bucket.escaped |= output.defined() && output.storage().is_alias_of(bucket.buffer.storage());
    }
    if (layer == UnitLast(unit)) Release(bucket);
  }
  if (announced && at::GradMode::is_enabled()) HookBackwardReaders(layer, outputs);
}

absl::Status ZeroOptimizer::GatherAllParameters() {
  TRIDENT_RETURN_IF_ERROR(WaitForUpdatedParameters());
  for (Bucket& bucket : buckets_) TRIDENT_RETURN_IF_ERROR(Gather(bucket));
  return absl::OkStatus();
}

absl::Status ZeroOptimizer::ReleaseAllParameters(bool keep_changes) {
  const int64_t rank = group_->rank();
  if (offloaded_params_) TRIDENT_RETURN_IF_ERROR(offloaded_params_->WaitAll());  // no read overwrites the copy
  for (int b = 0; b < static_cast<int>(buckets_.size()); ++b) {
    Bucket& bucket = buckets_[b];
    if (!bucket.sharded) continue;
    if (keep_changes && HasStorage(bucket.buffer)) {
      AllocateStorage(bucket.chunk);  // an offloaded chunk: then back to its file
      bucket.chunk.detach().copy_(bucket.buffer.narrow(0, rank * bucket.chunk.numel(), bucket.chunk.numel()));
      if (ChunkOffloaded(b)) offloaded_params_->StartWrite(b, {bucket.chunk});
    }
    Release(bucket);
  }
  return offloaded_params_ ? offloaded_params_->WaitAll() : absl::OkStatus();
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
  last_reader_gather_ = -1;
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
  // Every node of backward that reads a parameter has run once its gradient
  // is accumulated: the bucket's values are not needed again in this backward.
  ReleaseAfterBackward(bucket);
  if (!in_slices) reducing_.push_back(index);
  if (status.ok()) status = LimitReduceScatters(options_.spec.max_inflight_reduce_scatters());
  if (!status.ok() && first_error_.ok()) first_error_ = status;
}

absl::Status ZeroOptimizer::LimitReduceScatters(int most) {
  for (; static_cast<int>(reducing_.size()) > most; reducing_.pop_front()) {
    TRIDENT_RETURN_IF_ERROR(FinishReduceScatter(buckets_[reducing_.front()]));
  }
  return absl::OkStatus();
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
  for (Bucket& bucket : buckets_) ReleaseAfterBackward(bucket);
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
    TRIDENT_RETURN_IF_ERROR(SumOverReplicas(ChunkGrad(bucket)));  // zeros where no gradient arrived
    const double f = options_.spec.gradient_predivide_factor();
    const int64_t ranks = group_->size() * (options_.replicas != nullptr ? options_.replicas->size() : 1);
    if (f == 1.0) {
      ChunkGrad(bucket).div_(ranks);
    } else {
      ChunkGrad(bucket).mul_(f / ranks);
    }
  }
  return absl::OkStatus();
}

absl::Status ZeroOptimizer::SumOverReplicas(at::Tensor grad) const {
  if (options_.replicas == nullptr || options_.replicas->size() == 1) return absl::OkStatus();
  for (const ChunkColumns& c : SplitChunk(grad.numel(), options_.max_message_elements)) {
    at::Tensor slice = grad.narrow(0, c.offset, c.length);
    TRIDENT_RETURN_IF_ERROR(options_.replicas->AllReduce(slice));
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
  // Replicas hold the same chunks: the first of them counts them.
  if (options_.replicas != nullptr && options_.replicas->rank() > 0) return at::zeros({1}, at::kDouble);
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

}  // namespace trident
