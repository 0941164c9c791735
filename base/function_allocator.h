// A LibTorch allocator made of two functions, the same across LibTorch
// versions (2.x made allocate non-const and added copy_data; Debian's 1.13 has
// neither). Private to base: the CPU allocators it puts in front of
// LibTorch's (the memory counter, the block cache).
#ifndef TRIDENT_BASE_FUNCTION_ALLOCATOR_H_
#define TRIDENT_BASE_FUNCTION_ALLOCATOR_H_

#include <cstddef>

#include <c10/core/Allocator.h>
#include <torch/version.h>

namespace trident {
namespace base_internal {

// allocate(n) is Allocate(n); raw_deleter() is Deleter, which must free what
// Allocate returns (its DataPtr's context is its data) and whatever raw
// allocations of the allocator below reach it.
template <c10::DataPtr (*Allocate)(size_t), void (*Deleter)(void*)>
class FunctionAllocator : public c10::Allocator {
 public:
#if TORCH_VERSION_MAJOR >= 2
  c10::DataPtr allocate(size_t n) override { return Allocate(n); }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
#else
  c10::DataPtr allocate(size_t n) const override { return Allocate(n); }
#endif
  c10::DeleterFnPtr raw_deleter() const override { return Deleter; }
};

}  // namespace base_internal
}  // namespace trident

#endif  // TRIDENT_BASE_FUNCTION_ALLOCATOR_H_
