// ZeRO's buckets as ZeroOptimizer's translation units share them, and the
// helpers that give a bucket's storage memory or take it away. Private to zero.
#ifndef TRIDENT_ZERO_INTERNAL_BUCKETS_H_
#define TRIDENT_ZERO_INTERNAL_BUCKETS_H_

#include <algorithm>
#include <optional>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "zero/zero.h"

namespace trident {
namespace zero_internal {

inline int64_t Bytes(const at::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

// Columns [offset, offset + length) of a bucket seen as [group size, chunk]:
// element offset.. of every rank's chunk.
struct ChunkColumns {
  int64_t offset = 0, length = 0;
};

// A chunk of `chunk` elements in column ranges of at most `most` elements.
inline std::vector<ChunkColumns> SplitChunk(int64_t chunk, int64_t most) {
  std::vector<ChunkColumns> columns;
  for (int64_t offset = 0; offset < chunk; offset += most) {
    columns.push_back({offset, std::min(most, chunk - offset)});
  }
  return columns;
}

// Stage 3 frees a released bucket's memory inside its buffer's storage
// instead of dropping the buffer: views autograd saved of the gathered
// parameters (a transposed weight) share that storage, so they hold no memory
// while the bucket is released, and see the values again once Gather has
// refilled it, as it does before the layer's backward (BackwardReached).
inline void FreeStorage(const at::Tensor& buffer) {
  c10::StorageImpl* storage = buffer.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, buffer.device()));
  storage->set_nbytes(0);
}

// A buffer of `numel` elements whose storage holds no memory yet.
inline at::Tensor UnallocatedBuffer(int64_t numel, const at::TensorOptions& options) {
  at::Tensor buffer = at::empty({0}, options);
  buffer.unsafeGetTensorImpl()->set_sizes_contiguous({numel});
  return buffer;
}

inline bool HasStorage(const at::Tensor& buffer) { return buffer.storage().nbytes() > 0; }

// Memory for a buffer FreeStorage emptied, from the device's allocator now (a
// CPU allocator installed after the buffer was made, such as train's block
// cache, serves it).
inline void AllocateStorage(const at::Tensor& buffer) {
  if (HasStorage(buffer)) return;
  c10::StorageImpl* storage = buffer.storage().unsafeGetStorageImpl();
  const size_t bytes = buffer.numel() * buffer.element_size();
  storage->set_data_ptr_noswap(c10::GetAllocator(buffer.device().type())->allocate(bytes));
  storage->set_nbytes(bytes);
}

}  // namespace zero_internal

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
  // Stage 3 in backward (zero_backward.cc): the unit that gathers the bucket
  // (its first layer), the one layer reading all its parameters (-1: several
  // or none); `hooked` while the last forward of that layer found every node
  // of backward that reads them (they gather it just before they run);
  // whether this backward holds it gathered; the bucket a reader gathered
  // next in the last backward (-1: none), which its own gather prefetches.
  int64_t unit = -1, read_by = -1;
  bool hooked = false, backward_held = false;
  int next_in_backward = -1;
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
    zero_internal::ChunkColumns columns;
  };
  std::vector<Piece> pieces;
  at::Tensor gathered;  // [group size, the pieces' columns], where there are several
  PendingWork work;
};

}  // namespace trident

#endif  // TRIDENT_ZERO_INTERNAL_BUCKETS_H_
