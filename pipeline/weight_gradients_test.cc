// Split backward: the input-gradient pass leaves every weight gradient to the
// deferred pass, which then produces exactly the full backward's gradients.
#include "pipeline/weight_gradients.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "testing/tiny_model.h"

namespace trident {
namespace {

TEST(DeferredWeightGradientsTest, InputGradientsFirstWeightGradientsLater) {
  testing::TinyModelOptions config;
  config.n_layer = 2;
  config.n_embd = 32;
  auto model = std::make_shared<testing::TinyModel>(config, 4, LayerRanges{{1, 3}});  // the two blocks: a middle stage
  internal::DeferredWeightGradients::Parameters parameters;
  for (const auto& p : model->parameters()) parameters.insert(p.unsafeGetTensorImpl());
  torch::manual_seed(1);
  const at::Tensor x = torch::randn({2, 8, 32});
  const at::Tensor grad = torch::randn({2, 8, 32});

  // Reference: one full backward.
  at::Tensor input = x.clone().requires_grad_(true);
  torch::autograd::backward({model->ForwardLayer(2, model->ForwardLayer(1, input))}, {grad});
  const at::Tensor input_grad = input.grad().clone();
  std::vector<at::Tensor> weight_grads;
  for (auto& p : model->parameters()) {
    weight_grads.push_back(p.grad().clone());
    p.mutable_grad() = at::Tensor();
  }

  input = x.clone().requires_grad_(true);
  at::Tensor out = model->ForwardLayer(2, model->ForwardLayer(1, input));
  internal::DeferredWeightGradients deferred;
  ASSERT_TRUE(deferred.Defer({out}, parameters));
  torch::autograd::backward({out}, {grad}, /*retain_graph=*/true);
  EXPECT_TRUE(torch::allclose(input.grad(), input_grad, 1e-6, 1e-7));
  for (const auto& p : model->parameters()) EXPECT_FALSE(p.grad().defined());
  ASSERT_FALSE(deferred.empty());
  out = at::Tensor();
  deferred.Run();
  EXPECT_TRUE(deferred.empty());
  const auto params = model->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    ASSERT_TRUE(params[i].grad().defined()) << i;
    EXPECT_TRUE(torch::allclose(params[i].grad(), weight_grads[i], 1e-6, 1e-7)) << i;
  }
}

TEST(DeferredWeightGradientsTest, AGraphOfParametersOnlyIsNotSplit) {
  testing::TinyModelOptions config;
  config.n_layer = 1;
  auto model =
      std::make_shared<testing::TinyModel>(config, 4, LayerRanges{{0, 2}});  // fed token ids: no input gradient
  internal::DeferredWeightGradients::Parameters parameters;
  for (const auto& p : model->parameters()) parameters.insert(p.unsafeGetTensorImpl());
  at::Tensor out = model->ForwardLayer(1, model->ForwardLayer(0, torch::zeros({1, 4}, torch::kLong)));
  internal::DeferredWeightGradients deferred;
  EXPECT_FALSE(deferred.Defer({out.sum()}, parameters));
  EXPECT_TRUE(deferred.empty());
}

}  // namespace
}  // namespace trident
