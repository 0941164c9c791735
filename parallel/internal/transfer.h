// Moving names and named tensors between ranks through a process group (no
// shared filesystem assumed). Private to //parallel.
#ifndef TRIDENT_PARALLEL_INTERNAL_TRANSFER_H_
#define TRIDENT_PARALLEL_INTERNAL_TRANSFER_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "base/tensors.h"
#include "topology/topology.h"

namespace trident {
namespace internal {

// Sends `tensors` (names, dtypes, shapes, then the data) to group rank `peer`;
// RecvNamedTensors receives them there as CPU tensors.
absl::Status SendNamedTensors(const ProcessGroup& group, int peer, const NamedTensors& tensors);
absl::StatusOr<NamedTensors> RecvNamedTensors(const ProcessGroup& group, int peer);

}  // namespace internal
}  // namespace trident

#endif  // TRIDENT_PARALLEL_INTERNAL_TRANSFER_H_
