// Counts the bytes LibTorch's CPU tensors hold: a wrapper around the CPU
// allocator that keeps the live, peak and allocated totals. For the strategy
// profiler (how much a layer keeps alive between forward and backward) and
// for tests that a step allocates nothing new.
//
//   MemoryCounter& counter = MemoryCounter::Install();   // process-wide, once
//   const int64_t before = counter.live_bytes();
//   ... forward ...
//   const int64_t kept = counter.live_bytes() - before;
#ifndef TRIDENT_BASE_MEMORY_COUNTER_H_
#define TRIDENT_BASE_MEMORY_COUNTER_H_

#include <atomic>
#include <cstdint>

namespace trident {

class MemoryCounter {
 public:
  // Puts the counting allocator in front of the current CPU allocator (the
  // first call; later calls return the same counter). Tensors allocated
  // before are not counted.
  static MemoryCounter& Install();
  // Takes the counting allocator out (it costs a lock per allocation): new
  // tensors are no longer counted, counted ones are still subtracted when
  // freed. Install() puts it back, with the same counter.
  static void Uninstall();

  int64_t live_bytes() const { return live_.load(); }
  int64_t peak_bytes() const { return peak_.load(); }
  int64_t allocations() const { return allocations_.load(); }
  // Starts a new peak from the bytes live now.
  void ResetPeak() { peak_.store(live_.load()); }

  // Called by the allocator.
  void Add(int64_t bytes);
  void Remove(int64_t bytes) { live_ -= bytes; }

 private:
  std::atomic<int64_t> live_{0}, peak_{0}, allocations_{0};
};

// Hands the heap memory this process has freed back to the operating system
// (glibc's malloc_trim, and the CPU block cache's free blocks; the trainer's
// allocator tuning otherwise keeps up to 1 GiB of the heap). Call after a phase that built and dropped large objects,
// such as a strategy search's dry runs, so that they stop counting as resident.
void ReleaseFreedMemory();

// The resident memory (RSS) of this process now, in bytes (0 where /proc is
// missing).
int64_t ResidentBytes();
// The most resident memory (RSS) this process has held, in bytes (0 where
// /proc is missing), sections included.
int64_t PeakResidentBytes();
// Starts a section: SectionPeakResidentBytes then reports the peak since
// now, while PeakResidentBytes keeps the process's. False where the kernel
// cannot reset its high-water mark (/proc/self/clear_refs).
bool StartResidentSection();
int64_t SectionPeakResidentBytes();

}  // namespace trident

#endif  // TRIDENT_BASE_MEMORY_COUNTER_H_
