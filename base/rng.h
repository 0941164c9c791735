// The state of LibTorch's default CPU generator (dropout masks, random
// inits), read and restored under its lock: for recomputation that must draw
// the forward's masks again, and for checkpoints that resume bit-exactly.
#ifndef TRIDENT_BASE_RNG_H_
#define TRIDENT_BASE_RNG_H_

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace trident {

at::Tensor CpuRngState();
void SetCpuRngState(const at::Tensor& state);
// Seeds the default CPU generator from `seed`, `step` and `rank` (a stream
// that differs per rank and per step): what a resumed run uses where the
// saved per-rank streams do not fit its layout.
void SeedCpuRng(uint64_t seed, int64_t step, int rank);

}  // namespace trident

#endif  // TRIDENT_BASE_RNG_H_
