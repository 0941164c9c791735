#include <gtest/gtest.h>
#include <torch/torch.h>

#include "kernels/kernels.h"

namespace trident {
namespace {

// The products against the same products in fp64, for every layout oneDNN
// takes (rows, columns, row-sliced) and some it leaves to LibTorch.
class OneDnnProductsTest : public ::testing::Test {
 protected:
  // Whether the products go through oneDNN; not with PyTorch's own LibTorch
  // builds (the GPU machines), which link it hidden: there LibTorch's kernels
  // are what these tests check.
  static void Use() {
    EXPECT_EQ(UseOneDnnProducts(), OneDnnProductsInUse());
    // Debian's LibTorch (OpenBLAS's) links libdnnl where it can be found.
    if (!BlasCoreName().empty()) {
      EXPECT_TRUE(OneDnnProductsInUse());
    }
  }
  static void ExpectClose(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
    ASSERT_EQ(got.sizes(), want.sizes()) << what;
    ASSERT_EQ(got.scalar_type(), at::kFloat) << what;
    EXPECT_TRUE(at::allclose(got.to(at::kDouble), want, 1e-4, 1e-4))
        << what << ": off by " << (got.to(at::kDouble) - want).abs().max().item<double>();
  }
};

TEST_F(OneDnnProductsTest, MatchFp64InEveryLayout) {
  Use();
  torch::manual_seed(0);
  const at::Tensor a = at::randn({37, 53}), b = at::randn({53, 29}), bias = at::randn({29});
  const at::Tensor a64 = a.to(at::kDouble), b64 = b.to(at::kDouble), bias64 = bias.to(at::kDouble);
  const at::Tensor want = at::mm(a64, b64);
  ExpectClose(at::mm(a, b), want, "rows x rows");
  ExpectClose(at::mm(a.t().contiguous().t(), b), want, "columns x rows");
  ExpectClose(at::mm(a, b.t().contiguous().t()), want, "rows x columns");
  const at::Tensor wide = at::randn({37, 80});
  wide.narrow(1, 10, 53).copy_(a);
  ExpectClose(at::mm(wide.narrow(1, 10, 53), b), want, "a row slice of a wider matrix");
  const at::Tensor strided = at::randn({74, 106}).slice(0, 0, 74, 2).slice(1, 0, 106, 2).copy_(a);
  ExpectClose(at::mm(strided, b), want, "neither rows nor columns (LibTorch's kernel)");
  ExpectClose(at::addmm(bias, a, b), want + bias64, "addmm with a broadcast bias");
  ExpectClose(at::addmm(bias, a, b, 0.5, 2.0), 2.0 * want + 0.5 * bias64, "addmm with beta and alpha");
  ExpectClose(at::addmm(bias, a, b, 0.0, 1.0), want, "addmm with beta 0");
  at::Tensor accumulated = at::ones({37, 29});
  accumulated.addmm_(a, b);
  ExpectClose(accumulated, want + 1.0, "addmm_ in place");
  at::Tensor out = at::empty({37, 29});
  at::mm_out(out, a, b);
  ExpectClose(out, want, "mm.out");
  at::addmm_out(out, bias, a, b);
  ExpectClose(out, want + bias64, "addmm.out");
  at::Tensor columns = at::empty({29, 37}).t();  // not row-major: LibTorch's kernel
  at::addmm_out(columns, bias, a, b);
  ExpectClose(columns, want + bias64, "addmm.out into a column-major output");
  const at::Tensor square = at::randn({16, 16});
  at::Tensor aliased = square.clone();
  aliased.addmm_(aliased, square);  // the output is a factor: LibTorch's kernel
  ExpectClose(aliased, square.to(at::kDouble) + at::mm(square.to(at::kDouble), square.to(at::kDouble)),
              "addmm_ of a tensor with itself");
  const at::Tensor half = at::mm(a.to(at::kBFloat16), b.to(at::kBFloat16));  // LibTorch's bf16 path
  EXPECT_TRUE(at::allclose(half.to(at::kDouble), want, 0.1, 0.5));
}

TEST_F(OneDnnProductsTest, BatchedProductsMatchFp64) {
  Use();
  torch::manual_seed(1);
  const at::Tensor q = at::randn({6, 17, 8}), k = at::randn({6, 17, 8});
  const at::Tensor want = at::bmm(q.to(at::kDouble), k.to(at::kDouble).transpose(1, 2));
  ExpectClose(at::bmm(q, k.transpose(1, 2)), want, "q k^T, the second factor transposed");
  ExpectClose(at::bmm(q.transpose(0, 1).contiguous().transpose(0, 1), k.transpose(1, 2)), want,
              "a batch dimension that is not the outermost");
  const at::Tensor shared = at::randn({1, 8, 5}).expand({6, 8, 5});
  ExpectClose(at::bmm(q, shared), at::bmm(q.to(at::kDouble), shared.to(at::kDouble)),
              "a factor broadcast over the batch");
}

// A linear layer's forward with enough rows runs one block of rows per
// intra-op thread: every thread count and a row count that does not divide
// give the product, and the blocks are the rows one call would give.
TEST_F(OneDnnProductsTest, RowBlocksPerThreadMatchFp64) {
  Use();
  torch::manual_seed(3);
  const at::Tensor x = at::randn({389, 96}), weight = at::randn({40, 96}), bias = at::randn({40});
  const at::Tensor want = at::addmm(bias.to(at::kDouble), x.to(at::kDouble), weight.to(at::kDouble).t());
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  const at::Tensor one_thread = at::addmm(bias, x, weight.t());
  for (int n : {1, 2, 3}) {
    at::set_num_threads(n);
    const at::Tensor got = at::addmm(bias, x, weight.t());
    ExpectClose(got, want, "addmm on " + std::to_string(n) + " threads");
    if (OneDnnProductsInUse()) {
      EXPECT_TRUE(at::equal(got, one_thread)) << n << " threads";
    }
    ExpectClose(at::mm(x, weight.t()), want - bias.to(at::kDouble), "mm on " + std::to_string(n) + " threads");
  }
  at::set_num_threads(threads);
}

// Linear layers train the same: a small MLP's weight gradients against fp64.
TEST_F(OneDnnProductsTest, LinearGradientsMatchFp64) {
  Use();
  torch::manual_seed(2);
  std::vector<at::Tensor> weights = {at::randn({40, 24}), at::randn({40}), at::randn({8, 40}), at::randn({8})};
  const at::Tensor x = at::randn({33, 24});
  auto gradients = [&](at::ScalarType dtype) {
    std::vector<at::Tensor> leaves;
    for (const at::Tensor& w : weights)
      leaves.push_back(w.to(dtype, /*non_blocking=*/false, /*copy=*/true).requires_grad_(true));
    const at::Tensor hidden = at::gelu(at::linear(x.to(dtype), leaves[0], leaves[1]));
    at::linear(hidden, leaves[2], leaves[3]).pow(2).sum().backward();
    return std::vector<at::Tensor>{leaves[0].grad(), leaves[2].grad()};
  };
  const std::vector<at::Tensor> got = gradients(at::kFloat), want = gradients(at::kDouble);
  ExpectClose(got[0], want[0], "the first layer's weight gradient");
  ExpectClose(got[1], want[1], "the second layer's weight gradient");
}

}  // namespace
}  // namespace trident
