// The residual add + LayerNorm on CUDA, one warp per row with the row's values
// in registers. Forward reads x (and the residual) once and writes the sum
// (when there is a residual) and the normalized output in the output's type.
// Backward reads the sum, the output's gradient and the sum's gradient once,
// writes x's (and the residual's) gradient, and leaves each block's sums of the
// weight's and bias's gradients for the caller to add up.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/internal/cuda_elements.cuh"
#include "kernels/internal/layer_norm_cuda.h"

namespace trident {
namespace {

constexpr int kWarps = 4;  // rows in flight per block
constexpr int kWidth = 4;  // consecutive elements per lane and access
constexpr int kSteps = kAddLayerNormMaxCols / (32 * kWidth);

template <typename T>
__device__ __forceinline__ void Load(const T* p, float (&v)[kWidth]) {
  const Pack<T, kWidth> pack = *reinterpret_cast<const Pack<T, kWidth>*>(p);
#pragma unroll
  for (int k = 0; k < kWidth; ++k) v[k] = ToFloat(pack.value[k]);
}

template <typename T>
__device__ __forceinline__ void Store(T* p, const float (&v)[kWidth]) {
  Pack<T, kWidth> pack;
#pragma unroll
  for (int k = 0; k < kWidth; ++k) pack.value[k] = FromFloat<T>(v[k]);
  *reinterpret_cast<Pack<T, kWidth>*>(p) = pack;
}

// p's kWidth values, or `absent` everywhere when p is null.
__device__ __forceinline__ void LoadOr(const float* p, float absent, float (&v)[kWidth]) {
  if (p != nullptr) {
    Load(p, v);
  } else {
#pragma unroll
    for (int k = 0; k < kWidth; ++k) v[k] = absent;
  }
}

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// The first column of a lane's step s.
__device__ __forceinline__ int Column(int step, int lane) { return (step * 32 + lane) * kWidth; }

template <typename X, typename R, typename O>
__global__ void __launch_bounds__(kWarps * 32)
    AddLayerNormKernel(const X* __restrict__ x, const R* __restrict__ residual, float alpha,
                       const float* __restrict__ weight, const float* __restrict__ bias, float eps, int64_t rows,
                       int cols, X* __restrict__ sum, O* __restrict__ out, float* __restrict__ mean,
                       float* __restrict__ rstd) {
  const int lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (row >= rows) return;
  const int64_t offset = row * cols;
  float v[kSteps][kWidth];
  float total = 0.f;
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    const int col = Column(s, lane);
    if (col >= cols) continue;
    Load(x + offset + col, v[s]);
    if (residual != nullptr) {
      float r[kWidth];
      Load(residual + offset + col, r);
#pragma unroll
      for (int k = 0; k < kWidth; ++k) v[s][k] = ToFloat(FromFloat<X>(v[s][k] + alpha * r[k]));  // as stored
      Store(sum + offset + col, v[s]);
    }
#pragma unroll
    for (int k = 0; k < kWidth; ++k) total += v[s][k];
  }
  const float mu = WarpSum(total) / cols;
  float squares = 0.f;
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    if (Column(s, lane) >= cols) continue;
#pragma unroll
    for (int k = 0; k < kWidth; ++k) squares += (v[s][k] - mu) * (v[s][k] - mu);
  }
  const float r = rsqrtf(WarpSum(squares) / cols + eps);
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    const int col = Column(s, lane);
    if (col >= cols) continue;
    float w[kWidth], b[kWidth], y[kWidth];
    LoadOr(weight == nullptr ? nullptr : weight + col, 1.f, w);
    LoadOr(bias == nullptr ? nullptr : bias + col, 0.f, b);
#pragma unroll
    for (int k = 0; k < kWidth; ++k) y[k] = (v[s][k] - mu) * r * w[k] + b[k];
    Store(out + offset + col, y);
  }
  if (lane == 0) {
    mean[row] = mu;
    rstd[row] = r;
  }
}

