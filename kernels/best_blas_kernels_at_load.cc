// Linked into every test and benchmark (trident_cc_test, trident_cc_benchmark):
// switches OpenBLAS away from its generic fallback and fp32 products to
// oneDNN when the process loads, so that a benchmark that never reaches
// Parallelize measures with the kernels training uses, and a test's
// single-process reference multiplies with the same kernels as its ranks.
#include <cstdio>
#include <string>

#include "kernels/kernels.h"

namespace trident {
namespace {

// OpenBLAS, a shared library this binary depends on, has chosen its kernels
// before this initializer runs.
const bool kBestBlasKernels = [] {
  const std::string note = UseBestCpuKernels();
  if (!note.empty()) std::fprintf(stderr, "%s\n", note.c_str());
  return true;
}();

}  // namespace
}  // namespace trident
