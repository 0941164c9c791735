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
// (fp32, or bf16) repeated for a second on one thread. Measured once per
// machine (by CPU model) and dtype, and cached under ~/.cache/trident.
double MeasureCorePeakFlops(at::ScalarType dtype = at::kFloat);

// The whole job's peak FLOP/s. On CPU: the per-core peak for `precision`'s
// compute dtype (measured by each node's local rank 0 while its other ranks
// wait) times the cores the job uses. On CUDA: the GPUs' dense peak for `precision`'s compute dtype, from a
// table of known devices (0 when the device is unknown).
absl::StatusOr<double> JobPeakFlops(const Topology& topology, const std::string& device,
                                    const std::string& precision);

}  // namespace internal
}  // namespace trident

#endif  // TRIDENT_TRAINER_INTERNAL_PEAK_FLOPS_H_
