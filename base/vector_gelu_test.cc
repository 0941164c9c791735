#include <string>

#include <ATen/ops/gelu_cpu_dispatch.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "base/blas_kernels.h"

namespace trident {
namespace {

// LibTorch's own CPU kernel, called as the dispatcher would (below autograd).
at::Tensor LibTorchGelu(const at::Tensor& x, c10::string_view approximate) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return at::cpu::gelu(x, approximate);
}

// GELU and its gradient in fp64 through LibTorch's own formulas.
at::Tensor ReferenceGelu(const at::Tensor& x) { return at::gelu(x.to(at::kDouble)); }
at::Tensor ReferenceGrad(const at::Tensor& grad, const at::Tensor& x) {
  return at::gelu_backward(grad.to(at::kDouble), x.to(at::kDouble));
}

// |got - want| <= 1e-5 |want| + 2e-7 |scale| everywhere: fp32 rounding of
// terms as large as `scale` (x for GELU, the incoming gradient for its gradient).
void ExpectClose(const at::Tensor& got, const at::Tensor& want, const at::Tensor& scale, const std::string& what) {
  const at::Tensor excess = (got.to(at::kDouble) - want).abs() - 1e-5 * want.abs() - 2e-7 * scale.to(at::kDouble).abs();
  EXPECT_LE(excess.max().item<double>(), 0) << what;
}

TEST(VectorGeluTest, ForwardAndGradientMatchFp64EverywhereAndInEveryForm) {
  ASSERT_TRUE(UseVectorGelu());
  // Every regime (tails where Φ is tiny or 1, the middle, overflow-sized
  // inputs) and a length that leaves a partial last vector.
  const at::Tensor x = at::cat({at::linspace(-12, 12, 4001), at::tensor({-1e30f, -100.0f, 0.0f, 100.0f, 1e30f}),
                                at::randn({3, 37}).flatten()});
  const at::Tensor grad = at::randn(x.sizes());
  // These kernels, not LibTorch's (whose erf differs in the last bits somewhere).
  EXPECT_FALSE(at::equal(at::gelu(x), LibTorchGelu(x, "none")));
  ExpectClose(at::gelu(x), ReferenceGelu(x), x, "gelu");
  ExpectClose(at::gelu_backward(grad, x), ReferenceGrad(grad, x), grad, "gelu_backward");
  at::Tensor in_place = x.clone();
  at::gelu_(in_place);
  EXPECT_TRUE(at::equal(in_place, at::gelu(x)));
  at::Tensor into_grad = grad.clone();
  at::gelu_backward_out(into_grad, into_grad, x);
  EXPECT_TRUE(at::equal(into_grad, at::gelu_backward(grad, x)));
  // Through autograd, on a 3-D activation.
  const at::Tensor leaf = at::randn({4, 5, 33}).requires_grad_(true);
  at::gelu(leaf).backward(at::ones_like(leaf));
  const at::Tensor ones = at::ones_like(leaf);
  ExpectClose(leaf.grad(), ReferenceGrad(ones, leaf.detach()), ones, "autograd");
}

TEST(VectorGeluTest, OtherOperandsKeepLibTorchsKernels) {
  ASSERT_TRUE(UseVectorGelu());
  const at::Tensor x = at::randn({8, 6});
  // tanh approximation, strided input, fp64: LibTorch's kernels, bit for bit.
  EXPECT_TRUE(at::equal(at::gelu(x, "tanh"), LibTorchGelu(x, "tanh")));
  EXPECT_TRUE(at::equal(at::gelu(x.t()), LibTorchGelu(x.t(), "none")));
  const at::Tensor d = x.to(at::kDouble);
  EXPECT_TRUE(at::equal(at::gelu(d), LibTorchGelu(d, "none")));
}

}  // namespace
}  // namespace trident
