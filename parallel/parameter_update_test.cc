#include "parallel/parameter_update.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "parallel/optimizer.h"

namespace trident {
namespace {

// Only the counted parameters enter the norm (a tied copy, a tensor-parallel
// replica counted elsewhere); every gradient is scaled; 0 reports only.
TEST(ParameterUpdateTest, ClipGradNormCountsOnceAndScalesAll) {
  auto a = torch::zeros({2}, torch::requires_grad());
  auto b = torch::zeros({1}, torch::requires_grad());
  ParameterUpdateOptions options;
  options.parameters = {{"a", a}, {"b", b}};
  options.counted = {a, b};
  options.make_optimizer = *MakeOptimizerFactory("sgd", ComponentArgs());
  auto update = MakeParameterUpdate(options);
  ASSERT_TRUE(update.ok()) << update.status();
  auto set_grads = [&] {
    a.mutable_grad() = torch::tensor({3.0f, 0.0f});
    b.mutable_grad() = torch::tensor({4.0f});
  };
  (*update)->ZeroGrad();
  set_grads();
  EXPECT_NEAR(*(*update)->ClipGradNorm(1.0), 5.0, 1e-6);
  EXPECT_NEAR(a.grad()[0].item<float>(), 0.6, 1e-5);
  EXPECT_NEAR(*(*update)->ClipGradNorm(0.0), 1.0, 1e-5);  // 0: report only

  options.counted = {b};
  auto counted_b = MakeParameterUpdate(options);
  ASSERT_TRUE(counted_b.ok());
  set_grads();
  EXPECT_NEAR(*(*counted_b)->ClipGradNorm(0.1), 4.0, 1e-5);
  EXPECT_NEAR(a.grad()[0].item<float>(), 3.0 * 0.1 / 4.0, 1e-5);
}

// Without data parallelism ZeroGrad leaves gradients undefined (backward's
// first one becomes .grad) and FinishBackward gives the parameters backward
// did not reach zeros, so the optimizer updates them as under data parallelism.
TEST(ParameterUpdateTest, OneRankTakesBackwardsGradientsAndZeroesTheUnreached) {
  auto used = torch::ones({3}, torch::requires_grad());
  auto unused = torch::ones({2}, torch::requires_grad());
  ParameterUpdateOptions options;
  options.parameters = {{"used", used}, {"unused", unused}};
  options.counted = {used, unused};
  options.make_optimizer = *MakeOptimizerFactory("sgd", ComponentArgs());
  auto update = MakeParameterUpdate(options);
  ASSERT_TRUE(update.ok()) << update.status();
  for (int step = 0; step < 2; ++step) {
    (*update)->ZeroGrad();
    EXPECT_FALSE(used.grad().defined());
    (*update)->PrepareForBackward(true);
    (used * torch::tensor({1.0f, 2.0f, 3.0f})).sum().backward();
    ASSERT_TRUE((*update)->FinishBackward().ok());
    EXPECT_TRUE(torch::equal(used.grad(), torch::tensor({1.0f, 2.0f, 3.0f})));  // not added to the last step's
    ASSERT_TRUE(unused.grad().defined());
    EXPECT_TRUE(torch::equal(unused.grad(), torch::zeros({2})));
  }
}

}  // namespace
}  // namespace trident
