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

// Uninstalled, the counter sees no new tensors but still subtracts the ones
// it counted when they are freed; installed again, it counts again.
TEST(MemoryCounterTest, UninstallStopsCountingNewTensors) {
  MemoryCounter& counter = MemoryCounter::Install();
  const int64_t before = counter.live_bytes();
  at::Tensor counted = at::zeros({256});
  MemoryCounter::Uninstall();
  at::Tensor uncounted = at::zeros({256});
  EXPECT_EQ(counter.live_bytes() - before, 256 * 4);
  counted = at::Tensor();
  uncounted = at::Tensor();
  EXPECT_EQ(counter.live_bytes(), before);
  MemoryCounter::Install();
  at::Tensor again = at::zeros({256});
  EXPECT_EQ(counter.live_bytes() - before, 256 * 4);
}

// A section's peak starts from what is resident when it starts; the
// process's peak keeps what came before.
TEST(ResidentMemoryTest, SectionsKeepTheProcessPeak) {
  constexpr int64_t kBytes = 256 << 20;
  {
    at::Tensor big = at::ones({kBytes / 4});  // touched: resident
    EXPECT_GE(PeakResidentBytes(), kBytes);
  }
  ReleaseFreedMemory();
  const int64_t process_peak = PeakResidentBytes();
  ASSERT_TRUE(StartResidentSection()) << "/proc/self/clear_refs (Linux 4.0 and later) resets the high-water mark";
  EXPECT_LT(SectionPeakResidentBytes(), process_peak - kBytes / 2);
  EXPECT_GE(PeakResidentBytes(), process_peak);
}

}  // namespace
}  // namespace trident
