// fp32 CPU products through oneDNN's sgemm (UseOneDnnProducts): LibTorch's
// CPU kernels of aten::mm, addmm and bmm replaced by ones that call it where
// the operands suit it and LibTorch's own kernels (at::cpu::) otherwise.
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ops/addmm_cpu_dispatch.h>
#include <ATen/ops/bmm_cpu_dispatch.h>
#include <ATen/ops/mm_cpu_dispatch.h>
#include <c10/util/Exception.h>
#include <torch/library.h>
#include <torch/version.h>

#include "kernels/kernels.h"

namespace trident {
namespace {

// How sgemm reads a 2-D tensor: row-major ('N', rows `ld` floats apart) or
// the transpose of a row-major matrix ('T'). False for other strides.
bool Layout(const at::Tensor& t, char* trans, int64_t* ld) {
  const int64_t rows = t.size(0), cols = t.size(1), s0 = t.stride(0), s1 = t.stride(1);
  if ((s1 == 1 || cols <= 1) && (rows <= 1 || s0 >= cols)) {
    *trans = 'N';
    *ld = rows <= 1 ? std::max<int64_t>(cols, 1) : s0;
    return true;
  }
  if ((s0 == 1 || rows <= 1) && (cols <= 1 || s1 >= rows)) {
    *trans = 'T';
    *ld = cols <= 1 ? std::max<int64_t>(rows, 1) : s1;
    return true;
  }
  return false;
}

// Whether oneDNN can take the product a b into out: fp32 CPU tensors, none
// empty, out contiguous and apart from both factors.
bool Suits(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out) {
  auto fp32_cpu = [](const at::Tensor& t) { return t.scalar_type() == at::kFloat && t.is_cpu(); };
  return fp32_cpu(a) && fp32_cpu(b) && fp32_cpu(out) && a.numel() > 0 && b.numel() > 0 && out.is_contiguous() &&
         !out.is_alias_of(a) && !out.is_alias_of(b);
}

// How sgemm reads the two factors of a 2-D product.
struct Operands {
  char ta, tb;
  int64_t lda, ldb;
};

// Whether oneDNN takes the 2-D product a b into out, and how it reads a and b.
bool Takes(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out, Operands* operands) {
  return Suits(a, b, out) && a.dim() == 2 && b.dim() == 2 && Layout(a, &operands->ta, &operands->lda) &&
         Layout(b, &operands->tb, &operands->ldb);
}

// out (m x n, row-major: contiguous) = alpha a b + beta out, through oneDNN.
// A linear layer's forward (a row-major, b transposed) with a small b (at
// most 2 MiB, which every thread then reads whole) runs as one block of rows
// per intra-op thread, each on one thread: oneDNN's own threading splits it
// worse where b has few columns (m 2048, n 256, k 1024 on two Zen 5 cores:
// 352 GFLOP/s against 452; equal where n is 768 or 1024).
bool Multiply(const at::Tensor& a, const at::Tensor& b, at::Tensor& out, const Operands& o, float alpha, float beta) {
  const int64_t m = a.size(0), n = b.size(1), k = a.size(1);
  const float *a_data = a.data_ptr<float>(), *b_data = b.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  const int64_t threads = at::get_num_threads();
  if (o.ta == 'N' && o.tb == 'T' && k * n <= (int64_t{1} << 19) && threads > 1 && m >= 128 * threads &&
      !at::in_parallel_region()) {
    std::atomic<bool> failed{false};
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t block = begin; block < end; ++block) {
        const int64_t first = m * block / threads, rows = m * (block + 1) / threads - first;
        if (OneDnnSgemm()(o.ta, o.tb, rows, n, k, alpha, a_data + first * o.lda, o.lda, b_data, o.ldb, beta,
                          out_data + first * n, n) != 0) {
          failed = true;
        }
      }
    });
    return !failed;
  }
  return OneDnnSgemm()(o.ta, o.tb, m, n, k, alpha, a_data, o.lda, b_data, o.ldb, beta, out_data, n) == 0;
}

// out = a b through oneDNN; false (nothing done) when it does not take them.
bool Product(const at::Tensor& a, const at::Tensor& b, at::Tensor& out) {
  Operands operands;
  return Takes(a, b, out, &operands) && Multiply(a, b, out, operands, 1, 0);
}

// out[i] = a[i] b[i] for every i of the batch (out contiguous), the batch
// split among the intra-op threads, each product on one.
bool BatchProduct(const at::Tensor& a, const at::Tensor& b, at::Tensor& out) {
  Operands o;
  if (!Suits(a, b, out) || a.dim() != 3 || b.dim() != 3 || !Layout(a[0], &o.ta, &o.lda) ||
      !Layout(b[0], &o.tb, &o.ldb)) {
    return false;
  }
  const int64_t m = a.size(1), k = a.size(2), n = b.size(2);
  const float* a_data = a.data_ptr<float>();
  const float* b_data = b.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  std::atomic<bool> failed{false};
  at::parallel_for(0, a.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (OneDnnSgemm()(o.ta, o.tb, m, n, k, 1, a_data + i * a.stride(0), o.lda, b_data + i * b.stride(0), o.ldb, 0,
                        out_data + i * m * n, n) != 0) {
        failed = true;
      }
    }
  });
  return !failed;
}

