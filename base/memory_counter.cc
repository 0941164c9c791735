#include "base/memory_counter.h"

#include <mutex>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

namespace trident {
namespace {

// Wraps an allocation of the underlying allocator with its size.
struct Counted {
  c10::DataPtr original;
  int64_t bytes;
  MemoryCounter* counter;
};

void DeleteCounted(void* context) {
  auto* counted = static_cast<Counted*>(context);
  counted->counter->Remove(counted->bytes);
  delete counted;  // frees the original allocation
}

class CountingAllocator : public c10::Allocator {
 public:
  CountingAllocator(c10::Allocator* base, MemoryCounter* counter) : base_(base), counter_(counter) {}
  c10::DataPtr allocate(size_t n) const override {
    c10::DataPtr original = base_->allocate(n);
    void* data = original.get();
    const c10::Device device = original.device();
    counter_->Add(static_cast<int64_t>(n));
    return {data, new Counted{std::move(original), static_cast<int64_t>(n), counter_}, &DeleteCounted, device};
  }

 private:
  c10::Allocator* base_;
  MemoryCounter* counter_;
};

}  // namespace

void MemoryCounter::Add(int64_t bytes) {
  ++allocations_;
  const int64_t now = live_ += bytes;
  int64_t peak = peak_.load();
  while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
  }
}

MemoryCounter& MemoryCounter::Install() {
  static MemoryCounter* counter = new MemoryCounter();
  static std::once_flag once;
  std::call_once(once, [] {
    static CountingAllocator* allocator = new CountingAllocator(c10::GetCPUAllocator(), counter);
    c10::SetCPUAllocator(allocator, /*priority=*/255);
  });
  return *counter;
}

}  // namespace trident
