#include "trainer/internal/peak_flops.h"

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

TEST(SlowBf16WarningTest, OnlyCpuBf16RunsAreChecked) {
  EXPECT_EQ(SlowBf16Warning("cpu", "fp32"), "");
  EXPECT_EQ(SlowBf16Warning("cuda", "bf16"), "");
}

}  // namespace
}  // namespace internal
}  // namespace trident
