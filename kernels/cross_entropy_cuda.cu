// The fused cross-entropy on CUDA: one pass over the logits forward (the
// log-sum-exp of each row, kept for backward), one pass backward that writes
// the logits' gradient in their own precision. No [rows, cols] buffer in fp32.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "kernels/internal/cross_entropy_cuda.h"
#include "kernels/internal/cuda_elements.cuh"

namespace trident {
namespace {

constexpr int kMaxThreads = 512;

// A running maximum and the sum of exp(x - maximum) over the values seen.
struct MaxSum {
  float max;
  float sum;
};

// NOTE: -inf values (the pad columns of an aligned product) add nothing; a NaN
// makes the sum NaN, so it reaches the loss as PyTorch's would.
__device__ __forceinline__ void Add(MaxSum& acc, float x) {
  if (x > acc.max) {
    acc.sum = acc.sum * expf(acc.max - x) + 1.f;
    acc.max = x;
  } else if (!(x == -INFINITY)) {
    acc.sum += expf(x - acc.max);
  }
}

// An empty pair (no value seen, or only -inf) leaves the other as it is.
__device__ __forceinline__ MaxSum Combine(MaxSum a, MaxSum b) {
  if (a.max == -INFINITY && a.sum == 0.f) return b;
  if (b.max == -INFINITY && b.sum == 0.f) return a;
  const float m = fmaxf(a.max, b.max);
  return {m, a.sum * expf(a.max - m) + b.sum * expf(b.max - m)};
}

__device__ __forceinline__ MaxSum WarpCombine(MaxSum acc) {
  for (int offset = 16; offset > 0; offset /= 2) {
    acc = Combine(acc, {__shfl_xor_sync(0xffffffffu, acc.max, offset), __shfl_xor_sync(0xffffffffu, acc.sum, offset)});
  }
  return acc;
}

// The block's combined pair, in thread 0.
__device__ MaxSum BlockCombine(MaxSum acc) {
  __shared__ float maxes[kMaxThreads / 32], sums[kMaxThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  acc = WarpCombine(acc);
  if (lane == 0) {
    maxes[warp] = acc.max;
    sums[warp] = acc.sum;
  }
  __syncthreads();
  if (warp != 0) return acc;
  acc = lane < static_cast<int>(blockDim.x / 32) ? MaxSum{maxes[lane], sums[lane]} : MaxSum{-INFINITY, 0.f};
  return WarpCombine(acc);
}

// One block per row.
template <typename T, int kWidth>
__global__ void CrossEntropyRowsKernel(const T* __restrict__ logits, int64_t cols, int64_t stride,
                                       const int64_t* __restrict__ targets, int64_t ignore_index,
                                       float* __restrict__ lse, float* __restrict__ loss) {
  const int64_t row = blockIdx.x;
  const T* x = logits + row * stride;
  MaxSum acc{-INFINITY, 0.f};
  for (int64_t j = static_cast<int64_t>(threadIdx.x) * kWidth; j < cols;
       j += static_cast<int64_t>(blockDim.x) * kWidth) {
    const Pack<T, kWidth> pack = *reinterpret_cast<const Pack<T, kWidth>*>(x + j);
#pragma unroll
    for (int k = 0; k < kWidth; ++k) Add(acc, ToFloat(pack.value[k]));
  }
  acc = BlockCombine(acc);
  if (threadIdx.x != 0) return;
  const float row_lse = acc.max + logf(acc.sum);
  lse[row] = row_lse;
  const int64_t target = targets[row];
  if (target == ignore_index) {
    loss[row] = 0.f;
  } else {
    loss[row] = target >= 0 && target < cols ? row_lse - ToFloat(x[target]) : NAN;
  }
}

template <typename T, int kWidth>
__global__ void CrossEntropyRowsBackwardKernel(const T* __restrict__ logits, int64_t cols, int64_t stride,
                                               const int64_t* __restrict__ targets, int64_t ignore_index,
                                               const float* __restrict__ lse, const float* __restrict__ scale,
                                               T* __restrict__ grad) {
  const int64_t row = blockIdx.x;
  const T* x = logits + row * stride;
  T* g = grad + row * cols;
  const int64_t target = targets[row];
  const float s = target == ignore_index ? 0.f : scale[0], row_lse = lse[row];
  for (int64_t j = static_cast<int64_t>(threadIdx.x) * kWidth; j < cols;
       j += static_cast<int64_t>(blockDim.x) * kWidth) {
    const Pack<T, kWidth> in = *reinterpret_cast<const Pack<T, kWidth>*>(x + j);
    Pack<T, kWidth> out;
#pragma unroll
    for (int k = 0; k < kWidth; ++k) {
      const float p = expf(ToFloat(in.value[k]) - row_lse) - (j + k == target ? 1.f : 0.f);
      out.value[k] = FromFloat<T>(p * s);
    }
    *reinterpret_cast<Pack<T, kWidth>*>(g + j) = out;
  }
}

// Threads per row: enough for the row's packs, a multiple of 32, at most kMaxThreads.
int Threads(int64_t packs) {
  int threads = 32;
  while (threads < kMaxThreads && threads < packs) threads *= 2;
  return threads;
}

// Runs `launch` with the widest packs (16 bytes) the layout allows, else one element at a time.
template <typename T, typename Launch>
void WithPackWidth(const void* logits, int64_t cols, int64_t stride, const void* grad, Launch launch) {
  constexpr int kWide = 16 / sizeof(T);
  const bool aligned = reinterpret_cast<uintptr_t>(logits) % 16 == 0 && reinterpret_cast<uintptr_t>(grad) % 16 == 0 &&
                       cols % kWide == 0 && stride % kWide == 0;
  if (aligned) {
    launch(Pack<T, kWide>{}, Threads(cols / kWide));
  } else {
    launch(Pack<T, 1>{}, Threads(cols));
  }
}

template <typename T>
void RowsForward(const void* logits, int64_t rows, int64_t cols, int64_t stride, const int64_t* targets,
                 int64_t ignore_index, float* lse, float* loss, cudaStream_t stream) {
  WithPackWidth<T>(logits, cols, stride, nullptr, [&](auto pack, int threads) {
    constexpr int kWidth = sizeof(pack) / sizeof(T);
    CrossEntropyRowsKernel<T, kWidth>
        <<<rows, threads, 0, stream>>>(static_cast<const T*>(logits), cols, stride, targets, ignore_index, lse, loss);
  });
}

template <typename T>
void RowsBackward(const void* logits, int64_t rows, int64_t cols, int64_t stride, const int64_t* targets,
                  int64_t ignore_index, const float* lse, const float* scale, void* grad, cudaStream_t stream) {
  WithPackWidth<T>(logits, cols, stride, grad, [&](auto pack, int threads) {
    constexpr int kWidth = sizeof(pack) / sizeof(T);
    CrossEntropyRowsBackwardKernel<T, kWidth><<<rows, threads, 0, stream>>>(
        static_cast<const T*>(logits), cols, stride, targets, ignore_index, lse, scale, static_cast<T*>(grad));
  });
}

}  // namespace

void LaunchCrossEntropyRows(CudaDtype dtype, const void* logits, int64_t rows, int64_t cols, int64_t stride,
                            const int64_t* targets, int64_t ignore_index, float* lse, float* loss,
                            CUstream_st* stream) {
  if (rows == 0) return;
  switch (dtype) {
    case CudaDtype::kFloat:
      return RowsForward<float>(logits, rows, cols, stride, targets, ignore_index, lse, loss, stream);
    case CudaDtype::kBFloat16:
      return RowsForward<__nv_bfloat16>(logits, rows, cols, stride, targets, ignore_index, lse, loss, stream);
    case CudaDtype::kHalf:
      return RowsForward<__half>(logits, rows, cols, stride, targets, ignore_index, lse, loss, stream);
  }
}

void LaunchCrossEntropyRowsBackward(CudaDtype dtype, const void* logits, int64_t rows, int64_t cols, int64_t stride,
                                    const int64_t* targets, int64_t ignore_index, const float* lse, const float* scale,
                                    void* grad, CUstream_st* stream) {
  if (rows == 0) return;
  switch (dtype) {
    case CudaDtype::kFloat:
      return RowsBackward<float>(logits, rows, cols, stride, targets, ignore_index, lse, scale, grad, stream);
    case CudaDtype::kBFloat16:
      return RowsBackward<__nv_bfloat16>(logits, rows, cols, stride, targets, ignore_index, lse, scale, grad, stream);
    case CudaDtype::kHalf:
      return RowsBackward<__half>(logits, rows, cols, stride, targets, ignore_index, lse, scale, grad, stream);
  }
}

}  // namespace trident
