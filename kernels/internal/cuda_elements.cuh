// Device helpers shared by kernels/' CUDA kernels: element conversions to and
// from fp32, and packs of consecutive elements loaded and stored as one access.
#ifndef TRIDENT_KERNELS_INTERNAL_CUDA_ELEMENTS_CUH_
#define TRIDENT_KERNELS_INTERNAL_CUDA_ELEMENTS_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace trident {

__device__ __forceinline__ float ToFloat(float x) { return x; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float ToFloat(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T FromFloat(float x);
template <>
__device__ __forceinline__ float FromFloat<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <>
__device__ __forceinline__ __half FromFloat<__half>(float x) { return __float2half(x); }

// kWidth consecutive elements, loaded and stored as one aligned access.
template <typename T, int kWidth>
struct alignas(sizeof(T) * kWidth) Pack {
  T value[kWidth];
};

}  // namespace trident

#endif  // TRIDENT_KERNELS_INTERNAL_CUDA_ELEMENTS_CUH_
