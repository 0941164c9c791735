// The element types kernels/' CUDA kernels take, named without CUDA's or
// ATen's headers (the launchers' headers are included from both sides).
#ifndef TRIDENT_KERNELS_INTERNAL_CUDA_DTYPE_H_
#define TRIDENT_KERNELS_INTERNAL_CUDA_DTYPE_H_

struct CUstream_st;  // cudaStream_t

namespace trident {

enum class CudaDtype { kFloat, kBFloat16, kHalf };

}  // namespace trident

#endif  // TRIDENT_KERNELS_INTERNAL_CUDA_DTYPE_H_
