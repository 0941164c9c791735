// Launchers of the fused cross-entropy's CUDA kernels (cross_entropy_cuda.cu),
// built only where CUDA is (the CMake GPU build); cross_entropy_cuda.cc
// registers them as the CUDA kernels of trident::cross_entropy_rows and
// trident::cross_entropy_rows_backward.
//
// Logits are `rows` rows of `cols` values, row r at logits + r * stride, of
// element type `dtype`; targets are int64 class ids, `ignore_index` marks rows
// that do not count. All pointers are device pointers; the kernels run on
// `stream` and return without waiting.
#ifndef TRIDENT_KERNELS_INTERNAL_CROSS_ENTROPY_CUDA_H_
#define TRIDENT_KERNELS_INTERNAL_CROSS_ENTROPY_CUDA_H_

#include <cstdint>

#include "kernels/internal/cuda_dtype.h"

namespace trident {

// lse[r] = log(sum_j exp(logits[r][j])) in fp32; loss[r] = lse[r] -
// logits[r][targets[r]] (0 on ignored rows, NaN for a target outside [0, cols)).
void LaunchCrossEntropyRows(CudaDtype dtype, const void* logits, int64_t rows, int64_t cols, int64_t stride,
                            const int64_t* targets, int64_t ignore_index, float* lse, float* loss, CUstream_st* stream);

// grad[r][j] = (exp(logits[r][j] - lse[r]) - (j == targets[r])) * scale[0],
// zero on ignored rows; grad is contiguous [rows, cols] of element type `dtype`.
void LaunchCrossEntropyRowsBackward(CudaDtype dtype, const void* logits, int64_t rows, int64_t cols, int64_t stride,
                                    const int64_t* targets, int64_t ignore_index, const float* lse, const float* scale,
                                    void* grad, CUstream_st* stream);

}  // namespace trident

#endif  // TRIDENT_KERNELS_INTERNAL_CROSS_ENTROPY_CUDA_H_
