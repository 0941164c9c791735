// The kernels of fp32 CPU matrix products: OpenBLAS's kernel selection, and
// oneDNN in its place. OpenBLAS (Debian 12 ships 0.3.21, the BLAS that
// LibTorch's fp32 CPU products run on) picks its kernels from the CPU model at
// load time, and a model it does not know gets its generic "Prescott" (SSE3)
// kernels even when the CPU has AVX-512: on an Intel Xeon of family 6 model
// 207 (Emerald Rapids) one core multiplies fp32 at about 30 GFLOP/s with
// them against about 180 with its SkylakeX (AVX-512) kernels.
//
//   UseBestCpuKernels();   // at the start of a training process: the two below
#ifndef TRIDENT_BASE_BLAS_KERNELS_H_
#define TRIDENT_BASE_BLAS_KERNELS_H_

#include <cstdint>
#include <string>

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
using RowMajorSgemm = int (*)(char transa, char transb, int64_t m, int64_t n, int64_t k, float alpha,
                              const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                              int64_t ldc);
RowMajorSgemm OneDnnSgemm();

// UseBestBlasKernels, then UseOneDnnProducts: what `train`, every test and
// benchmark, and a program of the user's that wants the fastest fp32 CPU
// products call first (no library call does it for them). Returns
// UseBestBlasKernels's line.
std::string UseBestCpuKernels();

// The name of the kernel set OpenBLAS uses now ("SkylakeX", "Prescott", ...);
// empty without OpenBLAS.
std::string BlasCoreName();

}  // namespace trident

#endif  // TRIDENT_BASE_BLAS_KERNELS_H_
