// fp16 autocast on CUDA (needs a GPU; tagged gpu).
#include "amp/amp.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace trident {
namespace {

TEST(AutocastScopeGpuTest, Fp16ComputeOnCuda) {
  ASSERT_TRUE(torch::cuda::is_available()) << "run gpu-tagged tests on a machine with a GPU";
  at::Tensor a = at::randn({8, 8}, at::kCUDA), b = at::randn({8, 8}, at::kCUDA);
  {
    AutocastScope scope(*MakePrecisionPolicy("fp16", ""), c10::DeviceType::CUDA);
    EXPECT_EQ(at::mm(a, b).scalar_type(), at::kHalf);
  }
  EXPECT_EQ(at::mm(a, b).scalar_type(), at::kFloat);
}

}  // namespace
}  // namespace trident
