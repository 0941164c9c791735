// The peak a job's MFU is measured against.
#ifndef TRIDENT_TRAINER_INTERNAL_PEAK_FLOPS_H_
#define TRIDENT_TRAINER_INTERNAL_PEAK_FLOPS_H_

#include <string>

#include <c10/core/ScalarType.h>

#include "absl/status/statusor.h"
#include "topology/topology.h"

namespace trident {
namespace internal {

// Dense matrix-product FLOP/s of one core: a 1024-cube product of `dtype`
// (fp32, or bf16) repeated on one thread, the fastest window of 0.2 s. A
// shared machine only slows a window down (on one VM whole seconds ran at
// half speed), so the rate is cached under ~/.cache/trident per CPU model,
// OpenBLAS kernel set and dtype, and each call measures three more windows
// (ten the first time) and keeps the best rate yet.
double MeasureCorePeakFlops(at::ScalarType dtype = at::kFloat);

// The whole job's peak FLOP/s. On CPU: the per-core peak for `precision`'s
// compute dtype (measured by each node's local rank 0 while its other ranks
// wait, once per process) times the cores the job uses. On CUDA: the GPUs' dense peak for `precision`'s compute dtype,
// from a table of known devices (0 when the device is unknown).
absl::StatusOr<double> JobPeakFlops(const Topology& topology, const std::string& device, const std::string& precision);

// On CPU under a bf16 precision: a warning naming both per-core rates when
// this CPU multiplies bf16 more slowly than fp32 (without AVX-512 BF16 or AMX
// instructions oneDNN emulates bf16 products: 4.9 against 84.9 GFLOP/s per
// core, and steps 26-34x slower than fp32, on one such AMD EPYC); empty
// otherwise. The rates are MeasureCorePeakFlops's
// (cached; JobPeakFlops measures both for a CPU bf16 job).
std::string SlowBf16Warning(const std::string& device, const std::string& precision);
// The same from per-core rates in FLOP/s.
std::string SlowBf16Warning(double fp32_per_core, double bf16_per_core);

}  // namespace internal
}  // namespace trident

#endif  // TRIDENT_TRAINER_INTERNAL_PEAK_FLOPS_H_
