#include "kernels/kernels.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "base/autocast_state.h"

namespace trident {
namespace {

struct Result {
  at::Tensor y, dx, dw, db;
};

// The output and the gradients of x, weight and bias under the loss sum(y * probe).
template <typename Product>
Result Differentiate(Product product, const at::Tensor& x0, const at::Tensor& w0, const at::Tensor& b0) {
  at::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true),
             b = b0.clone().requires_grad_(true);
  at::Tensor y = product(x, w, b);
  at::Tensor probe = at::linspace(-1, 1, y.numel(), y.options().dtype(at::kFloat)).view(y.sizes());
  (y.to(at::kFloat) * probe).sum().backward();
  return {y.detach(), x.grad(), w.grad(), b.grad()};
}

void ExpectClose(const Result& a, const Result& b, double tolerance) {
  EXPECT_TRUE(at::allclose(a.y.to(at::kFloat), b.y.to(at::kFloat), tolerance, tolerance));
  EXPECT_TRUE(at::allclose(a.dx, b.dx, tolerance, tolerance));
  EXPECT_TRUE(at::allclose(a.dw, b.dw, tolerance, tolerance));
  EXPECT_TRUE(at::allclose(a.db, b.db, tolerance, tolerance));
}

TEST(AlignedLinearTest, PaddedProductEqualsLinearWithItsGradients) {
  at::manual_seed(1);
  const at::Tensor x = at::randn({2, 5, 24}), w = at::randn({37, 24}), b = at::randn({37});
  const Result padded = Differentiate([](auto x, auto w, auto b) { return PaddedLinear(x, w, b, 64); }, x, w, b);
  const Result plain = Differentiate([](auto x, auto w, auto b) { return at::linear(x, w, b); }, x, w, b);
  ExpectClose(padded, plain, 1e-5);
  // The rows of the result are those of the padded product.
  at::Tensor y = PaddedLinear(x, w, b, 64);
  EXPECT_EQ(y.sizes(), (std::vector<int64_t>{2, 5, 37}));
  EXPECT_EQ(y.stride(1), 64);
  EXPECT_THROW(PaddedLinear(x, w, b, 16), c10::Error);
}

TEST(AlignedLinearTest, PaddedProductUnderAutocastCastsLikeLinear) {
  at::manual_seed(2);
  const at::Tensor x = at::randn({8, 32}), w = at::randn({45, 32}), b = at::randn({45});
  const AutocastState before = GetAutocastState(at::kCPU);
  SetAutocastState(at::kCPU, {true, at::kBFloat16});
  const Result padded = Differentiate([](auto x, auto w, auto b) { return PaddedLinear(x, w, b, 64); }, x, w, b);
  const Result plain = Differentiate([](auto x, auto w, auto b) { return at::linear(x, w, b); }, x, w, b);
  SetAutocastState(at::kCPU, before);
  at::autocast::clear_cache();
  EXPECT_EQ(padded.y.scalar_type(), at::kBFloat16);
  EXPECT_EQ(padded.dw.scalar_type(), at::kFloat);  // the fp32 weight's gradient, as linear's
  ExpectClose(padded, plain, 2e-2);
}

// A cross-entropy over the padded product with -inf pads is the one over the
// product's view, with the same gradients; other tensors pass unchanged.
TEST(AlignedLinearTest, SoftmaxOverThePaddedProductEqualsTheViews) {
  at::manual_seed(3);
  const at::Tensor x = at::randn({2, 6, 16}), w = at::randn({37, 16}), b = at::randn({37});
  const at::Tensor targets = at::randint(0, 37, {12}, at::kLong);
  auto loss = [&](bool padded) {
    return [&, padded](auto x, auto w, auto b) {
      at::Tensor rows = PaddedLinear(x, w, b, 64).reshape({-1, 37});
      if (padded) {
        rows = PaddedForSoftmax(rows);
        EXPECT_EQ(rows.sizes(), (std::vector<int64_t>{12, 64}));
        EXPECT_TRUE(rows.is_contiguous());
      }
      return at::cross_entropy_loss(rows, targets).reshape({1});
    };
  };
  ExpectClose(Differentiate(loss(true), x, w, b), Differentiate(loss(false), x, w, b), 1e-6);
  const at::Tensor plain = at::randn({4, 37});
  EXPECT_TRUE(PaddedForSoftmax(plain).is_same(plain));
  const at::Tensor narrowed = at::randn({4, 40}).narrow(1, 0, 37);  // not of a padded width
  EXPECT_TRUE(PaddedForSoftmax(narrowed).is_same(narrowed));
}

TEST(AlignedLinearTest, OnTheCpuItIsLinear) {
  const at::Tensor x = at::randn({3, 16}), w = at::randn({37, 16});
  at::Tensor y = AlignedLinear(x, w, at::Tensor());
  EXPECT_TRUE(y.is_contiguous());
  EXPECT_TRUE(at::equal(y, at::linear(x, w)));
}

}  // namespace
}  // namespace trident
