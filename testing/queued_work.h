// Long GPU work for tests that check an operation does not wait for it (the
// gpu-tagged tests of host copies and of NCCL collectives).
#ifndef TRIDENT_TESTING_QUEUED_WORK_H_
#define TRIDENT_TESTING_QUEUED_WORK_H_

#include <memory>

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>

namespace trident::testing {

// Queues about a second of products of the square device matrix `a` (4096
// wide on a recent GPU) on the current stream; the returned event is recorded
// after them, so query() is false while they run.
std::unique_ptr<c10::Event> QueueLongWork(const at::Tensor& a);

}  // namespace trident::testing

#endif  // TRIDENT_TESTING_QUEUED_WORK_H_
