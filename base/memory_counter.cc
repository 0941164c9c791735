#include "base/memory_counter.h"

#include <malloc.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <string>
#include <unordered_map>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include "base/cpu_block_cache.h"
#include "base/function_allocator.h"

namespace trident {
namespace {

// Allocations by address, with their size and the underlying deleter (LibTorch
// requires a CPU DataPtr's context to be its data, so the size cannot ride in
// the context).
struct Allocation {
  int64_t bytes;
  c10::DeleterFnPtr deleter;
};
std::mutex& TableMutex() {
  static std::mutex* mutex = new std::mutex;
  return *mutex;
}
std::unordered_map<void*, Allocation>& Table() {
  static auto* table = new std::unordered_map<void*, Allocation>;
  return *table;
}
MemoryCounter* counter_instance = nullptr;
c10::DeleterFnPtr base_raw_deleter = nullptr;  // for memory the base allocator handed out uncounted

void DeleteCounted(void* data) {
  Allocation allocation;
  {
    std::lock_guard<std::mutex> lock(TableMutex());
    auto it = Table().find(data);
    if (it == Table().end()) {
      if (base_raw_deleter != nullptr) base_raw_deleter(data);
      return;
    }
    allocation = it->second;
    Table().erase(it);
  }
  counter_instance->Remove(allocation.bytes);
  allocation.deleter(data);
}

c10::Allocator* base_allocator = nullptr;  // the allocator the counter is in front of

c10::DataPtr AllocateCounted(size_t n) {
  c10::DataPtr original = base_allocator->allocate(n);
  void* data = original.get();
  if (data == nullptr || original.get_context() != data) return original;  // not ours to count
  const c10::Device device = original.device();
  c10::DeleterFnPtr deleter = original.get_deleter();
  original.release_context();
  {
    std::lock_guard<std::mutex> lock(TableMutex());
    Table()[data] = {static_cast<int64_t>(n), deleter};
  }
  counter_instance->Add(static_cast<int64_t>(n));
  return {data, data, &DeleteCounted, device};
}

}  // namespace

void MemoryCounter::Add(int64_t bytes) {
  ++allocations_;
  const int64_t now = live_ += bytes;
  int64_t peak = peak_.load();
  while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
  }
}

namespace {

c10::Allocator* counting_allocator = nullptr;

}  // namespace

MemoryCounter& MemoryCounter::Install() {
  static MemoryCounter* counter = new MemoryCounter();
  static std::once_flag once;
  std::call_once(once, [] {
    counter_instance = counter;
    base_allocator = c10::GetCPUAllocator();
    base_raw_deleter = base_allocator->raw_deleter();
    counting_allocator = new base_internal::FunctionAllocator<&AllocateCounted, &DeleteCounted>;
  });
  c10::SetCPUAllocator(counting_allocator, /*priority=*/255);
  return *counter;
}

void MemoryCounter::Uninstall() {
  if (base_allocator != nullptr) c10::SetCPUAllocator(base_allocator, /*priority=*/255);
}

void ReleaseFreedMemory() {
  TrimCpuBlockCache();
  malloc_trim(0);
}

namespace {

std::atomic<int64_t> peak_before_sections{0};

// A "Vm...:" field of /proc/self/status, in bytes (0 when missing).
int64_t StatusBytes(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(field, 0) == 0) return std::atoll(line.c_str() + field.size()) * 1024;
  }
  return 0;
}

int64_t HighWaterMark() { return StatusBytes("VmHWM:"); }

}  // namespace

int64_t ResidentBytes() { return StatusBytes("VmRSS:"); }

int64_t PeakResidentBytes() { return std::max(peak_before_sections.load(), HighWaterMark()); }

bool StartResidentSection() {
  const int64_t peak = HighWaterMark();
  int64_t seen = peak_before_sections.load();
  while (peak > seen && !peak_before_sections.compare_exchange_weak(seen, peak)) {
  }
  std::ofstream clear("/proc/self/clear_refs");
  clear << "5";  // resets VmHWM to the resident size now (Linux 4.0 and later)
  clear.flush();
  return static_cast<bool>(clear);
}

int64_t SectionPeakResidentBytes() { return HighWaterMark(); }

}  // namespace trident
