// A CPU allocator that keeps large blocks for reuse: LibTorch's CPU tensors
// of a MiB and more come from anonymous mappings that a freed tensor returns
// to a cache, where the next tensor of (about) its size takes them.
//
// Why: a training step allocates and frees the same large tensors (a layer's
// activations, ZeRO-3's gathered parameters and whole gradients) over and
// over. From malloc's heap they leave holes that later tensors cannot always
// reuse, so the heap grows past the step's true peak; from fresh mappings
// (malloc's mmap threshold) every page faults in again each time. The cache
// does neither: it never holds more mapped memory (blocks in use and free
// together) than the most its blocks were ever in use at once, unmapping the
// largest free blocks first when a new one would go past that.
//
//   InstallCpuBlockCache();   // process-wide, once; later calls do nothing
#ifndef TRIDENT_BASE_CPU_BLOCK_CACHE_H_
#define TRIDENT_BASE_CPU_BLOCK_CACHE_H_

#include <cstddef>
#include <cstdint>

namespace trident {

// Requests below this go to the allocator the cache was put in front of.
constexpr size_t kCpuBlockCacheMinBytes = size_t{1} << 20;

// Puts the cache in front of LibTorch's current CPU allocator (the first
// call). A request takes a free block up to an eighth larger than it, or a new
// mapping.
void InstallCpuBlockCache();
// Unmaps the free blocks and starts the peak again from what is in use (does
// nothing before InstallCpuBlockCache).
void TrimCpuBlockCache();

struct CpuBlockCacheStats {
  int64_t in_use_bytes = 0, free_bytes = 0, peak_in_use_bytes = 0;
  int64_t reused = 0, mapped = 0;  // requests served from a free block / by a new mapping
};
CpuBlockCacheStats GetCpuBlockCacheStats();

}  // namespace trident

#endif  // TRIDENT_BASE_CPU_BLOCK_CACHE_H_
