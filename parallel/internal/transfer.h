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

// Every rank's `strings`, by group rank.
absl::StatusOr<std::vector<std::vector<std::string>>> AllGatherStrings(
    const ProcessGroup& group, const std::vector<std::string>& strings);

// Sends `tensors` (names, dtypes, shapes, then the data) to group rank `peer`;
// RecvNamedTensors receives them there as CPU tensors.
absl::Status SendNamedTensors(const ProcessGroup& group, int peer, const NamedTensors& tensors);
absl::StatusOr<NamedTensors> RecvNamedTensors(const ProcessGroup& group, int peer);

// Whether any rank of `world` failed: every rank gets `local` back when it
// failed itself, otherwise an error naming the lowest failed rank when one did.
absl::Status AgreeOnFailure(const ProcessGroup& world, const absl::Status& local, const char* what);

}  // namespace internal
}  // namespace trident

#endif  // TRIDENT_PARALLEL_INTERNAL_TRANSFER_H_
