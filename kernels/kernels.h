// kernels: the choice of fp32 CPU product kernels (OpenBLAS's kernel set,
// oneDNN in ATen's place), linear products padded to aligned widths for
// cuBLAS's fast kernels, and the fused operators (causal attention, residual
// add + LayerNorm, bias + GELU, cross-entropy; CPU kernels here, CUDA ones in
// the GPU build) that replace/'s pairs and the zoo use. A process-wide choice
// is the program's to make (UseBestCpuKernels); no library call makes it.
//
// CPU products. The kernels of fp32 CPU matrix products: OpenBLAS's kernel selection, and
// oneDNN in its place. OpenBLAS (Debian 12 ships 0.3.21, the BLAS that
// LibTorch's fp32 CPU products run on) picks its kernels from the CPU model at
// load time, and a model it does not know gets its generic "Prescott" (SSE3)
// kernels even when the CPU has AVX-512: on an Intel Xeon of family 6 model
// 207 (Emerald Rapids) one core multiplies fp32 at about 30 GFLOP/s with
// them against about 180 with its SkylakeX (AVX-512) kernels.
//
//   UseBestCpuKernels();   // at the start of a training process: the two below
//
// Aligned products: linear products whose output rows start at aligned
// addresses. cuBLAS runs its fast (Hopper, tensor-core) matrix-product kernels only when
// every matrix's leading dimension is a multiple of 16 bytes. A language
// model's head has an odd width (GPT-2's vocabulary: 50,257), so its three
// products ran on a fallback kernel: on an H200, 15.4 of a gpt2-124m bf16
// step's 40 ms of kernels. AlignedLinear computes the product with the weight
// padded by zero rows to a multiple of 64 and returns the first
// out_features columns: the same values, the padded products, and gradients
// that are those of at::linear (the pad's gradient is dropped).
#ifndef TRIDENT_KERNELS_KERNELS_H_
#define TRIDENT_KERNELS_KERNELS_H_

#include <cstdint>
#include <string>
#include <utility>

#include <ATen/core/Tensor.h>

namespace trident {

// When this process's OpenBLAS fell back to its generic kernels on a CPU with
// AVX-512 (F, CD, BW, DQ, VL) or AVX2 and FMA, switches it to its SkylakeX or
// Haswell kernels, and sets OPENBLAS_CORETYPE so that the processes this one
// starts load with them. Does nothing when OPENBLAS_CORETYPE is set (the
// user's choice), when OpenBLAS chose another kernel set, or when the process
// has no OpenBLAS. Call it while no BLAS call is running (OpenBLAS reads its
// kernel table on each call). Returns a line that says what it changed, once
// per process; empty otherwise.
std::string UseBestBlasKernels();

// Routes this process's fp32 CPU matrix products (aten::mm, addmm with its
// out and in-place forms, and bmm: linear layers, attention and their
// backward) through oneDNN's sgemm, from the libdnnl that LibTorch links: its
// AVX-512 kernels, threaded on ATen's intra-op pool. On two cores of an AMD
// EPYC (Zen 5) under OPENBLAS_CORETYPE=Haswell, 400-514 GFLOP/s against
// OpenBLAS's 250-265 on its pool of two. Operands it does not take (other
// dtypes, strides that are neither rows nor columns, an output that overlaps
// an input) go to LibTorch's own kernels. Returns whether the products go
// through oneDNN: false without libdnnl (PyTorch's wheels link it inside
// LibTorch, hidden) or with TRIDENT_ONEDNN_PRODUCTS=0 in the environment.
// Once per process; call it while no product runs.
bool UseOneDnnProducts();
// Whether UseOneDnnProducts routed the products through oneDNN.
bool OneDnnProductsInUse();

// oneDNN's row-major sgemm, C = alpha op(A) op(B) + beta C with op 'N' (as
// stored, rows `ld` floats apart) or 'T' (transposed), from the libdnnl that
// LibTorch links; it returns 0 on success. Inside a parallel region (ATen's
// parallel_for) it runs on the calling thread alone. Null without libdnnl.
using RowMajorSgemm = int (*)(char transa, char transb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                              int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);
RowMajorSgemm OneDnnSgemm();

// UseBestBlasKernels, then UseOneDnnProducts: what `train`, every test and
// benchmark, and a program of the user's that wants the fastest fp32 CPU
// products call first (no library call does it for them). Returns
// UseBestBlasKernels's line.
std::string UseBestCpuKernels();

// The name of the kernel set OpenBLAS uses now ("SkylakeX", "Prescott", ...);
// empty without OpenBLAS.
std::string BlasCoreName();

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

// One AdamW step over n contiguous fp32 values on the CPU, in place: m and v
// are the moments, decay = 1 - lr * weight_decay, step_size = lr / (1 -
// beta1^step), inverse_sqrt_bias_correction2 = 1 / sqrt(1 - beta2^step).
// Reads and writes each array once, as vector instructions, threaded over
// ATen's intra-op pool; IEEE single precision, so the results do not depend
// on the CPU's vector width.
void FusedAdamWStep(float* p, const float* g, float* m, float* v, int64_t n, float decay, float beta1, float beta2,
                    float inverse_sqrt_bias_correction2, float eps, float step_size);

// The fused operators, usable directly (with autograd).

// Causal attention of q [B, H, Tq, D] over k, v [B, H, Tk, D], Tk >= Tq:
// query i is position Tk - Tq + i. Equals softmax(q k^T / sqrt(D) + causal
// mask) v, without attention dropout.
at::Tensor FusedCausalAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);

// Whether FusedCausalAttention runs its fused CPU kernels on these operands:
// fp32 CPU tensors, with oneDNN's sgemm in the process (UseOneDnnProducts).
// They never write the [B, H, Tq, Tk] scores and beat the unfused operators
// (see //replace:replace_benchmark). The zoo's attention takes them by default.
bool FusedCausalAttentionOnCpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);

// (x + alpha * residual, LayerNorm of that sum over the last dimensions
// `normalized_shape`) from one pass; residual, weight and bias may be
// undefined (without a residual the sum is x, and its gradient joins x's).
// On CUDA (one normalized dimension of up to 1024, a multiple of 4) the
// output is in autocast's dtype when autocast is on and x is fp32: the
// type the next product reads.
std::pair<at::Tensor, at::Tensor> FusedAddLayerNorm(const at::Tensor& x, const at::Tensor& residual, double alpha,
                                                    at::IntArrayRef normalized_shape, const at::Tensor& weight,
                                                    const at::Tensor& bias, double eps);

// gelu(x + bias) (bias over the last dimension); `approximate` "none" (erf)
// or "tanh".
at::Tensor FusedBiasGelu(const at::Tensor& x, const at::Tensor& bias, const std::string& approximate = "none");

// The mean over targets other than `ignore_index` of -log_softmax(logits)[target]
// (logits [N, C], targets [N] class ids), computed in fp32 as F::cross_entropy
// is under autocast.
at::Tensor FusedCrossEntropy(const at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index = -100);

}  // namespace trident

#endif  // TRIDENT_KERNELS_KERNELS_H_
