// The CPU block cache, installed as LibTorch's CPU allocator: a freed large
// tensor's block serves the next tensor of its size or a little smaller,
// never more is mapped than was once in use, small tensors and raw
// allocations pass through, blocks freed on other threads return, and Trim
// unmaps what is free.
#include "base/cpu_block_cache.h"

#include <thread>

#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

namespace trident {
namespace {

constexpr int64_t kFloats = 1 << 19, kBytes = kFloats * 4;  // 2 MiB

TEST(CpuBlockCacheTest, FreedBlocksServeTheNextTensorsOfTheirSize) {
  InstallCpuBlockCache();
  TrimCpuBlockCache();
  const CpuBlockCacheStats start = GetCpuBlockCacheStats();
  at::Tensor a = torch::full({kFloats}, 7.0f);
  const void* block = a.data_ptr();
  EXPECT_EQ(GetCpuBlockCacheStats().in_use_bytes, start.in_use_bytes + kBytes);
  a = at::Tensor();
  EXPECT_EQ(GetCpuBlockCacheStats().free_bytes, kBytes);

  at::Tensor b = torch::empty({kFloats - 1000});  // a little smaller: the same block, as it was left
  EXPECT_EQ(b.data_ptr(), block);
  EXPECT_EQ(b[0].item<float>(), 7.0f);
  EXPECT_EQ(GetCpuBlockCacheStats().free_bytes, 0);
  EXPECT_EQ(GetCpuBlockCacheStats().reused, start.reused + 1);
  std::thread([&b] { b = at::Tensor(); }).join();
  EXPECT_EQ(GetCpuBlockCacheStats().free_bytes, kBytes);

  // Too small for the free block: a new one, and the free one is unmapped
  // (both would be more than was ever in use at once).
  at::Tensor half = torch::ones({kFloats / 2});
  EXPECT_NE(half.data_ptr(), block);
  EXPECT_EQ(GetCpuBlockCacheStats().free_bytes, 0);
  EXPECT_EQ(GetCpuBlockCacheStats().mapped, start.mapped + 2);
  half = at::Tensor();
  EXPECT_EQ(GetCpuBlockCacheStats().free_bytes, kBytes / 2);

  // Three in use at once: all three kept. A larger one then maps what the
  // peak allows beside it: two of the three are unmapped.
  TrimCpuBlockCache();
  std::vector<at::Tensor> three;
  for (int i = 0; i < 3; ++i) three.push_back(torch::zeros({kFloats}));
  three.clear();
  EXPECT_EQ(GetCpuBlockCacheStats().free_bytes, 3 * kBytes);
  at::Tensor large = torch::zeros({2 * kFloats});
  EXPECT_EQ(GetCpuBlockCacheStats().free_bytes, kBytes);
  large = at::Tensor();
  EXPECT_EQ(GetCpuBlockCacheStats().free_bytes, 3 * kBytes);
  TrimCpuBlockCache();
  EXPECT_EQ(GetCpuBlockCacheStats().free_bytes, 0);
  EXPECT_EQ(GetCpuBlockCacheStats().peak_in_use_bytes, GetCpuBlockCacheStats().in_use_bytes);

  at::Tensor small = torch::zeros({1000});  // from the allocator below, not kept
  small = at::Tensor();
  EXPECT_EQ(GetCpuBlockCacheStats().free_bytes, 0);
}

TEST(CpuBlockCacheTest, RawAllocationsOfBothSizesAreFreedByTheRawDeleter) {
  InstallCpuBlockCache();
  TrimCpuBlockCache();
  c10::Allocator* cpu = c10::GetCPUAllocator();
  void* large = cpu->raw_allocate(kBytes);
  void* small = cpu->raw_allocate(100);
  static_cast<char*>(large)[kBytes - 1] = 1;
  static_cast<char*>(small)[99] = 1;
  cpu->raw_deleter()(large);
  cpu->raw_deleter()(small);
  EXPECT_EQ(GetCpuBlockCacheStats().free_bytes, kBytes);
}

}  // namespace
}  // namespace trident
