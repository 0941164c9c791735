// PendingScalar and ToDeviceWithoutWaiting on CUDA (needs a GPU; tagged gpu):
// the values are right, and neither waits for the work queued after it.
#include "base/host_copy.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "testing/queued_work.h"

namespace trident {
namespace {

using testing::QueueLongWork;

TEST(HostCopyGpuTest, PendingScalarReadsTheValueWithoutWaitingForLaterWork) {
  ASSERT_TRUE(torch::cuda::is_available()) << "run gpu-tagged tests on a machine with a GPU";
  const at::Tensor a = at::randn({4096, 4096}, at::kCUDA);
  const at::Tensor value = a.sum();
  const PendingScalar pending(value);
  const std::unique_ptr<c10::Event> later = QueueLongWork(a);
  const double read = pending.Get();
  EXPECT_FALSE(later->query()) << "Get waited for the work queued after the value";
  EXPECT_DOUBLE_EQ(read, value.item<double>());
  // bf16 values and one-element tensors of any shape.
  const at::Tensor half = at::full({1, 1}, 1.5, at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA));
  EXPECT_EQ(PendingScalar(half).Get(), 1.5);
}

TEST(HostCopyGpuTest, ToDeviceWithoutWaitingCopiesBehindQueuedWork) {
  ASSERT_TRUE(torch::cuda::is_available()) << "run gpu-tagged tests on a machine with a GPU";
  const at::Tensor a = at::randn({4096, 4096}, at::kCUDA);
  const std::unique_ptr<c10::Event> earlier = QueueLongWork(a);
  const at::Tensor host = at::arange(1 << 20, at::kLong);
  at::Tensor on_device = ToDeviceWithoutWaiting(host, a.device());
  EXPECT_FALSE(earlier->query()) << "the copy waited for the work queued before it";
  EXPECT_TRUE(on_device.is_cuda());
  EXPECT_TRUE(at::equal(on_device.cpu(), host));
  // A non-contiguous host tensor keeps its values.
  const at::Tensor strided = at::arange(64, at::kFloat).view({8, 8}).t();
  EXPECT_TRUE(at::equal(ToDeviceWithoutWaiting(strided, a.device()).cpu(), strided));
}

// Multiplied by a device tensor, bf16 and fp16 would round the factor to
// their type; a double is used in fp32.
TEST(HostCopyGpuTest, MultiplyingByADeviceTensorEqualsMultiplyingByTheDouble) {
  ASSERT_TRUE(torch::cuda::is_available()) << "run gpu-tagged tests on a machine with a GPU";
  const double factor = 1.0 / 3.0 + 1e-9;
  for (const at::ScalarType type : {at::kFloat, at::kBFloat16, at::kHalf}) {
    const at::Tensor a = at::randn({1000}, at::kCUDA).to(type);
    const std::vector<at::Tensor> scaled = {a.clone()};
    MultiplyWithoutReading(scaled, at::full({1}, factor, at::TensorOptions().dtype(at::kDouble).device(at::kCUDA)));
    EXPECT_TRUE(at::equal(scaled[0].cpu(), (a * factor).cpu())) << type;
  }
}

}  // namespace
}  // namespace trident
