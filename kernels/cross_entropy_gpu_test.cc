// The fused cross-entropy's CUDA kernels (needs a GPU; tagged gpu): the loss and
// the logits' gradient equal cross_entropy's in float64, for fp32, bf16 and fp16
// logits, ignored rows, rows strided past their width, and the -inf pad
// columns of an aligned head product.
#include <cmath>
#include <limits>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "kernels/kernels.h"

namespace trident {
namespace {

namespace F = torch::nn::functional;
constexpr int64_t kIgnore = -100;

double RelativeError(const at::Tensor& a, const at::Tensor& reference) {
  const at::Tensor r = reference.to(at::kDouble).cpu();
  return ((a.to(at::kDouble).cpu() - r).norm() / r.norm()).item<double>();
}

struct LossAndGrad {
  at::Tensor loss, grad;
};

// The loss and d(2.5 loss)/d(logits) (a gradient other than one reaches the kernel).
template <typename Loss>
LossAndGrad Differentiate(Loss loss_fn, const at::Tensor& logits0, const at::Tensor& targets) {
  at::Tensor logits = logits0.detach().clone().requires_grad_(true);
  at::Tensor loss = loss_fn(logits, targets);
  (loss * 2.5).backward();
  return {loss.detach(), logits.grad()};
}

LossAndGrad Reference(const at::Tensor& logits, const at::Tensor& targets) {
  return Differentiate(
      [](const at::Tensor& x, const at::Tensor& t) {
        return F::cross_entropy(x, t, F::CrossEntropyFuncOptions().ignore_index(kIgnore));
      },
      logits.to(at::kDouble), targets);
}

LossAndGrad Fused(const at::Tensor& logits, const at::Tensor& targets) {
  return Differentiate([](const at::Tensor& x, const at::Tensor& t) { return FusedCrossEntropy(x, t, kIgnore); },
                       logits, targets);
}

// Targets in [0, classes) with every fifth row ignored.
at::Tensor Targets(int64_t rows, int64_t classes) {
  at::Tensor targets = at::randint(classes, {rows}, at::TensorOptions(at::kCUDA).dtype(at::kLong));
  return targets.index_fill_(0, at::arange(0, rows, 5, targets.options()), kIgnore);
}

TEST(CrossEntropyGpuTest, EqualsCrossEntropyForEachPrecisionAndLayout) {
  ASSERT_TRUE(torch::cuda::is_available()) << "run gpu-tagged tests on a machine with a GPU";
  struct Case {
    at::ScalarType dtype;
    int64_t classes, row_stride;  // row_stride > classes: a view of the first columns
    double grad_tolerance;
  };
  for (const Case& c : {Case{at::kFloat, 1000, 1000, 1e-5}, Case{at::kFloat, 1024, 1088, 1e-5},
                        Case{at::kFloat, 1001, 1003, 1e-5}, Case{at::kBFloat16, 50304, 50304, 1e-2},
                        Case{at::kBFloat16, 1000, 1024, 1e-2}, Case{at::kHalf, 4096, 4096, 2e-3}}) {
    SCOPED_TRACE(testing::Message() << c.dtype << " classes " << c.classes << " row stride " << c.row_stride);
    at::manual_seed(7);
    const int64_t rows = 96;
    const at::Tensor logits = (at::randn({rows, c.row_stride}, at::kCUDA) * 4).to(c.dtype).narrow(1, 0, c.classes);
    const at::Tensor targets = Targets(rows, c.classes);
    const LossAndGrad reference = Reference(logits, targets), fused = Fused(logits, targets);
    EXPECT_EQ(fused.loss.scalar_type(), at::kFloat);
    EXPECT_EQ(fused.grad.scalar_type(), c.dtype);
    EXPECT_LT(RelativeError(fused.loss, reference.loss), 1e-5);
    EXPECT_LT(RelativeError(fused.grad, reference.grad), c.grad_tolerance);
    // Ignored rows get no gradient.
    EXPECT_EQ(fused.grad.index_select(0, at::arange(0, rows, 5, targets.options())).abs().max().item<float>(), 0);
  }
}

TEST(CrossEntropyGpuTest, ReadsAnAlignedHeadProductWithItsPadColumns) {
  ASSERT_TRUE(torch::cuda::is_available());
  at::manual_seed(11);
  const at::Tensor x0 = at::randn({64, 96}, at::kCUDA), w0 = at::randn({1001, 96}, at::kCUDA) * 0.1,
                   b0 = at::randn({1001}, at::kCUDA);
  const at::Tensor targets = Targets(64, 1001);
  at::Tensor grads[2][3];
  at::Tensor losses[2];
  for (const bool fused : {false, true}) {
    at::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true),
               b = b0.clone().requires_grad_(true);
    if (fused) {
      losses[1] = FusedCrossEntropy(PaddedForSoftmax(AlignedLinear(x, w, b)), targets, kIgnore);
    } else {
      losses[0] = F::cross_entropy(at::linear(x.to(at::kDouble), w.to(at::kDouble), b.to(at::kDouble)), targets,
                                   F::CrossEntropyFuncOptions().ignore_index(kIgnore));
    }
    losses[fused].backward();
    grads[fused][0] = x.grad(), grads[fused][1] = w.grad(), grads[fused][2] = b.grad();
  }
  EXPECT_LT(RelativeError(losses[1], losses[0]), 1e-5);
  for (int i = 0; i < 3; ++i) EXPECT_LT(RelativeError(grads[1][i], grads[0][i]), 1e-5) << "gradient " << i;
}

TEST(CrossEntropyGpuTest, ANotANumberReachesTheLoss) {
  ASSERT_TRUE(torch::cuda::is_available());
  at::Tensor logits = at::randn({8, 512}, at::kCUDA).to(at::kBFloat16);
  logits[3][100] = std::numeric_limits<float>::quiet_NaN();
  const at::Tensor targets = at::zeros({8}, at::TensorOptions(at::kCUDA).dtype(at::kLong));
  EXPECT_TRUE(std::isnan(FusedCrossEntropy(logits, targets, kIgnore).item<float>()));
}

}  // namespace
}  // namespace trident
