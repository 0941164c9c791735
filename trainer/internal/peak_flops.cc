#include "trainer/internal/peak_flops.h"

#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status.h"
#include "kernels/kernels.h"
#include "topology/distributed_env.h"

namespace trident {
namespace internal {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

std::string CpuModel() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (absl::StartsWith(line, "model name")) return line.substr(line.find(':') + 1);
  }
  return "unknown";
}

std::string CachePath(at::ScalarType dtype) {
  const char* home = std::getenv("HOME");
  // The product kernels decide the fp32 rate as much as the CPU does
  // (OpenBLAS's generic kernels run at a sixth of its AVX-512 ones, oneDNN's
  // at twice OpenBLAS's Haswell ones on an AMD EPYC).
  const size_t key = std::hash<std::string>()(CpuModel() + BlasCoreName() + (OneDnnProductsInUse() ? "+onednn" : ""));
  return absl::StrCat(home != nullptr ? home : "/tmp", "/.cache/trident/peak_flops_cpu_", key,
                      dtype == at::kFloat ? "" : absl::StrCat("_", c10::toString(dtype)));
}

// OpenBLAS's pool size, through its C API when this process has it.
int BlasThreads(int set) {
  using Get = int (*)();
  using Set = void (*)(int);
  auto get = reinterpret_cast<Get>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  auto assign = reinterpret_cast<Set>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  const int before = get != nullptr ? get() : 1;
  if (assign != nullptr && set > 0) assign(set);
  return before;
}

// GPU names as nvidia-smi prints them, and their dense peaks (FLOP/s).
struct GpuPeak {
  const char* name;
  double fp32, half;
};
constexpr GpuPeak kGpus[] = {
    {"H200", 67e12, 989e12},   {"H100 PCIe", 51e12, 756e12}, {"H100", 67e12, 989e12},
    {"A100", 19.5e12, 312e12}, {"L40S", 91.6e12, 362e12},    {"A10", 31.2e12, 125e12},
};

std::string GpuName(int index) {
  std::string name;
  FILE* pipe =
      popen(absl::StrCat("nvidia-smi --query-gpu=name --format=csv,noheader -i ", index, " 2>/dev/null").c_str(), "r");
  if (pipe == nullptr) return name;
  char buffer[256];
  while (fgets(buffer, sizeof(buffer), pipe) != nullptr) name += buffer;
  pclose(pipe);
  return std::string(absl::StripAsciiWhitespace(name));
}

// The dtype a CPU job's products run in under `precision`.
at::ScalarType CpuComputeDtype(const std::string& precision) {
  return absl::StrContains(precision, "bf16") ? at::kBFloat16 : at::kFloat;
}

// The cached per-core rate; 0 when none was measured on this machine.
double CachedCorePeakFlops(at::ScalarType dtype) {
  std::ifstream cached(CachePath(dtype));
  double flops = 0;
  return cached >> flops && flops > 0 ? flops : 0;
}

// The cached rate, measured first where there is none.
double CorePeakFlops(at::ScalarType dtype) {
  const double cached = CachedCorePeakFlops(dtype);
  return cached > 0 ? cached : MeasureCorePeakFlops(dtype);
}

}  // namespace

