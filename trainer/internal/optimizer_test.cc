#include "trainer/internal/optimizer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

namespace trident {
namespace internal {
namespace {

// Our AdamW against LibTorch's AdamW with the same two parameter groups: float32
// runs the fused kernel, float64 the multi-tensor path.
class AdamWTest : public ::testing::TestWithParam<torch::ScalarType> {};

TEST_P(AdamWTest, MatchesLibTorchAdamWWithDecayOnMatricesOnly) {
  torch::manual_seed(0);
  auto dtype = torch::TensorOptions().dtype(GetParam());
  auto matrix = torch::randn({4, 3}, dtype).requires_grad_();
  auto bias = torch::randn({3}, dtype).requires_grad_();
  auto matrix_ref = matrix.detach().clone().requires_grad_();
  auto bias_ref = bias.detach().clone().requires_grad_();
  AdamWOptions options{0.9, 0.95, 1e-8, 0.1};
  AdamW ours({{"w", matrix}, {"b", bias}}, options);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<torch::Tensor>{matrix_ref},
                      std::make_unique<torch::optim::AdamWOptions>(
                          torch::optim::AdamWOptions(1e-2).betas({0.9, 0.95}).eps(1e-8).weight_decay(0.1)));
  groups.emplace_back(std::vector<torch::Tensor>{bias_ref},
                      std::make_unique<torch::optim::AdamWOptions>(
                          torch::optim::AdamWOptions(1e-2).betas({0.9, 0.95}).eps(1e-8).weight_decay(0)));
  torch::optim::AdamW reference(groups, torch::optim::AdamWOptions(1e-2));
  auto input = torch::randn({5, 4}, dtype);
  for (int step = 0; step < 5; ++step) {
    for (auto* p : {&matrix, &bias, &matrix_ref, &bias_ref}) {
      if (p->grad().defined()) p->grad().zero_();
    }
    (torch::matmul(input, matrix) + bias).pow(2).sum().backward();
    (torch::matmul(input, matrix_ref) + bias_ref).pow(2).sum().backward();
    ours.Step(1e-2);
    reference.step();
  }
  EXPECT_TRUE(torch::allclose(matrix, matrix_ref, 1e-6, 1e-7));
  EXPECT_TRUE(torch::allclose(bias, bias_ref, 1e-6, 1e-7));
  EXPECT_EQ(ours.steps(), 5);
}

INSTANTIATE_TEST_SUITE_P(FusedAndMultiTensor, AdamWTest,
                         ::testing::Values(torch::kFloat, torch::kDouble));

TEST(AdamWStateTest, StateRoundTrips) {
  auto w = torch::ones({2, 2}, torch::requires_grad());
  AdamW first({{"w", w}}, {});
  w.mutable_grad() = torch::full({2, 2}, 0.5);
  first.Step(0.1);
  SafetensorsContents saved;
  saved.tensors = first.State();
  AdamW second({{"w", w}}, {});
  ASSERT_TRUE(second.LoadState(saved).ok());
  EXPECT_EQ(second.steps(), 1);
  EXPECT_TRUE(torch::equal(second.State()[0].second, first.State()[0].second));
  SafetensorsContents empty;
  empty.path = "ckpt";
  EXPECT_THAT(std::string(second.LoadState(empty).message()), ::testing::HasSubstr("exp_avg/w"));
}

TEST(ClipGradNormTest, ScalesToTheMaximumAndReportsTheNormBefore) {
  auto a = torch::zeros({2}, torch::requires_grad());
  auto b = torch::zeros({1}, torch::requires_grad());
  a.mutable_grad() = torch::tensor({3.0f, 0.0f});
  b.mutable_grad() = torch::tensor({4.0f});
  EXPECT_NEAR(*ClipGradNorm({a, b}, {a, b}, 1.0), 5.0, 1e-6);
  EXPECT_NEAR(a.grad()[0].item<float>(), 0.6, 1e-5);
  EXPECT_NEAR(*ClipGradNorm({a, b}, {a, b}, 0.0), 1.0, 1e-5);  // 0: report only
  // Only `counted` enters the norm (a tied copy is counted once); all are scaled.
  EXPECT_NEAR(*ClipGradNorm({b}, {a, b}, 0.1), 0.8, 1e-5);
  EXPECT_NEAR(a.grad()[0].item<float>(), 0.6 * 0.1 / 0.8, 1e-5);
}

TEST(LearningRateTest, WarmupThenDecayToMinimum) {
  EXPECT_DOUBLE_EQ(LearningRate("cosine", 1.0, 0.1, 4, 104, 0), 0.2);
  EXPECT_DOUBLE_EQ(LearningRate("cosine", 1.0, 0.1, 4, 104, 4), 1.0);
  EXPECT_NEAR(LearningRate("cosine", 1.0, 0.1, 4, 104, 54), 0.55, 1e-12);
  EXPECT_NEAR(LearningRate("cosine", 1.0, 0.1, 4, 104, 104), 0.1, 1e-12);
  EXPECT_NEAR(LearningRate("linear", 1.0, 0.1, 0, 100, 50), 0.55, 1e-12);
  EXPECT_DOUBLE_EQ(LearningRate("constant", 1.0, 0.1, 0, 100, 99), 1.0);
}

}  // namespace
}  // namespace internal
}  // namespace trident
