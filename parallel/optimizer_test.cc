#include "parallel/optimizer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

namespace trident {
namespace {

// FusedAdamW against LibTorch's AdamW, through the registry's factory (group 0
// decays, group 1 does not): float32 runs the fused kernel, float64 the
// tensor-by-tensor path.
class AdamWTest : public ::testing::TestWithParam<torch::ScalarType> {};

TEST_P(AdamWTest, MatchesLibTorchAdamWWithDecayOnMatricesOnly) {
  torch::manual_seed(0);
  auto dtype = torch::TensorOptions().dtype(GetParam());
  auto matrix = torch::randn({4, 3}, dtype).requires_grad_();
  auto bias = torch::randn({3}, dtype).requires_grad_();
  auto matrix_ref = matrix.detach().clone().requires_grad_();
  auto bias_ref = bias.detach().clone().requires_grad_();
  auto factory = MakeOptimizerFactory(
      "adamw", ComponentArgs("optimizer 'adamw'",
                             {{"beta1", "0.9"}, {"beta2", "0.95"}, {"eps", "1e-8"}, {"weight_decay", "0.1"}}));
  ASSERT_TRUE(factory.ok()) << factory.status();
  auto ours = (*factory)({{matrix}, {bias}});
  ASSERT_NE(dynamic_cast<FusedAdamW*>(ours.get()), nullptr);
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
    SetLearningRate(*ours, 1e-2);
    ours->step();
    reference.step();
  }
  EXPECT_TRUE(torch::allclose(matrix, matrix_ref, 1e-6, 1e-7));
  EXPECT_TRUE(torch::allclose(bias, bias_ref, 1e-6, 1e-7));
}

INSTANTIATE_TEST_SUITE_P(FusedAndUnfused, AdamWTest, ::testing::Values(torch::kFloat, torch::kDouble));

// The state goes through torch::optim's own serialisation: a second optimizer
// restored from it continues exactly as the first.
TEST(AdamWStateTest, StateRoundTripsExactly) {
  auto factory = *MakeOptimizerFactory("adamw", ComponentArgs("optimizer 'adamw'", {}));
  auto w1 = torch::ones({2, 2}, torch::requires_grad());
  auto w2 = torch::ones({2, 2}, torch::requires_grad());
  auto first = factory({{w1}, {}});
  w1.mutable_grad() = torch::full({2, 2}, 0.5);
  first->step();
  const NamedTensors saved = SerializeOptimizer(*first, "optimizer");
  auto second = factory({{w2}, {}});
  w2.detach().copy_(w1.detach());
  ASSERT_TRUE(DeserializeOptimizer(saved, "optimizer", *second).ok());
  w1.mutable_grad() = torch::full({2, 2}, -0.25);
  w2.mutable_grad() = torch::full({2, 2}, -0.25);
  first->step();
  second->step();
  EXPECT_TRUE(torch::equal(w1, w2));
  EXPECT_THAT(std::string(DeserializeOptimizer({}, "optimizer", *second).message()),
              ::testing::HasSubstr("'optimizer') is missing"));
}

TEST(OptimizerRegistryTest, UnknownNamesAndBadArgumentsAreErrors) {
  EXPECT_THAT(std::string(MakeOptimizerFactory("lamb", {}).status().message()),
              ::testing::HasSubstr("unknown optimizer 'lamb'; choose adam, adamw, sgd"));
  EXPECT_THAT(
      std::string(
          MakeOptimizerFactory("adamw", ComponentArgs("optimizer 'adamw'", {{"betas", "1"}})).status().message()),
      ::testing::HasSubstr("has no argument(s) betas"));
  EXPECT_THAT(
      std::string(
          MakeOptimizerFactory("sgd", ComponentArgs("optimizer 'sgd'", {{"momentum", "x"}})).status().message()),
      ::testing::HasSubstr("momentum='x' is not a number"));
}

TEST(LearningRateTest, WarmupThenDecayToMinimum) {
  EXPECT_DOUBLE_EQ(*LearningRate("cosine", 1.0, 0.1, 4, 104, 0), 0.2);
  EXPECT_DOUBLE_EQ(*LearningRate("cosine", 1.0, 0.1, 4, 104, 4), 1.0);
  EXPECT_NEAR(*LearningRate("cosine", 1.0, 0.1, 4, 104, 54), 0.55, 1e-12);
  EXPECT_NEAR(*LearningRate("cosine", 1.0, 0.1, 4, 104, 104), 0.1, 1e-12);
  EXPECT_NEAR(*LearningRate("linear", 1.0, 0.1, 0, 100, 50), 0.55, 1e-12);
  EXPECT_DOUBLE_EQ(*LearningRate("constant", 1.0, 0.1, 0, 100, 99), 1.0);
  EXPECT_THAT(std::string(LearningRate("step", 1.0, 0.1, 0, 100, 99).status().message()),
              ::testing::HasSubstr("unknown lr_scheduler 'step'; choose constant, cosine, linear"));
}

}  // namespace
}  // namespace trident
