// The CUDA kernels of trident::cross_entropy_rows and its backward (the CMake
// GPU build compiles this file with cross_entropy_cuda.cu).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "kernels/internal/cross_entropy_cuda.h"
#include "kernels/internal/cuda_dtype_of.h"

namespace trident {
namespace {

CudaDtype DtypeOf(const at::Tensor& logits) {
  CudaDtype dtype;
  TORCH_CHECK(CudaDtypeOf(logits.scalar_type(), &dtype),
              "trident::cross_entropy on CUDA takes float, bfloat16 or half logits; got ", logits.scalar_type());
  return dtype;
}

// Rows of contiguous values (any row stride), and int64 targets, one per row.
at::Tensor Rows(const at::Tensor& logits, const at::Tensor& targets) {
  TORCH_CHECK(logits.dim() == 2 && targets.dim() == 1 && targets.size(0) == logits.size(0),
              "trident::cross_entropy takes logits [N, C] and targets [N]; got ", logits.sizes(), " and ",
              targets.sizes());
  return logits.stride(1) == 1 ? logits : logits.contiguous();
}

std::tuple<at::Tensor, at::Tensor> CrossEntropyRowsCuda(const at::Tensor& logits, const at::Tensor& targets,
                                                        int64_t ignore_index) {
  const c10::cuda::CUDAGuard guard(logits.device());
  const at::Tensor rows = Rows(logits, targets), ids = targets.to(at::kLong).contiguous();
  at::Tensor lse = at::empty({rows.size(0)}, rows.options().dtype(at::kFloat)), loss = at::empty_like(lse);
  LaunchCrossEntropyRows(DtypeOf(rows), rows.data_ptr(), rows.size(0), rows.size(1), rows.stride(0),
                         ids.data_ptr<int64_t>(), ignore_index, lse.data_ptr<float>(), loss.data_ptr<float>(),
                         c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {lse, loss};
}

at::Tensor CrossEntropyRowsBackwardCuda(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse,
                                        const at::Tensor& scale, int64_t ignore_index) {
  const c10::cuda::CUDAGuard guard(logits.device());
  const at::Tensor rows = Rows(logits, targets), ids = targets.to(at::kLong).contiguous();
  const at::Tensor row_lse = lse.to(at::kFloat).contiguous(), scale32 = scale.to(at::kFloat).reshape({1});
  at::Tensor grad = at::empty(rows.sizes(), rows.options());
  LaunchCrossEntropyRowsBackward(DtypeOf(rows), rows.data_ptr(), rows.size(0), rows.size(1), rows.stride(0),
                                 ids.data_ptr<int64_t>(), ignore_index, row_lse.data_ptr<float>(),
                                 scale32.data_ptr<float>(), grad.data_ptr(), c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return grad;
}

}  // namespace

TORCH_LIBRARY_IMPL(trident, CUDA, m) {
  m.impl("cross_entropy_rows", CrossEntropyRowsCuda);
  m.impl("cross_entropy_rows_backward", CrossEntropyRowsBackwardCuda);
}

}  // namespace trident