// Adds the block's warps' per-column sums and writes them to row blockIdx.x of `out`.
__device__ __forceinline__ void WriteBlockSums(const float (&sums)[kSteps][kWidth],
                                               float (&shared)[kWarps][kAddLayerNormMaxCols], int cols,
                                               float* __restrict__ out) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    const int col = Column(s, lane);
    if (col >= cols) continue;
#pragma unroll
    for (int k = 0; k < kWidth; ++k) shared[warp][col + k] = sums[s][k];
  }
  __syncthreads();
  for (int col = threadIdx.x; col < cols; col += blockDim.x) {
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += shared[w][col];
    out[static_cast<int64_t>(blockIdx.x) * cols + col] = total;
  }
  __syncthreads();  // `shared` is written again by the next call
}

template <typename X, typename R, typename O>
__global__ void __launch_bounds__(kWarps * 32)
    AddLayerNormBackwardKernel(const X* __restrict__ sum, const O* __restrict__ grad_out,
                               const X* __restrict__ grad_sum, const float* __restrict__ mean,
                               const float* __restrict__ rstd, const float* __restrict__ weight, float alpha,
                               int64_t rows, int cols, X* __restrict__ grad_x, R* __restrict__ grad_residual,
                               float* __restrict__ partial_weight, float* __restrict__ partial_bias) {
  __shared__ float shared[kWarps][kAddLayerNormMaxCols];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float weight_sums[kSteps][kWidth] = {}, bias_sums[kSteps][kWidth] = {};
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + warp; row < rows;
       row += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t offset = row * cols;
    const float mu = mean[row], r = rstd[row];
    float xhat[kSteps][kWidth], g[kSteps][kWidth];
    float g_total = 0.f, gx_total = 0.f;
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      const int col = Column(s, lane);
      if (col >= cols) continue;
      float xs[kWidth], dy[kWidth], w[kWidth];
      Load(sum + offset + col, xs);
      Load(grad_out + offset + col, dy);
      LoadOr(weight == nullptr ? nullptr : weight + col, 1.f, w);
#pragma unroll
      for (int k = 0; k < kWidth; ++k) {
        xhat[s][k] = (xs[k] - mu) * r;
        g[s][k] = dy[k] * w[k];
        g_total += g[s][k];
        gx_total += g[s][k] * xhat[s][k];
        weight_sums[s][k] += dy[k] * xhat[s][k];
        bias_sums[s][k] += dy[k];
      }
    }
    const float g_mean = WarpSum(g_total) / cols, gx_mean = WarpSum(gx_total) / cols;
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      const int col = Column(s, lane);
      if (col >= cols) continue;
      float dx[kWidth] = {};
      if (grad_sum != nullptr) Load(grad_sum + offset + col, dx);
#pragma unroll
      for (int k = 0; k < kWidth; ++k) dx[k] += r * (g[s][k] - g_mean - xhat[s][k] * gx_mean);
      Store(grad_x + offset + col, dx);
      if (grad_residual != nullptr) {
#pragma unroll
        for (int k = 0; k < kWidth; ++k) dx[k] *= alpha;
        Store(grad_residual + offset + col, dx);
      }
    }
  }
  if (partial_weight != nullptr) WriteBlockSums(weight_sums, shared, cols, partial_weight);
  if (partial_bias != nullptr) WriteBlockSums(bias_sums, shared, cols, partial_bias);
}

template <typename T>
struct Type {
  using type = T;
};

template <typename F>
void WithType(CudaDtype dtype, F f) {
  switch (dtype) {
    case CudaDtype::kFloat:
      return f(Type<float>{});
    case CudaDtype::kBFloat16:
      return f(Type<__nv_bfloat16>{});
    case CudaDtype::kHalf:
      return f(Type<__half>{});
  }
}

