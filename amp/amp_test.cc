#include "amp/amp.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

namespace trident {
namespace {

using ::testing::HasSubstr;

TEST(PrecisionPolicyTest, ModesAndTables) {
  auto bf16 = *MakePrecisionPolicy("bf16", "");
  EXPECT_EQ(bf16.compute, at::kBFloat16);
  EXPECT_EQ(bf16.param, at::kFloat);  // master weights stay fp32
  EXPECT_FALSE(bf16.loss_scaling);
  auto fp16 = *MakePrecisionPolicy("fp16", "");
  EXPECT_TRUE(fp16.loss_scaling);
  auto pure = *MakePrecisionPolicy("pure_bf16", "buffer=fp32,input=bf16");
  EXPECT_EQ(pure.param, at::kBFloat16);
  EXPECT_EQ(pure.buffer, at::kFloat);
  EXPECT_EQ(pure.input, at::kBFloat16);
  EXPECT_THAT(std::string(MakePrecisionPolicy("fp8", "").status().message()),
              HasSubstr("unknown precision 'fp8'; choose bf16, fp16, fp32, pure_bf16, pure_fp16"));
  EXPECT_THAT(std::string(MakePrecisionPolicy("fp32", "weights=bf16").status().message()),
              HasSubstr("kind 'weights' is unknown"));
  EXPECT_THAT(std::string(MakePrecisionPolicy("fp32", "param=int8").status().message()),
              HasSubstr("precision 'int8' is unknown"));
}

TEST(PrecisionPolicyTest, ApplyStoresParametersAndBuffersInTheirDtypes) {
  torch::nn::Linear linear(4, 3);
  torch::nn::BatchNorm1d norm(3);
  auto policy = *MakePrecisionPolicy("pure_bf16", "buffer=fp32");
  ApplyPrecision(*linear, policy);
  ApplyPrecision(*norm, policy);
  EXPECT_EQ(linear->weight.scalar_type(), at::kBFloat16);
  EXPECT_EQ(norm->running_mean.scalar_type(), at::kFloat);
}

TEST(AutocastScopeTest, Bf16ComputeOnCpuInsideTheScopeOnly) {
  at::Tensor a = at::randn({4, 4}), b = at::randn({4, 4});
  {
    AutocastScope scope(*MakePrecisionPolicy("bf16", ""), c10::DeviceType::CPU);
    EXPECT_EQ(at::mm(a, b).scalar_type(), at::kBFloat16);
  }
  EXPECT_EQ(at::mm(a, b).scalar_type(), at::kFloat);
  AutocastScope none(*MakePrecisionPolicy("fp32", ""), c10::DeviceType::CPU);
  EXPECT_EQ(at::mm(a, b).scalar_type(), at::kFloat);
}

// The reference design's dynamic scaling: overflows tolerated `hysteresis`
// times, then halving (not below the minimum); doubling after a clean window.
TEST(LossScalerTest, DynamicScaleFollowsHysteresisAndWindow) {
  LossScalerSpec options;
  options.set_initial_scale_power(4);  // 16
  options.set_loss_scale_window(3);
  options.set_hysteresis(2);
  options.set_min_loss_scale(4);
  LossScaler scaler(options);
  EXPECT_EQ(scaler.scale(), 16);
  scaler.Update(true);
  EXPECT_EQ(scaler.scale(), 16) << "the first overflow uses up hysteresis";
  scaler.Update(true);
  EXPECT_EQ(scaler.scale(), 8);
  scaler.Update(true);
  EXPECT_EQ(scaler.scale(), 4);
  scaler.Update(true);
  EXPECT_EQ(scaler.scale(), 4) << "never below min_loss_scale";
  for (int i = 0; i < 3; ++i) scaler.Update(false);
  EXPECT_EQ(scaler.scale(), 8) << "doubled after loss_scale_window clean steps";

  LossScaler restored(options);
  ASSERT_TRUE(restored.LoadState(scaler.State()).ok());
  EXPECT_EQ(restored.scale(), 8);
  restored.Update(true);
  scaler.Update(true);
  EXPECT_EQ(restored.scale(), scaler.scale());

  options.set_loss_scale(128);  // static
  LossScaler fixed(options);
  fixed.Update(true);
  EXPECT_EQ(fixed.scale(), 128);
}

}  // namespace
}  // namespace trident