at::Tensor Mm(const at::Tensor& self, const at::Tensor& mat2) {
  if (self.dim() == 2 && mat2.dim() == 2 && self.size(1) == mat2.size(0)) {
    at::Tensor out = at::empty({self.size(0), mat2.size(1)}, self.options());
    if (Product(self, mat2, out)) return out;
  }
  return at::cpu::mm(self, mat2);
}

at::Tensor& MmOut(const at::Tensor& self, const at::Tensor& mat2, at::Tensor& out) {
  if (self.dim() == 2 && mat2.dim() == 2 && self.size(1) == mat2.size(0) && out.dim() == 2 &&
      out.size(0) == self.size(0) && out.size(1) == mat2.size(1) && Product(self, mat2, out)) {
    return out;
  }
  return at::cpu::mm_out(out, self, mat2);
}

at::Tensor Bmm(const at::Tensor& self, const at::Tensor& mat2) {
  if (self.dim() == 3 && mat2.dim() == 3 && self.size(0) == mat2.size(0) && self.size(2) == mat2.size(1)) {
    at::Tensor out = at::empty({self.size(0), self.size(1), mat2.size(2)}, self.options());
    if (BatchProduct(self, mat2, out)) return out;
  }
  return at::cpu::bmm(self, mat2);
}

// out (m x n, contiguous) = beta self + alpha mat1 mat2, self broadcast;
// false (nothing done) when oneDNN does not take it.
bool AddProduct(const at::Tensor& self, const at::Tensor& mat1, const at::Tensor& mat2, const at::Scalar& beta,
                const at::Scalar& alpha, at::Tensor& out) {
  Operands operands;
  if (mat1.dim() != 2 || mat2.dim() != 2 || mat1.size(1) != mat2.size(0) || self.scalar_type() != at::kFloat ||
      beta.isComplex() || alpha.isComplex() || !Takes(mat1, mat2, out, &operands) ||
      (!out.is_same(self) && out.is_alias_of(self))) {
    return false;
  }
  const float b = beta.toFloat(), a = alpha.toFloat();
  if (b != 0 && !out.is_same(self)) out.copy_(self.expand({mat1.size(0), mat2.size(1)}));
  return Multiply(mat1, mat2, out, operands, a, b);
}

at::Tensor Addmm(const at::Tensor& self, const at::Tensor& mat1, const at::Tensor& mat2, const at::Scalar& beta,
                 const at::Scalar& alpha) {
  if (mat1.dim() == 2 && mat2.dim() == 2) {
    at::Tensor out = at::empty({mat1.size(0), mat2.size(1)}, mat1.options());
    if (AddProduct(self, mat1, mat2, beta, alpha, out)) return out;
  }
  return at::cpu::addmm(self, mat1, mat2, beta, alpha);
}

at::Tensor& AddmmOut(const at::Tensor& self, const at::Tensor& mat1, const at::Tensor& mat2, const at::Scalar& beta,
                     const at::Scalar& alpha, at::Tensor& out) {
  if (mat1.dim() == 2 && mat2.dim() == 2 && out.dim() == 2 && out.size(0) == mat1.size(0) &&
      out.size(1) == mat2.size(1) && AddProduct(self, mat1, mat2, beta, alpha, out)) {
    return out;
  }
  return at::cpu::addmm_outf(self, mat1, mat2, beta, alpha, out);
}

at::Tensor& Addmm_(at::Tensor& self, const at::Tensor& mat1, const at::Tensor& mat2, const at::Scalar& beta,
                   const at::Scalar& alpha) {
  if (self.dim() == 2 && mat1.dim() == 2 && mat2.dim() == 2 && self.size(0) == mat1.size(0) &&
      self.size(1) == mat2.size(1) && AddProduct(self, mat1, mat2, beta, alpha, self)) {
    return self;
  }
  return at::cpu::addmm_(self, mat1, mat2, beta, alpha);
}

std::atomic<bool> in_use{false};

}  // namespace

RowMajorSgemm OneDnnSgemm() {
  static const RowMajorSgemm sgemm = reinterpret_cast<RowMajorSgemm>(dlsym(RTLD_DEFAULT, "dnnl_sgemm"));
  return sgemm;
}

bool UseOneDnnProducts() {
  static const bool used = [] {
    const char* setting = std::getenv("TRIDENT_ONEDNN_PRODUCTS");
    if (OneDnnSgemm() == nullptr || (setting != nullptr && std::string(setting) == "0")) return false;
      // Replacing LibTorch's own CPU kernels warns once per operator; this is the point.
#if TORCH_VERSION_MAJOR >= 2
    struct Quiet : c10::WarningHandler {
      void process(const c10::Warning&) override {}
    } quiet;
    c10::WarningUtils::WarningHandlerGuard guard(&quiet);
#else
    struct Quiet : c10::WarningHandler {
      void process(const c10::SourceLocation&, const std::string&, const bool) override {}
    } quiet;
    c10::Warning::WarningHandlerGuard guard(&quiet);
#endif
    static auto* library = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::CPU, __FILE__, __LINE__);
    library->impl("mm", TORCH_FN(Mm));
    library->impl("mm.out", TORCH_FN(MmOut));
    library->impl("addmm", TORCH_FN(Addmm));
    library->impl("addmm.out", TORCH_FN(AddmmOut));
    library->impl("addmm_", TORCH_FN(Addmm_));
    library->impl("bmm", TORCH_FN(Bmm));
    in_use = true;
    return true;
  }();
  return used;
}

bool OneDnnProductsInUse() { return in_use; }

}  // namespace trident
