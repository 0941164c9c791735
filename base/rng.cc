#include "base/rng.h"

#include <mutex>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>

namespace trident {

at::Tensor CpuRngState() {
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

void SetCpuRngState(const at::Tensor& state) {
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
}

namespace {

at::Generator CudaGenerator(int device) {
  return at::globalContext().defaultGenerator(
      c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)));
}

}  // namespace

RngStates GetRngStates(int cuda_device) {
  RngStates states{CpuRngState(), at::Tensor(), cuda_device};
  if (cuda_device >= 0) {
    at::Generator generator = CudaGenerator(cuda_device);
    std::lock_guard<std::mutex> lock(generator.mutex());
    states.cuda = generator.get_state();
  }
  return states;
}

void SetRngStates(const RngStates& states) {
  SetCpuRngState(states.cpu);
  if (states.cuda_device >= 0) {
    at::Generator generator = CudaGenerator(states.cuda_device);
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(states.cuda);
  }
}

void SeedCpuRng(uint64_t seed, int64_t step, int rank) {
  // SplitMix64 over the three numbers.
  uint64_t x = seed;
  for (uint64_t v : {static_cast<uint64_t>(step), static_cast<uint64_t>(rank)}) {
    x += 0x9e3779b97f4a7c15ULL + v;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    x ^= x >> 31;
  }
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_current_seed(x);
}

uint64_t ParameterSeed(uint64_t seed, const std::string& name) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : name) h = (h ^ c) * 1099511628211ull;
  uint64_t z = h ^ (seed + 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace trident
