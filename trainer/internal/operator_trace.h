// Operator-level profiles of one training step: every LibTorch operator (and
// user scope, collectives included) this process runs between
// StartOperatorRecording and StopOperatorRecording, recorded with LibTorch's
// profiler on the CPU, and on CUDA jobs every GPU kernel too. Private to
// //trainer.
#ifndef TRIDENT_TRAINER_INTERNAL_OPERATOR_TRACE_H_
#define TRIDENT_TRAINER_INTERNAL_OPERATOR_TRACE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace trident {
namespace internal {

struct OperatorEvent {
  std::string name;
  double start = 0, end = 0;  // seconds from the anchor scope's start
  int thread = 0;             // 0, 1, ... in the order threads (and GPU streams) first appear
  bool on_gpu = false;        // a GPU kernel or copy (its thread is its stream)
};

// The scope the trainer wraps around ForwardBackward: the pipeline
// timeline's zero, and the anchor operator times are measured from.
inline constexpr char kForwardBackwardScope[] = "trident::forward_backward";

// Errors when a LibTorch profiler is already running in this process.
// `gpu_kernels` records the GPU's kernels too (CUDA jobs).
absl::Status StartOperatorRecording(bool gpu_kernels);
// The events recorded since the start (after waiting for the GPU's queued
// work when kernels are recorded), times from the first occurrence of
// `anchor` (an error when it never ran).
absl::StatusOr<std::vector<OperatorEvent>> StopOperatorRecording(const std::string& anchor);

// Chrome trace-event objects ("ph":"X") for `events` on process `pid`, thread
// rows `first_tid` + thread, comma-separated, with thread_name metadata
// naming each row "`label` thread k".
std::string OperatorTraceEvents(const std::vector<OperatorEvent>& events, int pid, int first_tid,
                                const std::string& label);

// The operators that took the most time, by name, as a table of their
// self time (their own, not their callees'), calls and share of the step:
// the first `rows`. Where GPU kernels were recorded the table is of the
// kernels (the CPU's operators only queue them), with the GPU's busy time.
std::string OperatorBreakdown(const std::vector<OperatorEvent>& events, int rows);

}  // namespace internal
}  // namespace trident

#endif  // TRIDENT_TRAINER_INTERNAL_OPERATOR_TRACE_H_