double MeasureCorePeakFlops(at::ScalarType dtype) {
  const std::string cache = CachePath(dtype);
  const double cached = CachedCorePeakFlops(dtype);
  c10::NoGradGuard no_grad;
  const int threads = at::get_num_threads();
  const int blas = BlasThreads(1);
  at::set_num_threads(1);
  const int64_t n = 1024;
  // Constant inputs: drawing random ones would advance the training RNG.
  const auto options = at::TensorOptions().dtype(dtype);
  auto a = at::full({n, n}, 0.5, options), b = at::full({n, n}, 0.25, options), c = at::empty({n, n}, options);
  at::mm_out(c, a, b);  // warm up
  // Another process on the machine only slows a window down, so the fastest
  // window is the closest to what the core can do; on a shared VM whole
  // seconds run at half speed, so each run adds its windows to the best rate
  // cached.
  double flops = cached;
  for (int window = 0; window < (cached > 0 ? 3 : 10); ++window) {
    int64_t products = 0;
    const auto start = Clock::now();
    double seconds = 0;
    while (seconds < 0.2) {
      at::mm_out(c, a, b);
      ++products;
      seconds = std::chrono::duration<double>(Clock::now() - start).count();
    }
    flops = std::max(flops, 2.0 * n * n * n * products / seconds);
  }
  at::set_num_threads(threads);
  BlasThreads(blas);
  if (flops <= cached) return cached;
  std::error_code error;
  fs::create_directories(fs::path(cache).parent_path(), error);
  const std::string temporary = absl::StrCat(cache, ".", getpid());
  std::ofstream(temporary) << flops;
  fs::rename(temporary, cache, error);
  return flops;
}

namespace {

// MeasureCorePeakFlops once per process and dtype, its rate after: a
// program that creates several trainers (tests, a search's trial runs) pays
// for the windows once.
double MeasureCorePeakFlopsOnce(at::ScalarType dtype) {
  static std::mutex mutex;
  static std::map<at::ScalarType, double> measured;
  std::lock_guard<std::mutex> lock(mutex);
  auto [found, fresh] = measured.try_emplace(dtype, 0.0);
  if (fresh) found->second = MeasureCorePeakFlops(dtype);
  return found->second;
}

}  // namespace

absl::StatusOr<double> JobPeakFlops(const Topology& topology, const std::string& device, const std::string& precision) {
  const DistributedEnv& env = topology.env();
  const int local = std::max(1, env.local_world_size);
  const int nodes = std::max(1, topology.world_size() / local);
  if (device == "cuda") {
    const std::string name = GpuName(env.local_rank);
    const bool half = precision.find("16") != std::string::npos;
    for (const GpuPeak& gpu : kGpus) {
      if (name.find(gpu.name) != std::string::npos) return (half ? gpu.half : gpu.fp32) * topology.world_size();
    }
    return 0.0;
  }
  // One rank per node measures (and caches the best rate yet) while the others wait; bf16
  // compute is measured against bf16 products (oneDNN's, about twice as fast
  // with AVX-512 BF16).
  const at::ScalarType dtype = CpuComputeDtype(precision);
  double per_core = 0;
  if (env.local_rank == 0) {
    per_core = MeasureCorePeakFlopsOnce(dtype);
    if (dtype != at::kFloat) MeasureCorePeakFlopsOnce(at::kFloat);  // for SlowBf16Warning
  }
  TRIDENT_RETURN_IF_ERROR(topology.world().Barrier());
  if (env.local_rank != 0) per_core = CorePeakFlops(dtype);  // read from the cache
  const int cores = UsableCpus();
  const int share = CpuThreadsPerRank(env);  // each rank's pool, as train sizes it
  return per_core * std::min(cores, local * share) * nodes;
}

std::string SlowBf16Warning(double fp32_per_core, double bf16_per_core) {
  if (bf16_per_core >= fp32_per_core) return "";
  return absl::StrFormat(
      "warning: this CPU multiplies bf16 at %.1f GFLOP/s per core against %.1f in fp32 (it has no AVX-512 BF16 "
      "or AMX instructions, so bf16 products are emulated): bf16 training will be slower than fp32 here; use "
      "--precision=fp32",
      bf16_per_core / 1e9, fp32_per_core / 1e9);
}

std::string SlowBf16Warning(const std::string& device, const std::string& precision) {
  if (device == "cuda" || CpuComputeDtype(precision) != at::kBFloat16) return "";
  return SlowBf16Warning(CorePeakFlops(at::kFloat), CorePeakFlops(at::kBFloat16));
}

}  // namespace internal
}  // namespace trident
