#include "base/recompute.h"

#include <thread>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "base/autocast_state.h"

namespace trident {
namespace {

// Recomputed in backward, a product with dropout gives the gradients of the
// plain computation, for its parameter and its input.
TEST(RecomputeTest, GradientsEqualThePlainComputation) {
  torch::manual_seed(1);
  const at::Tensor w0 = torch::randn({6, 4}), x0 = torch::randn({3, 4});
  auto step = [&](bool recompute) {
    at::Tensor w = w0.clone().requires_grad_(true), x = x0.clone().requires_grad_(true);
    auto f = [&](const Values& in) { return Values{at::dropout(at::tanh(at::linear(in[0], w)), 0.5, true)}; };
    torch::manual_seed(7);
    at::Tensor y = recompute ? RecomputeInBackward(f, {x})[0] : f({x})[0];
    (y * y).sum().backward();
    return std::make_pair(w.grad(), x.grad());
  };
  const auto [w_plain, x_plain] = step(false);
  const auto [w_re, x_re] = step(true);
  ASSERT_TRUE(w_re.defined() && x_re.defined());
  EXPECT_TRUE(torch::equal(w_re, w_plain));
  EXPECT_TRUE(torch::equal(x_re, x_plain));
}

// A recomputed embedding: no input needs a gradient (token ids), its weight
// does, and gets the plain computation's.
TEST(RecomputeTest, ParametersGetGradientsWhereNoInputNeedsOne) {
  torch::manual_seed(3);
  const at::Tensor table = torch::randn({10, 4}), ids = torch::randint(10, {3, 5});
  auto grad_of_table = [&](bool recompute) {
    at::Tensor w = table.clone().requires_grad_(true);
    auto f = [&](const Values& in) { return Values{at::embedding(w, in[0])}; };
    (recompute ? RecomputeInBackward(f, {ids}, {w})[0] : f({ids})[0]).pow(2).sum().backward();
    return w.grad();
  };
  const at::Tensor plain = grad_of_table(false), recomputed = grad_of_table(true);
  ASSERT_TRUE(recomputed.defined());
  EXPECT_TRUE(torch::equal(recomputed, plain));
}

// The rerun sees the forward's autocast (bf16 here) even where backward runs
// in a thread without it, as the autograd engine's CUDA threads are.
TEST(RecomputeTest, TheRerunUsesTheForwardsAutocast) {
  torch::manual_seed(2);
  const at::Tensor w0 = torch::randn({8, 8}), x0 = torch::randn({4, 8});
  auto grad_of_w = [&](bool recompute) {
    at::Tensor w = w0.clone().requires_grad_(true), x = x0.clone().requires_grad_(true);
    auto f = [&](const Values& in) { return Values{at::linear(at::tanh(at::linear(in[0], w)), w).to(at::kFloat)}; };
    at::Tensor loss;
    SetAutocastState(c10::DeviceType::CPU, {true, at::kBFloat16});
    loss = (recompute ? RecomputeInBackward(f, {x})[0] : f({x})[0]).pow(2).sum();
    SetAutocastState(c10::DeviceType::CPU, {false, at::kBFloat16});
    std::thread([&] { loss.backward(); }).join();
    return w.grad();
  };
  const at::Tensor plain = grad_of_w(false), recomputed = grad_of_w(true);
  ASSERT_TRUE(recomputed.defined());
  EXPECT_TRUE(torch::equal(recomputed, plain)) << (recomputed - plain).abs().max();
}

}  // namespace
}  // namespace trident
