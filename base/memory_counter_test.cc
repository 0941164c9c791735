#include "base/memory_counter.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace trident {
namespace {

TEST(MemoryCounterTest, CountsLiveAndPeakBytesOfCpuTensors) {
  MemoryCounter& counter = MemoryCounter::Install();
  const int64_t before = counter.live_bytes();
  counter.ResetPeak();
  {
    at::Tensor a = at::zeros({1024, 256});  // 1 MiB of float
    EXPECT_EQ(counter.live_bytes() - before, 1024 * 256 * 4);
    at::Tensor b = a + a;
    EXPECT_EQ(counter.live_bytes() - before, 2 * 1024 * 256 * 4);
  }
  EXPECT_EQ(counter.live_bytes(), before);
  EXPECT_EQ(counter.peak_bytes() - before, 2 * 1024 * 256 * 4);
  const int64_t allocations = counter.allocations();
  at::Tensor c = at::ones({8});
  EXPECT_EQ(counter.allocations(), allocations + 1);
}

}  // namespace
}  // namespace trident
