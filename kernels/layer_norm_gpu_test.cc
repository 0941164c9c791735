// The residual add + LayerNorm's CUDA kernels (needs a GPU; tagged gpu): the
// sum, the output and the gradients of x, the residual, the weight and the
// bias equal a float64 add and layer_norm's for fp32, autocast bf16, pure bf16
// and fp16, with and without a residual, weight and bias, on row counts that
// leave warps idle and that make backward's blocks loop; widths the kernels do
// not take go through ATen's kernels with the same results.
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "base/autocast_state.h"
#include "kernels/kernels.h"

namespace trident {
namespace {

double RelativeError(const at::Tensor& a, const at::Tensor& reference) {
  const at::Tensor r = reference.to(at::kDouble).cpu();
  return ((a.to(at::kDouble).cpu() - r).norm() / r.norm()).item<double>();
}

struct Case {
  std::string name;
  at::ScalarType x, residual;  // residual Undefined: none
  bool autocast;               // bf16 autocast around the fused call
  bool affine;
  int64_t rows, cols;
  double alpha;
  at::ScalarType out;  // the output type expected
  double tolerance;    // for results in a 16-bit type; fp32 results are held to 1e-5
};

struct Results {
  at::Tensor sum, out, grad_x, grad_residual, grad_weight, grad_bias;
};

// Runs the fused operator (or, with `reference`, add and layer_norm in
// float64) and backward from the fixed gradients of the sum and the output.
Results RunFusedOrReference(const Case& c, bool reference, const std::vector<at::Tensor>& inputs,
                            const at::Tensor& grad_sum, const at::Tensor& grad_out) {
  const bool has_residual = c.residual != at::ScalarType::Undefined;
  std::vector<at::Tensor> leaves;
  for (const at::Tensor& t : inputs) {
    leaves.push_back(t.defined() ? (reference ? t.to(at::kDouble) : t).detach().clone().requires_grad_(true)
                                 : at::Tensor());
  }
  const at::Tensor &x = leaves[0], &r = leaves[1], &w = leaves[2], &b = leaves[3];
  at::Tensor sum, out;
  if (reference) {
    sum = has_residual ? at::add(x, r, c.alpha) : x;
    out = at::layer_norm(sum, {c.cols}, w, b, 1e-5);
  } else {
    const AutocastState before = GetAutocastState(at::kCUDA);
    SetAutocastState(at::kCUDA, {c.autocast, at::kBFloat16});
    std::tie(sum, out) = FusedAddLayerNorm(x, r, c.alpha, {c.cols}, w, b, 1e-5);
    SetAutocastState(at::kCUDA, before);
  }
  Results results{sum.detach(), out.detach()};
  ((sum.to(at::kDouble) * grad_sum).sum() + (out.to(at::kDouble) * grad_out).sum()).backward();
  results.grad_x = x.grad();
  if (has_residual) results.grad_residual = r.grad();
  if (c.affine) results.grad_weight = w.grad(), results.grad_bias = b.grad();
  return results;
}

TEST(AddLayerNormGpuTest, EqualsAddThenLayerNormInFloat64) {
  ASSERT_TRUE(torch::cuda::is_available()) << "run gpu-tagged tests on a machine with a GPU";
  const auto none = at::ScalarType::Undefined;
  const at::ScalarType f32 = at::kFloat, bf16 = at::kBFloat16, f16 = at::kHalf;
  const std::vector<Case> cases = {
      {"fp32", f32, f32, false, true, 111, 768, 1.0, f32, 1e-5},
      {"fp32 many rows, alpha 0.5", f32, f32, false, true, 5000, 256, 0.5, f32, 1e-5},
      {"autocast bf16, bf16 residual", f32, bf16, true, true, 111, 768, 1.0, bf16, 1e-2},
      {"autocast bf16, no residual", f32, none, true, true, 5000, 768, 1.0, bf16, 1e-2},
      {"pure bf16", bf16, bf16, false, true, 111, 1024, 1.0, bf16, 1e-2},
      {"fp16, no affine", f16, f16, false, false, 37, 512, 1.0, f16, 2e-3},
      {"fp32 width 2048 (ATen)", f32, f32, false, true, 64, 2048, 1.0, f32, 1e-5},
      {"fp32 width 102 (ATen)", f32, none, false, true, 64, 102, 1.0, f32, 1e-5},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    at::manual_seed(5);
    const auto cuda = [](at::ScalarType t) { return at::TensorOptions(at::kCUDA).dtype(t); };
    const std::vector<int64_t> shape = {c.rows, c.cols};
    const at::ScalarType param = c.x;  // parameters in x's type: fp32, or pure bf16's and fp16's own
    std::vector<at::Tensor> inputs = {
        (at::randn(shape, cuda(f32)) * 2 + 0.5).to(c.x),
        c.residual == none ? at::Tensor() : at::randn(shape, cuda(f32)).to(c.residual),
        c.affine ? (at::randn({c.cols}, cuda(f32)) * 0.2 + 1).to(param) : at::Tensor(),
        c.affine ? (at::randn({c.cols}, cuda(f32)) * 0.1).to(param) : at::Tensor(),
    };
    // Gradients the fused types can hold exactly, so both runs start from the same values.
    const at::Tensor grad_sum = at::randn(shape, cuda(f32)).to(c.x).to(at::kDouble);
    const at::Tensor grad_out = at::randn(shape, cuda(f32)).to(c.out).to(at::kDouble);
    const Results fused = RunFusedOrReference(c, false, inputs, grad_sum, grad_out),
                  want = RunFusedOrReference(c, true, inputs, grad_sum, grad_out);
    const auto tolerance = [&](const at::Tensor& t) { return t.scalar_type() == f32 ? 1e-5 : c.tolerance; };
    EXPECT_EQ(fused.out.scalar_type(), c.out);
    EXPECT_EQ(fused.sum.scalar_type(), c.x);
    EXPECT_LT(RelativeError(fused.sum, want.sum), tolerance(fused.sum));
    EXPECT_LT(RelativeError(fused.out, want.out), tolerance(fused.out));
    ASSERT_TRUE(fused.grad_x.defined());
    EXPECT_EQ(fused.grad_x.scalar_type(), c.x);
    EXPECT_LT(RelativeError(fused.grad_x, want.grad_x), tolerance(fused.grad_x));
    if (c.residual != none) {
      EXPECT_EQ(fused.grad_residual.scalar_type(), c.residual);
      EXPECT_LT(RelativeError(fused.grad_residual, want.grad_residual), tolerance(fused.grad_residual));
    }
    if (c.affine) {
      EXPECT_LT(RelativeError(fused.grad_weight, want.grad_weight), tolerance(fused.grad_weight));
      EXPECT_LT(RelativeError(fused.grad_bias, want.grad_bias), tolerance(fused.grad_bias));
    }
  }
}

// Only the sum used (no gradient reaches the output), and only the output.
TEST(AddLayerNormGpuTest, EitherOutputAloneGetsItsGradient) {
  ASSERT_TRUE(torch::cuda::is_available());
  at::manual_seed(6);
  const at::Tensor x0 = at::randn({40, 256}, at::kCUDA), r0 = at::randn({40, 256}, at::kCUDA),
                   w = at::randn({256}, at::kCUDA);
  for (const int used : {0, 1}) {
    at::Tensor x = x0.clone().requires_grad_(true), r = r0.clone().requires_grad_(true);
    auto [sum, out] = FusedAddLayerNorm(x, r, 2.0, {256}, w, at::Tensor(), 1e-5);
    (used == 0 ? sum : out).sum().backward();
    at::Tensor xd = x0.to(at::kDouble).requires_grad_(true), rd = r0.to(at::kDouble).requires_grad_(true);
    at::Tensor sum_d = xd + 2.0 * rd;
    (used == 0 ? sum_d : at::layer_norm(sum_d, {256}, w.to(at::kDouble))).sum().backward();
    EXPECT_LT(RelativeError(x.grad(), xd.grad()), 1e-5) << "output " << used;
    EXPECT_LT(RelativeError(r.grad(), rd.grad()), 1e-5) << "output " << used;
  }
}

}  // namespace
}  // namespace trident
