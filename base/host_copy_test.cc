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

// The same bits as multiplying by the double, for each floating type a
// gradient has (on a GPU too: host_copy_gpu_test).
TEST(HostCopyTest, MultiplyingByATensorEqualsMultiplyingByTheDouble) {
  const double factor = 1.0 / 3.0 + 1e-9;  // not an fp32 value
  for (const at::ScalarType type : {at::kFloat, at::kBFloat16, at::kHalf}) {
    const at::Tensor a = at::randn({1000}).to(type), b = at::randn({7}).to(type);
    const std::vector<at::Tensor> scaled = {a.clone(), b.clone()};
    MultiplyWithoutReading(scaled, at::full({1}, factor, at::kDouble));
    EXPECT_TRUE(at::equal(scaled[0], a * factor)) << type;
    EXPECT_TRUE(at::equal(scaled[1], b * factor)) << type;
    EXPECT_FALSE(at::equal(scaled[0], a)) << type;
  }
}

}  // namespace
}  // namespace trident
