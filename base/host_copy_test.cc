// PendingScalar and ToDeviceWithoutWaiting on the CPU: the plain operations
// (host_copy_gpu_test covers CUDA).
#include "base/host_copy.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

namespace trident {
namespace {

TEST(HostCopyTest, OnTheCpuTheValuesAreReadAndCopiedAsTheyAre) {
  EXPECT_FALSE(PendingScalar().defined());
  const at::Tensor value = at::full({1}, 2.25, at::kFloat);
  const PendingScalar pending(value);
  ASSERT_TRUE(pending.defined());
  EXPECT_EQ(pending.Get(), 2.25);
  EXPECT_THROW(PendingScalar(at::zeros({2})), c10::Error);
  const at::Tensor host = at::arange(10, at::kLong);
  EXPECT_TRUE(ToDeviceWithoutWaiting(host, at::kCPU).is_same(host));
  EXPECT_FALSE(ToDeviceWithoutWaiting(at::Tensor(), at::kCPU).defined());
}

}  // namespace
}  // namespace trident
