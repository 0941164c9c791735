// Exact GELU on fp32 CPU tensors (UseVectorGelu): LibTorch's CPU kernels of
// aten::gelu, gelu_, gelu_backward and gelu_backward.grad_input replaced by
// loops of 16 floats with their own erfc and exp, threaded on the intra-op
// pool; other operands go to LibTorch's own kernels (at::cpu::).
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ops/gelu_backward_cpu_dispatch.h>
#include <ATen/ops/gelu_cpu_dispatch.h>
#include <torch/library.h>

#include "base/blas_kernels.h"
#include "base/internal/cpu_overrides.h"
#include "base/vector_math.h"

namespace trident {
namespace {

using namespace vector_math;  // NOLINT: the vector helpers

// Φ(x), the normal distribution: erfc(-x / sqrt 2) / 2, with erfc(a), a >= 0,
// from Numerical Recipes' erfcc (fractional error below 1.2e-7 everywhere):
// t = 1 / (1 + a / 2), erfc(a) = t exp(-a^2 + P(t)).
TRIDENT_VECTOR_INLINE Floats NormalCdf(Floats x) {
  const Floats a = (x < Splat(0) ? -x : x) * 0.70710678118654752f;
  const Floats t = 1.0f / (1.0f + 0.5f * a);
  Floats p = Splat(0.17087277f);
  p = p * t - 0.82215223f;
  p = p * t + 1.48851587f;
  p = p * t - 1.13520398f;
  p = p * t + 0.27886807f;
  p = p * t - 0.18628806f;
  p = p * t + 0.09678418f;
  p = p * t + 0.37409196f;
  p = p * t + 1.00002368f;
  p = p * t - 1.26551223f;
  const Floats lower_tail = 0.5f * t * Exp(p - a * a);  // Φ(-|x|)
  return x < Splat(0) ? lower_tail : 1.0f - lower_tail;
}

// gelu(x) = x Φ(x).
TRIDENT_VECTOR_INLINE Floats Gelu(Floats x) { return x * NormalCdf(x); }

// grad gelu'(x) = grad (Φ(x) + x φ(x)), φ(x) = exp(-x^2 / 2) / sqrt(2 pi).
TRIDENT_VECTOR_INLINE Floats GeluGrad(Floats grad, Floats x) {
  return grad * (NormalCdf(x) + x * Exp(-0.5f * x * x) * 0.39894228040143268f);
}

TRIDENT_VECTOR_CLONES void GeluRange(const float* x, float* out, int64_t n) {
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) Store(out + j, Gelu(Load(x + j)));
  if (j < n) StorePart(out + j, Gelu(LoadPart(x + j, n - j, 0)), n - j);
}

TRIDENT_VECTOR_CLONES void GeluGradRange(const float* grad, const float* x, float* out, int64_t n) {
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) Store(out + j, GeluGrad(Load(grad + j), Load(x + j)));
  if (j < n) StorePart(out + j, GeluGrad(LoadPart(grad + j, n - j, 0), LoadPart(x + j, n - j, 0)), n - j);
}

// Whether these kernels take the operands: exact GELU, fp32 CPU tensors, all
// contiguous and of one shape (an output may be one of the inputs).
bool Takes(c10::string_view approximate, std::initializer_list<const at::Tensor*> tensors) {
  if (approximate != "none") return false;
  const at::Tensor& first = **tensors.begin();
  for (const at::Tensor* t : tensors) {
    if (!t->is_cpu() || t->scalar_type() != at::kFloat || !t->is_contiguous() || t->sizes() != first.sizes()) {
      return false;
    }
  }
  return true;
}

// Runs range(begin, length) over [0, n) on the intra-op threads.
template <typename Range>
void Split(int64_t n, Range range) {
  at::parallel_for(0, n, 1 << 14, [&](int64_t begin, int64_t end) { range(begin, end - begin); });
}

at::Tensor& GeluInto(const at::Tensor& self, at::Tensor& out) {
  const float* x = self.data_ptr<float>();
  float* y = out.data_ptr<float>();
  Split(self.numel(), [&](int64_t begin, int64_t length) { GeluRange(x + begin, y + begin, length); });
  return out;
}

at::Tensor& GeluGradInto(const at::Tensor& grad, const at::Tensor& self, at::Tensor& out) {
  const float *g = grad.data_ptr<float>(), *x = self.data_ptr<float>();
  float* y = out.data_ptr<float>();
  Split(self.numel(), [&](int64_t begin, int64_t length) { GeluGradRange(g + begin, x + begin, y + begin, length); });
  return out;
}

at::Tensor GeluKernel(const at::Tensor& self, c10::string_view approximate) {
  if (!Takes(approximate, {&self})) return at::cpu::gelu(self, approximate);
  at::Tensor out = at::empty_like(self);
  return GeluInto(self, out);
}

at::Tensor& GeluInPlaceKernel(at::Tensor& self, c10::string_view approximate) {
  return Takes(approximate, {&self}) ? GeluInto(self, self) : at::cpu::gelu_(self, approximate);
}

at::Tensor GeluBackwardKernel(const at::Tensor& grad, const at::Tensor& self, c10::string_view approximate) {
  if (!Takes(approximate, {&grad, &self})) return at::cpu::gelu_backward(grad, self, approximate);
  at::Tensor out = at::empty_like(self);
  return GeluGradInto(grad, self, out);
}

at::Tensor& GeluBackwardOutKernel(const at::Tensor& grad, const at::Tensor& self, c10::string_view approximate,
                                  at::Tensor& grad_input) {
  return Takes(approximate, {&grad, &self, &grad_input})
             ? GeluGradInto(grad, self, grad_input)
             : at::cpu::gelu_backward_outf(grad, self, approximate, grad_input);
}

}  // namespace

bool UseVectorGelu() {
  static const bool used = [] {
    const char* setting = std::getenv("TRIDENT_VECTOR_GELU");
    if (setting != nullptr && std::string(setting) == "0") return false;
    internal::OverrideAtenCpuKernels([](torch::Library& library) {
      library.impl("gelu", TORCH_FN(GeluKernel));
      library.impl("gelu_", TORCH_FN(GeluInPlaceKernel));
      library.impl("gelu_backward", TORCH_FN(GeluBackwardKernel));
      library.impl("gelu_backward.grad_input", TORCH_FN(GeluBackwardOutKernel));
    });
    return true;
  }();
  return used;
}

}  // namespace trident
