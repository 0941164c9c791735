// The state of LibTorch's default CPU generator (dropout masks, random
// inits), read and restored under its lock: for recomputation that must draw
// the forward's masks again, and for checkpoints that resume bit-exactly.
#ifndef TRIDENT_BASE_RNG_H_
#define TRIDENT_BASE_RNG_H_

#include <cstdint>
#include <string>

#include <ATen/core/Tensor.h>

namespace trident {

at::Tensor CpuRngState();
void SetCpuRngState(const at::Tensor& state);

// The CPU generator's state and, where `cuda_device` >= 0, that GPU's
// default generator's too (its dropout masks): what a recomputed forward
// restores to draw its first run's numbers.
struct RngStates {
  at::Tensor cpu, cuda;
  int cuda_device = -1;
};
RngStates GetRngStates(int cuda_device);
void SetRngStates(const RngStates& states);
// Seeds the default CPU generator from `seed`, `step` and `rank` (a stream
// that differs per rank and per step): what a resumed run uses where the
// saved per-rank streams do not fit its layout.
void SeedCpuRng(uint64_t seed, int64_t step, int rank);

// A stable 64-bit mix of `seed` and a parameter name (FNV-1a, then
// splitmix64): the seed of the generator that draws that parameter's initial
// values, the same in every process and layout.
uint64_t ParameterSeed(uint64_t seed, const std::string& name);

}  // namespace trident

#endif  // TRIDENT_BASE_RNG_H_
