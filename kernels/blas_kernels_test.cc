#include "kernels/kernels.h"

#include <dlfcn.h>

#include <cstdlib>

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace trident {
namespace {

// Puts OpenBLAS on its generic kernels, as a CPU model it does not know gets
// them: the kernel table chosen again under OPENBLAS_CORETYPE=Prescott, which
// is then unset.
void UseGenericKernels() {
  auto quit = reinterpret_cast<void (*)()>(dlsym(RTLD_DEFAULT, "gotoblas_dynamic_quit"));
  auto init = reinterpret_cast<void (*)()>(dlsym(RTLD_DEFAULT, "gotoblas_dynamic_init"));
  ASSERT_NE(quit, nullptr);
  ASSERT_NE(init, nullptr);
  setenv("OPENBLAS_CORETYPE", "Prescott", /*overwrite=*/1);
  quit();
  init();
  unsetenv("OPENBLAS_CORETYPE");
}

const char* ExpectedKernels() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")) {
    return "SkylakeX";
  }
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? "Haswell" : "Prescott";
}

TEST(BlasKernelsTest, LeavesTheGenericKernelsForTheBestThisCpuRuns) {
  if (BlasCoreName().empty()) {  // PyTorch's own LibTorch builds (the GPU machines) multiply with MKL
    EXPECT_EQ(UseBestBlasKernels(), "");
    return;
  }
  UseGenericKernels();
  ASSERT_EQ(BlasCoreName(), "Prescott");
  const at::Tensor a = at::randn({64, 48}), b = at::randn({48, 32});
  const at::Tensor expected = (a.unsqueeze(2) * b.unsqueeze(0)).sum(1);  // no BLAS

  const std::string changed = UseBestBlasKernels();
  const std::string best = ExpectedKernels();
  EXPECT_EQ(BlasCoreName(), best);
  if (best == "Prescott") {
    EXPECT_EQ(changed, "");
  } else {
    EXPECT_NE(changed.find("using its " + best + " kernels"), std::string::npos) << changed;
    ASSERT_NE(std::getenv("OPENBLAS_CORETYPE"), nullptr);  // for the processes this one starts
    EXPECT_EQ(std::string(std::getenv("OPENBLAS_CORETYPE")), best);
  }
  EXPECT_TRUE(at::allclose(at::mm(a, b), expected, 1e-4, 1e-5));
  EXPECT_EQ(UseBestBlasKernels(), "");  // once per process
}

}  // namespace
}  // namespace trident
