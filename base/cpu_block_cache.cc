#include "base/cpu_block_cache.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include "base/function_allocator.h"

namespace trident {
namespace {

constexpr size_t kPage = 4096;

// The cache's state. LibTorch requires a CPU DataPtr's context to be its data
// (raw_allocate), so a block is found by its address.
struct State {
  std::mutex mu;
  c10::Allocator* small = nullptr;  // where requests below kCpuBlockCacheMinBytes go
  c10::DeleterFnPtr small_raw_deleter = nullptr;
  std::unordered_map<void*, size_t> blocks;  // every mapped block, by address: its bytes
  std::multimap<size_t, void*> free;         // the free ones, by size
  int64_t in_use = 0, free_bytes = 0, peak_in_use = 0, reused = 0, mapped = 0;
};

State& TheState() {
  static auto* state = new State;
  return *state;
}

// Takes free blocks out, the largest first, until in use and free together
// fit the peak; returns them for unmapping outside the lock.
std::vector<std::pair<void*, size_t>> FitPeakLocked(State& s) {
  std::vector<std::pair<void*, size_t>> dropped;
  while (!s.free.empty() && s.in_use + s.free_bytes > s.peak_in_use) {
    auto largest = std::prev(s.free.end());
    dropped.emplace_back(largest->second, largest->first);
    s.free_bytes -= largest->first;
    s.blocks.erase(largest->second);
    s.free.erase(largest);
  }
  return dropped;
}

void Unmap(const std::vector<std::pair<void*, size_t>>& blocks) {
  for (const auto& [base, bytes] : blocks) munmap(base, bytes);
}

// Returns a block to the free list: in use and free together stay what they
// were, so within the peak.
void Free(void* data) {
  State& s = TheState();
  {
    std::lock_guard<std::mutex> lock(s.mu);
    auto block = s.blocks.find(data);
    if (block != s.blocks.end()) {
      s.in_use -= block->second;
      s.free.emplace(block->second, data);
      s.free_bytes += block->second;
      return;
    }
  }
  if (s.small_raw_deleter != nullptr) s.small_raw_deleter(data);  // the small allocator's, through raw_deleter
}

c10::DataPtr Allocate(size_t bytes) {
  State& s = TheState();
  if (bytes < kCpuBlockCacheMinBytes) return s.small->allocate(bytes);
  const size_t rounded = (bytes + kPage - 1) / kPage * kPage;
  void* data = nullptr;
  std::vector<std::pair<void*, size_t>> dropped;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    auto kept = s.free.lower_bound(rounded);
    if (kept != s.free.end() && kept->first <= rounded + rounded / 8) {
      data = kept->second;
      s.in_use += kept->first;
      s.free_bytes -= kept->first;
      s.free.erase(kept);
      ++s.reused;
    } else {
      s.in_use += rounded;
      dropped = FitPeakLocked(s);  // checked against the peak this block makes
    }
    s.peak_in_use = std::max(s.peak_in_use, s.in_use);
  }
  Unmap(dropped);
  if (data == nullptr) {
    data = mmap(nullptr, rounded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    const int error = errno;
    std::lock_guard<std::mutex> lock(s.mu);
    if (data == MAP_FAILED) {
      s.in_use -= rounded;
      TORCH_CHECK(false, "could not map ", rounded, " bytes for a CPU tensor: ", std::strerror(error));
    }
    s.blocks.emplace(data, rounded);
    ++s.mapped;
  }
  return {data, data, &Free, c10::Device(c10::DeviceType::CPU)};
}

}  // namespace

void InstallCpuBlockCache() {
  static std::once_flag once;
  std::call_once(once, [] {
    State& s = TheState();
    s.small = c10::GetCPUAllocator();
    s.small_raw_deleter = s.small->raw_deleter();
    c10::SetCPUAllocator(new base_internal::FunctionAllocator<&Allocate, &Free>, /*priority=*/255);
  });
}

void TrimCpuBlockCache() {
  State& s = TheState();
  std::vector<std::pair<void*, size_t>> dropped;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.peak_in_use = s.in_use;
    dropped = FitPeakLocked(s);  // every free block
  }
  Unmap(dropped);
}

CpuBlockCacheStats GetCpuBlockCacheStats() {
  State& s = TheState();
  std::lock_guard<std::mutex> lock(s.mu);
  return {s.in_use, s.free_bytes, s.peak_in_use, s.reused, s.mapped};
}

}  // namespace trident
