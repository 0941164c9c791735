#include "zero/zero.h"

#include <algorithm>
#include <utility>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "base/status.h"
#include "zero/internal/buckets.h"
#include "zero/internal/offload.h"

namespace trident {

using zero_internal::Bytes;
using zero_internal::ChunkColumns;
using zero_internal::HasStorage;
using zero_internal::SplitChunk;

absl::Status ZeroOptimizer::Step(double lr) {
  TRIDENT_RETURN_IF_ERROR(WaitForUpdatedParameters());  // the chunks are about to change
  TRIDENT_RETURN_IF_ERROR(std::exchange(first_error_, absl::OkStatus()));
  for (auto& group : optimizer_->param_groups()) group.options().set_lr(lr);
  TRIDENT_RETURN_IF_ERROR(offloaded_state_ || offloaded_params_
                              ? OffloadedStep()
                              : CatchExceptions("the sharded optimizer step", [&] { optimizer_->step(); }));
  // The chunks' gradients are spent: their memory goes now rather than at the
  // next ZeroGrad (an evaluation or a checkpoint may come first).
  for (Bucket& bucket : buckets_) {
    if (bucket.keep_full) continue;
    bucket.chunk_grad = at::Tensor();
    bucket.chunk.mutable_grad() = at::Tensor();
  }
  TRIDENT_RETURN_IF_ERROR(StartGathers());
  // Without the layers nothing would finish them before they are read.
  if (gathers_before_layer_.empty()) TRIDENT_RETURN_IF_ERROR(WaitForUpdatedParameters());
  return absl::OkStatus();
}

std::vector<at::Tensor> ZeroOptimizer::OffloadedStateOf(int bucket) const {
  std::vector<at::Tensor> tensors;
  for (const auto& [name, tensor] : ElementwiseState(*optimizer_, buckets_[bucket].chunk)) {
    if (tensor.dim() > 0) tensors.push_back(tensor);  // not the step count
  }
  return tensors;
}

// NOTE: the optimizer skips parameters without a gradient, so giving only
// bucket b's chunk its gradient updates that chunk alone, with the same
// arithmetic as one step over all of them.
absl::Status ZeroOptimizer::OffloadedStep() {
  const int n = static_cast<int>(buckets_.size());
  std::vector<at::Tensor> grads;
  for (Bucket& bucket : buckets_) grads.push_back(std::exchange(bucket.chunk.mutable_grad(), at::Tensor()));
  auto read = [&](int b) {
    if (b >= n) return;
    if (offloaded_state_ && offloaded_state_->InFile(b)) offloaded_state_->StartRead(b, OffloadedStateOf(b));
    StartChunkRead(b);
  };
  read(0);
  absl::Status status;
  for (int b = 0; b < n && status.ok(); ++b) {
    read(b + 1);
    if (offloaded_state_) status = offloaded_state_->Wait(b);
    if (status.ok()) status = ReadChunk(b);
    if (status.ok() && grads[b].defined()) {
      buckets_[b].chunk.mutable_grad() = grads[b];
      status = CatchExceptions("the sharded optimizer step", [&] { optimizer_->step(); });
      buckets_[b].chunk.mutable_grad() = at::Tensor();
    }
    if (!status.ok()) break;
    // Back to their files, also where no gradient changed them (they were read).
    std::vector<at::Tensor> state = offloaded_state_ ? OffloadedStateOf(b) : std::vector<at::Tensor>();
    if (!state.empty()) offloaded_state_->StartWrite(b, std::move(state));
    if (ChunkOffloaded(b)) offloaded_params_->StartWrite(b, {buckets_[b].chunk});
  }
  for (auto* file : {offloaded_state_.get(), offloaded_params_.get()}) {
    absl::Status written = file != nullptr ? file->WaitAll() : absl::OkStatus();
    if (status.ok()) status = written;
  }
  for (int b = 0; b < n; ++b) buckets_[b].chunk.mutable_grad() = grads[b];
  return status;
}

int ZeroOptimizer::BucketOfChunk(const at::Tensor& chunk) const {
  for (size_t b = 0; b < buckets_.size(); ++b) {
    if (buckets_[b].chunk.is_same(chunk)) return static_cast<int>(b);
  }
  return -1;
}

absl::StatusOr<std::map<std::string, at::Tensor>> ZeroOptimizer::ChunkState(const at::Tensor& chunk) const {
  std::map<std::string, at::Tensor> state = ElementwiseState(*optimizer_, chunk);
  const int b = BucketOfChunk(chunk);
  if (!offloaded_state_ || b < 0 || !offloaded_state_->InFile(b)) return state;
  size_t index = 0;  // the order OffloadedStateOf wrote them in
  for (auto& [name, tensor] : state) {
    if (tensor.dim() == 0) continue;
    TRIDENT_ASSIGN_OR_RETURN(tensor, offloaded_state_->Mapped(b, index++));
  }
  return state;
}

absl::Status ZeroOptimizer::SetChunkState(const at::Tensor& chunk, const std::map<std::string, at::Tensor>& state) {
  TRIDENT_RETURN_IF_ERROR(SetElementwiseState(*optimizer_, chunk, state));
  const int b = BucketOfChunk(chunk);
  if (!offloaded_state_ || b < 0 || state.empty()) return absl::OkStatus();
  offloaded_state_->StartWrite(b, OffloadedStateOf(b));
  return offloaded_state_->WaitAll();
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
  return SettleOffloadedChunks();
}

MemoryReport ZeroOptimizer::Memory() const {
  MemoryReport report = ZeroLayoutMemory(layout_, group_->size(), /*state_per_element=*/0);
  int64_t chunk_bytes = 0;
  for (const Bucket& bucket : buckets_) chunk_bytes += Bytes(bucket.chunk);
  report.optimizer_bytes = OptimizerStateBytes(*optimizer_, chunk_bytes);
  if (offloaded_state_) {  // in its file, a few buckets' worth at a time in memory
    report.offloaded_optimizer_bytes = std::exchange(report.optimizer_bytes, 0);
  }
  for (int b = 0; b < static_cast<int>(buckets_.size()); ++b) {
    if (!ChunkOffloaded(b)) continue;
    report.offloaded_parameter_bytes += Bytes(buckets_[b].chunk);
    report.parameter_bytes -= Bytes(buckets_[b].chunk);
  }
  for (const auto* file : {offloaded_state_.get(), offloaded_params_.get()}) {
    if (file == nullptr) continue;
    report.offload_bytes_written += file->bytes_written();
    report.offload_bytes_read += file->bytes_read();
  }
  report.peak_gathered_bytes = peak_gathered_bytes_;
  report.peak_gradients_in_flight_bytes = peak_gradients_in_flight_bytes_;
  return report;
}

absl::StatusOr<std::vector<ParameterPart>> ZeroOptimizer::ChunkParts() const {
  std::vector<ParameterPart> parts;
  const int64_t rank = group_->rank();
  if (offloaded_params_) TRIDENT_RETURN_IF_ERROR(offloaded_params_->WaitAll());
  for (int b = 0; b < static_cast<int>(buckets_.size()); ++b) {
    const Bucket& bucket = buckets_[b];
    const int64_t chunk_size = bucket.chunk.numel(), chunk_begin = rank * chunk_size;
    at::Tensor values = bucket.chunk;
    if (ChunkOffloaded(b) && !HasStorage(bucket.chunk)) {
      TRIDENT_ASSIGN_OR_RETURN(values, offloaded_params_->Mapped(b, 0, /*writable=*/true));
    }
    for (size_t i = 0; i < bucket.params.size(); ++i) {
      const int64_t numel = c10::multiply_integers(bucket.shapes[i]);
      const int64_t begin = std::max<int64_t>(chunk_begin, bucket.offsets[i]);
      const int64_t end = std::min<int64_t>(chunk_begin + chunk_size, bucket.offsets[i] + numel);
      if (begin >= end && !bucket.sharded) continue;
      // Stage 3 lists every sharded parameter, empty where the chunk misses it.
      parts.push_back({bucket.params[i], bucket.shapes[i], begin - bucket.offsets[i],
                       std::max(begin, end) - bucket.offsets[i], bucket.chunk, begin - chunk_begin, bucket.sharded,
                       values});
    }
  }
  return parts;
}

NamedTensors ZeroOptimizer::State() const { return SerializeOptimizer(*optimizer_, "zero_optimizer"); }

absl::Status ZeroOptimizer::LoadState(const NamedTensors& state) {
  return DeserializeOptimizer(state, "zero_optimizer", *optimizer_);
}

}  // namespace trident
