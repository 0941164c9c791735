// AlignedLinear on CUDA (needs a GPU; tagged gpu): the padded product gives
// linear's values and gradients, in fp32 and under bf16 autocast.
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

// The output and the gradients under the loss sum(y * probe).
template <typename Product>
Result Differentiate(Product product, const at::Tensor& x0, const at::Tensor& w0, const at::Tensor& b0,
                     const at::Tensor& probe) {
  at::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true),
             b = b0.clone().requires_grad_(true);
  at::Tensor y = product(x, w, b);
  (y.to(probe.scalar_type()) * probe).sum().backward();
  return {y.detach().to(at::kFloat), x.grad(), w.grad(), b.grad()};
}

double RelativeError(const at::Tensor& a, const at::Tensor& reference) {
  return ((a.to(at::kDouble) - reference.to(at::kDouble)).norm() / reference.to(at::kDouble).norm()).item<double>();
}

TEST(AlignedLinearGpuTest, OddWidthsGiveLinearsValuesAndGradients) {
  ASSERT_TRUE(torch::cuda::is_available()) << "run gpu-tagged tests on a machine with a GPU";
  for (const bool bf16 : {false, true}) {
    at::manual_seed(3);
    const at::Tensor x = at::randn({4, 256, 96}, at::kCUDA), w = at::randn({1001, 96}, at::kCUDA) * 0.1,
                     b = at::randn({1001}, at::kCUDA);
    at::Tensor view = AlignedLinear(x, w, b);
    EXPECT_EQ(view.size(-1), 1001);
    EXPECT_EQ(view.stride(-2), 1024);  // rows of the padded width
    const at::Tensor probe = at::randn({4, 256, 1001}, at::kCUDA);
    const Result reference =
        Differentiate([](auto x, auto w, auto b) { return at::linear(x, w, b); }, x.to(at::kDouble), w.to(at::kDouble),
                      b.to(at::kDouble), probe.to(at::kDouble));
    const AutocastState before = GetAutocastState(at::kCUDA);
    if (bf16) SetAutocastState(at::kCUDA, {true, at::kBFloat16});
    const Result aligned = Differentiate([](auto x, auto w, auto b) { return AlignedLinear(x, w, b); }, x, w, b, probe);
    SetAutocastState(at::kCUDA, before);
    at::autocast::clear_cache();
    const double tolerance = bf16 ? 1e-2 : 1e-5;
    EXPECT_LT(RelativeError(aligned.y, reference.y), tolerance) << "bf16 " << bf16;
    EXPECT_LT(RelativeError(aligned.dx, reference.dx), tolerance) << "bf16 " << bf16;
    EXPECT_LT(RelativeError(aligned.dw, reference.dw), tolerance) << "bf16 " << bf16;
    EXPECT_LT(RelativeError(aligned.db, reference.db), tolerance) << "bf16 " << bf16;
  }
}

// A cross-entropy over the padded product (PaddedForSoftmax) gives the
// loss and the weight's gradient of one over the plain product.
TEST(AlignedLinearGpuTest, CrossEntropyOverThePaddedProduct) {
  ASSERT_TRUE(torch::cuda::is_available()) << "run gpu-tagged tests on a machine with a GPU";
  at::manual_seed(4);
  const at::Tensor x = at::randn({2, 128, 64}, at::kCUDA), w0 = at::randn({1001, 64}, at::kCUDA) * 0.1;
  const at::Tensor targets = at::randint(0, 1001, {256}, at::TensorOptions().dtype(at::kLong).device(at::kCUDA));
  auto loss_and_gradient = [&](bool aligned) {
    at::Tensor w = w0.clone().requires_grad_(true);
    at::Tensor rows =
        aligned ? AlignedLinear(x, w, at::Tensor()).reshape({-1, 1001}) : at::linear(x, w).reshape({-1, 1001});
    if (aligned) {
      rows = PaddedForSoftmax(rows);
      EXPECT_EQ(rows.size(1), 1024);
    }
    at::Tensor loss = at::cross_entropy_loss(rows, targets);
    loss.backward();
    return std::make_pair(loss.detach(), w.grad());
  };
  const auto [loss, grad] = loss_and_gradient(true);
  const auto [reference_loss, reference_grad] = loss_and_gradient(false);
  EXPECT_LT(RelativeError(loss, reference_loss), 1e-5);
  EXPECT_LT(RelativeError(grad, reference_grad), 1e-5);
}

}  // namespace
}  // namespace trident
