#include "base/recompute.h"

#include <thread>

#include <ATen/autocast_mode.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "base/autocast_state.h"
#include "base/gradient_hooks.h"

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
    at::Tensor y = recompute ? RecomputeInBackward(f, {x}, {w})[0] : f({x})[0];
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
    loss = (recompute ? RecomputeInBackward(f, {x}, {w})[0] : f({x})[0]).pow(2).sum();
    SetAutocastState(c10::DeviceType::CPU, {false, at::kBFloat16});
    std::thread([&] { loss.backward(); }).join();
    return w.grad();
  };
  const at::Tensor plain = grad_of_w(false), recomputed = grad_of_w(true);
  ASSERT_TRUE(recomputed.defined());
  EXPECT_TRUE(torch::equal(recomputed, plain)) << (recomputed - plain).abs().max();
}

// Autocast on, in one scope around forward and backward in one thread (as a
// training step runs): the weight casts the recomputed forward makes
// without gradients must not enter autocast's cache, or the rerun would read
// them and the weight would get no gradient (bf16 with recomputation then
// barely trained); the rerun's own casts must not stay there either.
TEST(RecomputeTest, AutocastScopeAroundForwardAndBackwardGivesThePlainGradients) {
  torch::manual_seed(4);
  const at::Tensor w0 = torch::randn({8, 8}), v0 = torch::randn({8, 8}), x0 = torch::randn({4, 8});
  auto grads = [&](bool recompute) {
    at::Tensor w = w0.clone().requires_grad_(true), v = v0.clone().requires_grad_(true),
               x = x0.clone().requires_grad_(true);
    auto f = [&](const Values& in) { return Values{at::linear(at::tanh(at::linear(in[0], w)), w)}; };
    SetAutocastState(c10::DeviceType::CPU, {true, at::kBFloat16});
    at::autocast::increment_nesting();
    // Another weight is read outside the recomputed part, before and after it.
    at::Tensor y = at::linear(x, v);
    y = recompute ? RecomputeInBackward(f, {y}, {w})[0] : f({y})[0];
    at::linear(y, v).to(at::kFloat).pow(2).sum().backward();
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    SetAutocastState(c10::DeviceType::CPU, {false, at::kBFloat16});
    return std::vector<at::Tensor>{w.grad(), v.grad(), x.grad()};
  };
  const std::vector<at::Tensor> plain = grads(false), recomputed = grads(true);
  for (size_t i = 0; i < plain.size(); ++i) {
    ASSERT_TRUE(recomputed[i].defined()) << i;
    EXPECT_TRUE(torch::equal(recomputed[i], plain[i])) << i << ": " << (recomputed[i] - plain[i]).abs().max();
  }
  EXPECT_TRUE(at::autocast::is_autocast_cache_enabled()) << "the cache setting is the caller's again";
}

// A weight cast to bf16 both inside the recomputed part and after it (a tied
// head under autocast): the read after must not take a cast the recomputed
// forward made without gradients. Its gradient gets both contributions, summed
// in two bf16 parts rather than one: equal within bf16 rounding.
TEST(RecomputeTest, AWeightCastInsideAndAfterGetsBothContributions) {
  torch::manual_seed(10);
  const at::Tensor w0 = torch::randn({8, 8}), x0 = torch::randn({4, 8});
  auto grad_of_w = [&](bool recompute) {
    at::Tensor w = w0.clone().requires_grad_(true);
    auto f = [&](const Values& in) { return Values{at::tanh(at::linear(in[0], w))}; };
    SetAutocastState(c10::DeviceType::CPU, {true, at::kBFloat16});
    at::autocast::increment_nesting();
    const at::Tensor h = recompute ? RecomputeInBackward(f, {x0}, {w})[0] : f({x0})[0];
    at::linear(h, w).to(at::kFloat).pow(2).sum().backward();
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    SetAutocastState(c10::DeviceType::CPU, {false, at::kBFloat16});
    return w.grad();
  };
  const at::Tensor plain = grad_of_w(false), recomputed = grad_of_w(true);
  ASSERT_TRUE(recomputed.defined());
  EXPECT_TRUE(torch::allclose(recomputed, plain, /*rtol=*/2e-2, /*atol=*/2e-2 * plain.abs().max().item<double>()))
      << (recomputed - plain).abs().max() << " of " << plain.abs().max();
}

