// The CUDA kernels of trident::add_layer_norm_rows and its backward (the CMake
// GPU build compiles this file with layer_norm_cuda.cu). Outputs the caller did
// not ask for are empty tensors.
#include <cstdint>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "kernels/internal/cuda_dtype_of.h"
#include "kernels/internal/layer_norm_cuda.h"

namespace trident {
namespace {

CudaDtype DtypeOf(at::ScalarType type) {
  CudaDtype dtype;
  TORCH_CHECK(CudaDtypeOf(type, &dtype), "trident::add_layer_norm_rows takes float, bfloat16 or half; got ", type);
  return dtype;
}

// t contiguous and 16-byte aligned (a copy when it is not).
at::Tensor Aligned(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 == 0 ? c : c.clone();
}

// A present weight or bias in fp32, as the kernels read it; else undefined.
at::Tensor Float(const c10::optional<at::Tensor>& t) {
  return t && t->defined() ? Aligned(t->to(at::kFloat)) : at::Tensor();
}

const float* FloatData(const at::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }
void* DataOrNull(const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

AddLayerNormDtypes Dtypes(at::ScalarType x, at::ScalarType residual, at::ScalarType out, int64_t cols) {
  const AddLayerNormDtypes dtypes{DtypeOf(x), DtypeOf(residual), DtypeOf(out)};
  TORCH_CHECK(AddLayerNormTakes(dtypes, cols), "trident::add_layer_norm_rows has no CUDA kernel for x ", x,
              ", residual ", residual, ", output ", out, " and rows of ", cols);
  return dtypes;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> AddLayerNormRowsCuda(
    const at::Tensor& x0, const c10::optional<at::Tensor>& residual0, double alpha,
    const c10::optional<at::Tensor>& weight0, const c10::optional<at::Tensor>& bias0, double eps,
    at::ScalarType out_dtype) {
  const c10::cuda::CUDAGuard guard(x0.device());
  TORCH_CHECK(x0.dim() >= 1 && x0.numel() > 0, "trident::add_layer_norm_rows takes rows; got ", x0.sizes());
  const bool has_residual = residual0 && residual0->defined();
  TORCH_CHECK(!has_residual || residual0->sizes() == x0.sizes(), "trident::add_layer_norm_rows: x ", x0.sizes(),
              " and residual ", residual0->sizes(), " must have one shape");
  const at::Tensor x = Aligned(x0), residual = has_residual ? Aligned(*residual0) : at::Tensor();
  const int64_t cols = x.size(-1), rows = x.numel() / cols;
  const AddLayerNormDtypes dtypes =
      Dtypes(x.scalar_type(), has_residual ? residual.scalar_type() : x.scalar_type(), out_dtype, cols);
  const at::Tensor weight = Float(weight0), bias = Float(bias0);
  at::Tensor sum = has_residual ? at::empty(x.sizes(), x.options()) : at::empty({0}, x.options());
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(out_dtype));
  at::Tensor mean = at::empty({rows}, x.options().dtype(at::kFloat)), rstd = at::empty_like(mean);
  LaunchAddLayerNorm(dtypes, x.data_ptr(), DataOrNull(residual), static_cast<float>(alpha), FloatData(weight),
                     FloatData(bias), static_cast<float>(eps), rows, cols, has_residual ? sum.data_ptr() : nullptr,
                     out.data_ptr(), mean.data_ptr<float>(), rstd.data_ptr<float>(), c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {sum, out, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> AddLayerNormRowsBackwardCuda(
    const at::Tensor& sum0, const at::Tensor& grad_out0, const c10::optional<at::Tensor>& grad_sum0,
    const at::Tensor& mean0, const at::Tensor& rstd0, const c10::optional<at::Tensor>& weight0, double alpha,
    c10::optional<at::ScalarType> residual_dtype, bool weight_grad, bool bias_grad) {
  const c10::cuda::CUDAGuard guard(sum0.device());
  TORCH_CHECK(grad_out0.sizes() == sum0.sizes() && sum0.numel() > 0,
              "trident::add_layer_norm_rows_backward: the output's gradient ", grad_out0.sizes(),
              " must have the sum's shape ", sum0.sizes());
  const at::Tensor sum = Aligned(sum0), grad_out = Aligned(grad_out0);
  const bool has_grad_sum = grad_sum0 && grad_sum0->defined();
  const at::Tensor grad_sum = has_grad_sum ? Aligned(grad_sum0->to(sum.scalar_type())) : at::Tensor();
  const at::Tensor mean = Aligned(mean0.to(at::kFloat)), rstd = Aligned(rstd0.to(at::kFloat));
  const int64_t cols = sum.size(-1), rows = sum.numel() / cols;
  const AddLayerNormDtypes dtypes =
      Dtypes(sum.scalar_type(), residual_dtype.value_or(sum.scalar_type()), grad_out.scalar_type(), cols);
  const at::Tensor weight = Float(weight0);
  at::Tensor grad_x = at::empty(sum.sizes(), sum.options());
  at::Tensor grad_residual =
      residual_dtype ? at::empty(sum.sizes(), sum.options().dtype(*residual_dtype)) : at::empty({0}, sum.options());
  const int blocks = AddLayerNormBackwardBlocks(dtypes, rows);
  const auto partial = [&](bool wanted) {
    return wanted ? at::empty({blocks, cols}, sum.options().dtype(at::kFloat)) : at::Tensor();
  };
  at::Tensor partial_weight = partial(weight_grad), partial_bias = partial(bias_grad);
  LaunchAddLayerNormBackward(dtypes, sum.data_ptr(), grad_out.data_ptr(), DataOrNull(grad_sum), mean.data_ptr<float>(),
                             rstd.data_ptr<float>(), FloatData(weight), static_cast<float>(alpha), rows, cols,
                             grad_x.data_ptr(), residual_dtype ? grad_residual.data_ptr() : nullptr,
                             weight_grad ? partial_weight.data_ptr<float>() : nullptr,
                             bias_grad ? partial_bias.data_ptr<float>() : nullptr, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const auto total = [&](const at::Tensor& p) { return p.defined() ? p.sum(0) : at::empty({0}, mean.options()); };
  return {grad_x, grad_residual, total(partial_weight), total(partial_bias)};
}

}  // namespace

TORCH_LIBRARY_IMPL(trident, CUDA, m) {
  m.impl("add_layer_norm_rows", AddLayerNormRowsCuda);
  m.impl("add_layer_norm_rows_backward", AddLayerNormRowsBackwardCuda);
}

}  // namespace trident
