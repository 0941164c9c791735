#include "parallel/parameter_update.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "parallel/optimizer.h"
#include "testing/multiprocess.h"

namespace trident {
namespace {

// Plain data parallelism at dp = 1 over `parameters` (SGD), each counted in the norm.
std::unique_ptr<ParameterUpdate> OneRankUpdate(const NamedTensors& parameters) {
  ParameterUpdateOptions options;
  options.parameters = parameters;
  for (const auto& [name, p] : parameters) options.counted.push_back(p);
  options.make_optimizer = *MakeOptimizerFactory("sgd", ComponentArgs());
  auto update = MakeParameterUpdate(options);
  EXPECT_TRUE(update.ok()) << update.status();
  return update.ok() ? std::move(*update) : nullptr;
}

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
  EXPECT_NEAR((*update)->ClipGradNorm(1.0)->Get(), 5.0, 1e-6);
  EXPECT_NEAR(a.grad()[0].item<float>(), 0.6, 1e-5);
  EXPECT_NEAR((*update)->ClipGradNorm(0.0)->Get(), 1.0, 1e-5);  // 0: report only

  options.counted = {b};
  auto counted_b = MakeParameterUpdate(options);
  ASSERT_TRUE(counted_b.ok());
  set_grads();
  EXPECT_NEAR((*counted_b)->ClipGradNorm(0.1)->Get(), 4.0, 1e-5);
  EXPECT_NEAR(a.grad()[0].item<float>(), 3.0 * 0.1 / 4.0, 1e-5);
}

// Scaling by a tensor (what ClipGradNorm does on a GPU) multiplies by the
// factor rounded to fp32, as scaling by the double does.
TEST(ParameterUpdateTest, ScalingByATensorEqualsScalingByTheDouble) {
  torch::manual_seed(5);
  auto a = torch::zeros({1000}, torch::requires_grad());
  auto b = torch::zeros({7}, torch::dtype(torch::kBFloat16).requires_grad(true));
  const std::unique_ptr<ParameterUpdate> update = OneRankUpdate({{"a", a}, {"b", b}});
  ASSERT_NE(update, nullptr);
  const at::Tensor ga = torch::randn({1000}), gb = torch::randn({7}).to(torch::kBFloat16);
  const double factor = 1.0 / 3.0 + 1e-9;  // not an fp32 value
  std::vector<at::Tensor> by_double, by_tensor;
  for (const bool tensor : {false, true}) {
    a.mutable_grad() = ga.clone();
    b.mutable_grad() = gb.clone();
    if (tensor) {
      update->ScaleGradients(torch::full({1}, factor, torch::kDouble));
    } else {
      update->ScaleGradients(factor);
    }
    (tensor ? by_tensor : by_double) = {a.grad().clone(), b.grad().clone()};
  }
  EXPECT_TRUE(torch::equal(by_tensor[0], by_double[0]));
  EXPECT_TRUE(torch::equal(by_tensor[1], by_double[1]));
  EXPECT_FALSE(torch::equal(by_tensor[0], ga));
}

// Without data parallelism ZeroGrad leaves gradients undefined (backward's
// first one becomes .grad) and FinishBackward gives the parameters backward
// did not reach zeros, so the optimizer updates them as under data parallelism.
TEST(ParameterUpdateTest, OneRankTakesBackwardsGradientsAndZeroesTheUnreached) {
  auto used = torch::ones({3}, torch::requires_grad());
  auto unused = torch::ones({2}, torch::requires_grad());
  const std::unique_ptr<ParameterUpdate> update = OneRankUpdate({{"used", used}, {"unused", unused}});
  ASSERT_NE(update, nullptr);
  for (int step = 0; step < 2; ++step) {
    update->ZeroGrad();
    EXPECT_FALSE(used.grad().defined());
    update->PrepareForBackward(true);
    (used * torch::tensor({1.0f, 2.0f, 3.0f})).sum().backward();
    ASSERT_TRUE(update->FinishBackward().ok());
    EXPECT_TRUE(torch::equal(used.grad(), torch::tensor({1.0f, 2.0f, 3.0f})));  // not added to the last step's
    ASSERT_TRUE(unused.grad().defined());
    EXPECT_TRUE(torch::equal(unused.grad(), torch::zeros({2})));
  }
}

// Two data-parallel ranks, a bucket per parameter. A parameter read twice in
// one backward pass (tied) gets both contributions, summed over the ranks. One
// accumulated again by a second backward pass, after its bucket's all-reduce
// started, would race with it: FinishBackward fails, naming it.
TEST(ParameterUpdateTest, AGradientAccumulatedAfterItsAllReduceStartedIsAnError) {
  testing::RunOnRanks(2, [](int rank) {
    auto topology = testing::JoinTopology({{"data", 2}});
    ASSERT_TRUE(topology.ok()) << topology.status();
    auto tied = torch::ones({4}, torch::requires_grad());
    auto other = torch::ones({4}, torch::requires_grad());
    ParameterUpdateOptions options;
    options.parameters = {{"tied", tied}, {"other", other}};
    options.data_parallel = *(*topology)->Group("data");
    options.zero.set_bucket_bytes(16);  // one parameter each
    options.make_optimizer = *MakeOptimizerFactory("sgd", ComponentArgs());
    auto update = MakeParameterUpdate(options);
    ASSERT_TRUE(update.ok()) << update.status();
    const float r = static_cast<float>(rank + 1);

    (*update)->ZeroGrad();
    (*update)->PrepareForBackward(true);
    ((tied * r) * (tied + other)).sum().backward();  // d/dtied = r (2 tied + other) = 3r, d/dother = r
    ASSERT_TRUE((*update)->FinishBackward().ok());
    EXPECT_TRUE(torch::allclose(tied.grad(), torch::full({4}, 4.5f)));  // (3 + 6) / 2
    EXPECT_TRUE(torch::allclose(other.grad(), torch::full({4}, 1.5f)));

    (*update)->ZeroGrad();
    (*update)->PrepareForBackward(true);
    (tied * r).sum().backward();
    (tied + other).sum().backward();  // tied again, after its bucket went
    const absl::Status finished = (*update)->FinishBackward();
    EXPECT_FALSE(finished.ok());
    EXPECT_THAT(std::string(finished.message()),
                ::testing::HasSubstr("the gradient of tied was accumulated again after its bucket's all-reduce"));
  });
}

}  // namespace
}  // namespace trident