// A weight read inside and outside the recomputed part (a tied embedding and
// head) gets both contributions summed by autograd and accumulated once, in
// one backward pass: a reducer's hook on its accumulation fires once, after
// the last contribution.
TEST(RecomputeTest, ATiedWeightIsAccumulatedOnceWithBothContributions) {
  torch::manual_seed(5);
  const at::Tensor table = torch::randn({10, 4}), ids = torch::randint(10, {3, 5});
  auto run = [&](bool recompute, int* accumulations) {
    at::Tensor w = table.clone().requires_grad_(true);
    GradientAccumulatedHooks hooks;
    hooks.Add(w, [accumulations] { ++*accumulations; });
    auto embed = [&](const Values& in) { return Values{at::tanh(at::embedding(w, in[0]))}; };
    // Listed twice (as a layer range holding the embedding and the head would).
    const at::Tensor h = recompute ? RecomputeInBackward(embed, {ids}, {w, w})[0] : embed({ids})[0];
    at::linear(h, w).pow(2).sum().backward();  // the head reads the table again
    return w.grad();
  };
  int plain_count = 0, recomputed_count = 0;
  const at::Tensor plain = run(false, &plain_count), recomputed = run(true, &recomputed_count);
  EXPECT_EQ(plain_count, 1);
  EXPECT_EQ(recomputed_count, 1);
  EXPECT_TRUE(torch::equal(recomputed, plain));
}

// A tensor needing a gradient that the forward reads but the caller did not
// list would silently get none: backward refuses, naming its shape.
TEST(RecomputeTest, AnUnlistedParameterIsRefused) {
  at::Tensor w = torch::randn({6, 4}).requires_grad_(true), x = torch::randn({3, 4}).requires_grad_(true);
  at::Tensor y = RecomputeInBackward([&](const Values& in) { return Values{at::linear(in[0], w)}; }, {x}, {})[0];
  try {
    y.sum().backward();
    FAIL() << "backward should have refused";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("reads a tensor of shape [6, 4] that needs a gradient"));
  }
}

// A split backward asks for the inputs' gradients first and the parameters'
// later: the rerun happens once, and each gradient is handed out once.
TEST(RecomputeTest, GradientsAskedForInPartsComeFromOneRerun) {
  torch::manual_seed(6);
  at::Tensor w = torch::randn({6, 4}).requires_grad_(true), x = torch::randn({3, 4}).requires_grad_(true);
  int runs = 0;
  auto f = [&](const Values& in) {
    ++runs;
    return Values{at::tanh(at::linear(in[0], w))};
  };
  const at::Tensor loss = RecomputeInBackward(f, {x}, {w})[0].pow(2).sum();
  const at::Tensor dx = torch::autograd::grad({loss}, {x}, {}, /*retain_graph=*/true)[0];
  const at::Tensor dw = torch::autograd::grad({loss}, {w}, {}, /*retain_graph=*/true)[0];
  EXPECT_EQ(runs, 2);  // the forward and one rerun
  at::Tensor w2 = w.detach().requires_grad_(true), x2 = x.detach().requires_grad_(true);
  const at::Tensor plain = at::tanh(at::linear(x2, w2)).pow(2).sum();
  const auto expected = torch::autograd::grad({plain}, {x2, w2});
  EXPECT_TRUE(torch::equal(dx, expected[0]));
  EXPECT_TRUE(torch::equal(dw, expected[1]));
  EXPECT_THROW(torch::autograd::grad({loss}, {x}), c10::Error) << "the input's gradient was handed out already";
}

// Rerun ahead of backward (pre-recomputation): backward uses that rerun.
TEST(RecomputeTest, ARerunAheadIsTheOneBackwardUses) {
  torch::manual_seed(8);
  at::Tensor w = torch::randn({6, 4}).requires_grad_(true), x = torch::randn({3, 4}).requires_grad_(true);
  int runs = 0;
  auto f = [&](const Values& in) {
    ++runs;
    return Values{at::dropout(at::linear(in[0], w), 0.5, true)};
  };
  torch::manual_seed(9);
  std::function<void()> ahead;
  const at::Tensor y = RecomputeInBackward(f, {x}, {w}, &ahead)[0];
  torch::rand({100});  // the generator moves on before the rerun
  ahead();
  ahead();
  EXPECT_EQ(runs, 2);
  y.pow(2).sum().backward();
  EXPECT_EQ(runs, 2);
  at::Tensor w2 = w.detach().requires_grad_(true);
  torch::manual_seed(9);
  at::dropout(at::linear(x.detach(), w2), 0.5, true).pow(2).sum().backward();
  EXPECT_TRUE(torch::equal(w.grad(), w2.grad()));
}

// An input modified in place between the forward and the rerun would give
// other gradients: refused.
TEST(RecomputeTest, AnInputModifiedInPlaceIsRefused) {
  at::Tensor w = torch::randn({6, 4}).requires_grad_(true), x = torch::randn({3, 4});
  at::Tensor y = RecomputeInBackward([&](const Values& in) { return Values{at::linear(in[0], w)}; }, {x}, {w})[0];
  x.add_(1);
  EXPECT_THROW(y.sum().backward(), c10::Error);
}

}  // namespace
}  // namespace trident