// Calls f(Type<X>{}, Type<R>{}, Type<O>{}) for the element types of `dtypes`,
// instantiating only the combinations AddLayerNormTakes accepts.
template <typename F>
void WithTypes(const AddLayerNormDtypes& dtypes, F f) {
  WithType(dtypes.x, [&](auto x) {
    WithType(dtypes.residual, [&](auto r) {
      WithType(dtypes.out, [&](auto o) {
        using X = typename std::decay_t<decltype(x)>::type;
        using R = typename std::decay_t<decltype(r)>::type;
        using O = typename std::decay_t<decltype(o)>::type;
        if constexpr (std::is_same<X, float>::value || (std::is_same<R, X>::value && std::is_same<O, X>::value)) {
          f(x, r, o);
        }
      });
    });
  });
}

}  // namespace

void LaunchAddLayerNorm(const AddLayerNormDtypes& dtypes, const void* x, const void* residual, float alpha,
                        const float* weight, const float* bias, float eps, int64_t rows, int64_t cols, void* sum,
                        void* out, float* mean, float* rstd, CUstream_st* stream) {
  if (rows == 0) return;
  WithTypes(dtypes, [&](auto x_type, auto r_type, auto o_type) {
    using X = typename std::decay_t<decltype(x_type)>::type;
    using R = typename std::decay_t<decltype(r_type)>::type;
    using O = typename std::decay_t<decltype(o_type)>::type;
    const int64_t blocks = (rows + kWarps - 1) / kWarps;
    AddLayerNormKernel<X, R, O><<<blocks, kWarps * 32, 0, stream>>>(
        static_cast<const X*>(x), static_cast<const R*>(residual), alpha, weight, bias, eps, rows,
        static_cast<int>(cols), static_cast<X*>(sum), static_cast<O*>(out), mean, rstd);
  });
}

int AddLayerNormBackwardBlocks(const AddLayerNormDtypes& dtypes, int64_t rows) {
  int resident = 1;
  WithTypes(dtypes, [&](auto x_type, auto r_type, auto o_type) {
    using X = typename std::decay_t<decltype(x_type)>::type;
    using R = typename std::decay_t<decltype(r_type)>::type;
    using O = typename std::decay_t<decltype(o_type)>::type;
    int device = 0, processors = 1, per_processor = 1;
    if (cudaGetDevice(&device) == cudaSuccess &&
        cudaDeviceGetAttribute(&processors, cudaDevAttrMultiProcessorCount, device) == cudaSuccess &&
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_processor, AddLayerNormBackwardKernel<X, R, O>, kWarps * 32,
                                                      0) == cudaSuccess) {
      resident = std::max(1, processors * per_processor);
    }
  });
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(resident, (rows + kWarps - 1) / kWarps)));
}

void LaunchAddLayerNormBackward(const AddLayerNormDtypes& dtypes, const void* sum, const void* grad_out,
                                const void* grad_sum, const float* mean, const float* rstd, const float* weight,
                                float alpha, int64_t rows, int64_t cols, void* grad_x, void* grad_residual,
                                float* partial_weight, float* partial_bias, CUstream_st* stream) {
  const int blocks = AddLayerNormBackwardBlocks(dtypes, rows);  // at least one: the partial sums are written
  WithTypes(dtypes, [&](auto x_type, auto r_type, auto o_type) {
    using X = typename std::decay_t<decltype(x_type)>::type;
    using R = typename std::decay_t<decltype(r_type)>::type;
    using O = typename std::decay_t<decltype(o_type)>::type;
    AddLayerNormBackwardKernel<X, R, O><<<blocks, kWarps * 32, 0, stream>>>(
        static_cast<const X*>(sum), static_cast<const O*>(grad_out), static_cast<const X*>(grad_sum), mean, rstd,
        weight, alpha, rows, static_cast<int>(cols), static_cast<X*>(grad_x), static_cast<R*>(grad_residual),
        partial_weight, partial_bias);
  });
}

}  // namespace trident
