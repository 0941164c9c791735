// The state of LibTorch's default CPU generator (dropout masks, random
// inits), read and restored under its lock: for recomputation that must draw
// the forward's masks again, and for checkpoints that resume bit-exactly.
#ifndef TRIDENT_BASE_RNG_H_
#define TRIDENT_BASE_RNG_H_

#include <ATen/core/Tensor.h>

namespace trident {

at::Tensor CpuRngState();
void SetCpuRngState(const at::Tensor& state);

}  // namespace trident

#endif  // TRIDENT_BASE_RNG_H_
