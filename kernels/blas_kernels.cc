#include "kernels/kernels.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>

namespace trident {
namespace {

// OpenBLAS's C API, looked up in the process (LibTorch links OpenBLAS; Trident
// does not, so a process without it still runs).
template <typename Function>
Function Lookup(const char* name) {
  return reinterpret_cast<Function>(dlsym(RTLD_DEFAULT, name));
}

// The best of OpenBLAS's x86-64 kernel sets this CPU runs; nullptr when it has
// neither AVX-512 nor AVX2.
const char* BestCoreType() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")) {
    return "SkylakeX";
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "Haswell";
#endif
  return nullptr;
}

std::string SwitchFromGenericKernels() {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return "";
  const std::string chosen = BlasCoreName();
  const char* best = BestCoreType();
  if (chosen != "Prescott" || best == nullptr) return "";
  // gotoblas_dynamic_init() chooses the kernel table again, reading
  // OPENBLAS_CORETYPE, once gotoblas_dynamic_quit() has cleared it.
  auto quit = Lookup<void (*)()>("gotoblas_dynamic_quit");
  auto init = Lookup<void (*)()>("gotoblas_dynamic_init");
  if (quit == nullptr || init == nullptr) return "";
  setenv("OPENBLAS_CORETYPE", best, /*overwrite=*/1);
  quit();
  init();
  const std::string now = BlasCoreName();
  return "OpenBLAS chose its generic " + chosen + " kernels for this CPU, which has " +
         (std::string(best) == "SkylakeX" ? "AVX-512" : "AVX2") + ": using its " + now +
         " kernels instead (OPENBLAS_CORETYPE=" + best + "; set OPENBLAS_CORETYPE to choose)";
}

}  // namespace

std::string BlasCoreName() {
  auto name = Lookup<char* (*)()>("openblas_get_corename");
  if (name == nullptr) return "";
  const char* core = name();
  return core != nullptr ? core : "";
}

std::string UseBestCpuKernels() {
  std::string note = UseBestBlasKernels();
  UseOneDnnProducts();
  return note;
}

std::string UseBestBlasKernels() {
  static std::once_flag once;
  std::string changed;
  std::call_once(once, [&] { changed = SwitchFromGenericKernels(); });
  return changed;
}

}  // namespace trident
