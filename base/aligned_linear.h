// Linear products whose output rows start at aligned addresses.
//
// cuBLAS runs its fast (Hopper, tensor-core) matrix-product kernels only when
// every matrix's leading dimension is a multiple of 16 bytes. A language
// model's head has an odd width (GPT-2's vocabulary: 50,257), so its three
// products ran on a fallback kernel: on an H200, 15.4 of a gpt2-124m bf16
// step's 40 ms of kernels. AlignedLinear computes the product with the weight
// padded by zero rows to a multiple of 64 and returns the first
// out_features columns: the same values, the padded products, and gradients
// that are those of at::linear (the pad's gradient is dropped).
#ifndef TRIDENT_BASE_ALIGNED_LINEAR_H_
#define TRIDENT_BASE_ALIGNED_LINEAR_H_

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace trident {

// at::linear(x, weight, bias) (bias may be undefined). On CUDA, where
// weight.size(0) is not a multiple of kAlignedWidth, the product runs padded
// and the result is a view of the padded output (rows of the padded width).
at::Tensor AlignedLinear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias);

inline constexpr int64_t kAlignedWidth = 64;

// For a softmax (or cross-entropy) over the last dimension of `x`. Where `x`
// is a result of AlignedLinear or PaddedLinear (a view of the first columns of
// the padded product, possibly reshaped), the padded product, contiguous,
// with its pad columns set to -inf in place: its softmax is x's with zeros
// appended, and a gradient flows to the product without the view's strided
// copies. Otherwise `x` itself. The test is of layout alone (x the first
// columns of a contiguous base whose width is x's rounded up to
// kAlignedWidth), so give it only results of those two: any such base's
// columns past x are overwritten.
at::Tensor PaddedForSoftmax(const at::Tensor& x);

// The padded product itself, on any device: `width` >= weight.size(0) output
// columns computed, the first weight.size(0) returned. Under autocast the
// weight is cast before it is padded.
at::Tensor PaddedLinear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, int64_t width);

}  // namespace trident

#endif  // TRIDENT_BASE_ALIGNED_LINEAR_H_
