// Launchers of the residual add + LayerNorm's CUDA kernels (layer_norm_cuda.cu),
// built only where CUDA is (the CMake GPU build); layer_norm_cuda.cc registers
// them as the CUDA kernels of trident::add_layer_norm_rows and its backward.
//
// Tensors are `rows` contiguous rows of `cols` values; every pointer is a
// device pointer aligned to 16 bytes; weight and bias are fp32 (null: 1 and
// 0). The kernels run on `stream` and return without waiting.
#ifndef TRIDENT_KERNELS_INTERNAL_LAYER_NORM_CUDA_H_
#define TRIDENT_KERNELS_INTERNAL_LAYER_NORM_CUDA_H_

#include <cstdint>

#include "kernels/internal/cuda_dtype.h"

namespace trident {

// The element types of x (and of the sum), of the residual, and of the
// normalized output.
struct AddLayerNormDtypes {
  CudaDtype x, residual, out;
};

// The widest row the kernels take (each lane of a warp holds a row's values
// in registers: 8 steps of 4).
constexpr int64_t kAddLayerNormMaxCols = 1024;

// Whether the kernels take these types and this width (else the caller
// composes ATen's kernels): cols a multiple of 4 up to kAddLayerNormMaxCols;
// x fp32 with any residual and output type, or all three of one type.
inline bool AddLayerNormTakes(const AddLayerNormDtypes& dtypes, int64_t cols) {
  return cols > 0 && cols % 4 == 0 && cols <= kAddLayerNormMaxCols &&
         (dtypes.x == CudaDtype::kFloat || (dtypes.residual == dtypes.x && dtypes.out == dtypes.x));
}

// sum = x + alpha * residual (written only when residual is not null; without
// one the sum is x), rounded to x's type; out = (sum - mean) * rstd * weight +
// bias in out's type; mean and rstd in fp32, one per row.
void LaunchAddLayerNorm(const AddLayerNormDtypes& dtypes, const void* x, const void* residual, float alpha,
                        const float* weight, const float* bias, float eps, int64_t rows, int64_t cols, void* sum,
                        void* out, float* mean, float* rstd, CUstream_st* stream);

// How many blocks backward runs for these types and rows (as many as the GPU
// holds at once, at most one per 4 rows): the rows of its partial weight and
// bias sums.
int AddLayerNormBackwardBlocks(const AddLayerNormDtypes& dtypes, int64_t rows);

// grad_x = LayerNorm's input gradient for grad_out (+ grad_sum, when not
// null), in x's type; grad_residual (when not null) = alpha * grad_x in the
// residual's type. partial_weight and partial_bias (when not null) get
// [AddLayerNormBackwardBlocks(dtypes, rows), cols] fp32 sums of grad_out * xhat and of
// grad_out over each block's rows; their sums over blocks are the weight's and
// bias's gradients.
void LaunchAddLayerNormBackward(const AddLayerNormDtypes& dtypes, const void* sum, const void* grad_out,
                                const void* grad_sum, const float* mean, const float* rstd, const float* weight,
                                float alpha, int64_t rows, int64_t cols, void* grad_x, void* grad_residual,
                                float* partial_weight, float* partial_bias, CUstream_st* stream);

}  // namespace trident

#endif  // TRIDENT_KERNELS_INTERNAL_LAYER_NORM_CUDA_H_
