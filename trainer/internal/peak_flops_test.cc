#include "trainer/internal/peak_flops.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace trident {
namespace internal {
namespace {

using ::testing::HasSubstr;

TEST(SlowBf16WarningTest, WarnsOnlyWhereBf16MultipliesMoreSlowlyThanFp32) {
  // One core of this machine's AMD EPYC without AVX-512 BF16 (measured 2026-11-28), and one with it.
  const std::string slow = SlowBf16Warning(/*fp32_per_core=*/84.9e9, /*bf16_per_core=*/4.9e9);
  EXPECT_THAT(slow, HasSubstr("4.9 GFLOP/s per core against 84.9 in fp32"));
  EXPECT_THAT(slow, HasSubstr("--precision=fp32"));
  EXPECT_EQ(SlowBf16Warning(/*fp32_per_core=*/94e9, /*bf16_per_core=*/188e9), "");
}

// Each call measures again and the cache keeps the best rate yet: a rate
// cached above what this core does stays, one below is replaced.
TEST(MeasureCorePeakFlopsTest, KeepsTheBestRateAnyCallMeasured) {
  namespace fs = std::filesystem;
  setenv("HOME", std::getenv("TEST_TMPDIR"), /*overwrite=*/1);
  const double first = MeasureCorePeakFlops(at::kFloat);
  EXPECT_GT(first, 1e8);
  std::vector<fs::path> caches;
  for (const auto& entry : fs::directory_iterator(fs::path(std::getenv("HOME")) / ".cache/trident")) {
    caches.push_back(entry.path());
  }
  ASSERT_EQ(caches.size(), 1u);
  const auto cache = [&](double flops) { std::ofstream(caches[0]) << flops; };
  const auto cached = [&] {
    double flops = 0;
    std::ifstream(caches[0]) >> flops;
    return flops;
  };
  EXPECT_NEAR(cached(), first, 1e-5 * first);  // written with 6 digits
  cache(1e18);
  EXPECT_DOUBLE_EQ(MeasureCorePeakFlops(at::kFloat), 1e18);
  cache(1);
  const double again = MeasureCorePeakFlops(at::kFloat);
  EXPECT_GT(again, 1e8);
  EXPECT_NEAR(cached(), again, 1e-5 * again);
}

TEST(SlowBf16WarningTest, OnlyCpuBf16RunsAreChecked) {
  EXPECT_EQ(SlowBf16Warning("cpu", "fp32"), "");
  EXPECT_EQ(SlowBf16Warning("cuda", "bf16"), "");
}

}  // namespace
}  // namespace internal
}  // namespace trident
