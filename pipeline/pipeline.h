// pipeline: pipeline-parallel schedules as per-rank instruction lists, a
// simulator that times them, and timelines (Chrome trace JSON, SVG).
//
// The executor that runs the instruction lists is stage_runner.h.
//
//   auto schedule = MakeSchedule("1f1b");
//   std::vector<Instruction> program = (*schedule)->Instructions(stage, 4, 8);
//   SimulationResult r = *Simulate(**schedule, {.num_stages = 4, .num_micro_batches = 8});
//   // r.bubble_fraction == 3 / 11 for equal stages
#ifndef TRIDENT_PIPELINE_PIPELINE_H_
#define TRIDENT_PIPELINE_PIPELINE_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/registry.h"

namespace trident {

enum class Op {
  kLoadMicroBatch,  // read micro-batch inputs (first stage) or targets (last)
  kForward,
  kBackward,                    // the whole backward: input and weight gradients
  kBackwardInput,               // split backward: the input gradient only (weight ones deferred)
  kBackwardWeight,              // split backward: micro_batch's deferred weight gradients
  kSendActivation,              // to the next stage
  kRecvActivation,              // from the previous stage
  kSendGrad,                    // to the previous stage
  kRecvGrad,                    // from the next stage
  kSendActivationRecvGrad,      // fused: send micro_batch's activation, receive other's gradient
  kSendGradRecvActivation,      // fused: send micro_batch's gradient, receive other's activation
  kPostSendActivationRecvGrad,  // start sending micro_batch's activation and receiving
                                // other's gradient; kWaitPosted completes both
  kWaitPosted,
  kRecompute,                // rerun micro_batch's checkpointed layers ahead of its backward
  kReduceTiedGrads,          // sum gradients of parameters shared between stages
  kReduceDataParallelGrads,  // average gradients over the stage's data-parallel group
  kOptimizerStep,
};
const char* OpName(Op op);

struct Instruction {
  Op op;
  int micro_batch = -1;  // the micro-batch the op works on (the one sent, for fused ops)
  int other = -1;        // fused ops: the micro-batch received
  // The model chunk of this rank the op works on: with C chunks per rank on S
  // ranks, chunk c of rank s is virtual stage c * S + s of C * S (C = 1 except
  // for interleaved schedules).
  int chunk = 0;
};

// A schedule generates each stage's instruction list for one training step.
class PipelineSchedule {
 public:
  virtual ~PipelineSchedule() = default;
  virtual std::string name() const = 0;
  // Model chunks per rank (virtual stages); 1 unless interleaved.
  virtual int num_chunks() const { return 1; }
  // An error (before any work) when the schedule cannot run these counts.
  virtual absl::Status Check(int num_stages, int num_micro_batches) const;
  virtual std::vector<Instruction> Instructions(int stage, int num_stages, int num_micro_batches) const = 0;
  // False for schedules whose last stage never recomputes activations (it
  // consumes them at once), whatever checkpointing the other stages use.
  virtual bool RecomputesOnLastStage() const { return true; }
};

// "gpipe" (all forwards, then all backwards), "1f1b" (warm-up forwards, then
// one forward one backward with fused send/receive pairs, then cool-down),
// "last_no_recompute_1f1b" (1f1b whose last stage never recomputes),
// "pre_recompute_1f1b" (1f1b that recomputes a micro-batch's checkpointed
// layers while its gradient is on the way), "shifted_critical_path"
// (pre_recompute plus last_no_recompute, and every stage before the last runs
// one more warm-up forward: on the second-to-last stage the first backward and
// the third forward swap, so the gradient chain leaves the last stages sooner;
// needs 4 micro-batches), "interleaved_1f1b" (Megatron's interleaved 1F1B over
// `virtual_stages` model chunks per rank; micro-batches a multiple of the
// stages) or "zb_h1" (zero-bubble H1: backward split into the input gradient,
// sent at once, and the weight gradient, deferred into the bubbles).
//
// Schedules are registered by name (a user's own too: register a factory with
// ScheduleRegistry() at static initialisation); a factory gets the number of
// model chunks per rank and errors when it cannot run that many.
absl::StatusOr<std::unique_ptr<PipelineSchedule>> MakeSchedule(absl::string_view name, int virtual_stages = 1);
using ScheduleFactory = std::function<absl::StatusOr<std::unique_ptr<PipelineSchedule>>(int virtual_stages)>;
Registry<ScheduleFactory>& ScheduleRegistry();
std::vector<std::string> ScheduleNames();

// One timed instruction of a timeline.
struct TimelineEvent {
  int stage = 0;
  Op op = Op::kForward;
  int micro_batch = -1;
  int chunk = 0;
  double start = 0, end = 0;  // seconds from the step's start
};

struct SimulationOptions {
  int num_stages = 2;
  int num_micro_batches = 4;
  // Per stage (rank), or one value for all; a rank's chunk takes its share.
  std::vector<double> forward_seconds = {1.0};
  std::vector<double> backward_seconds = {2.0};   // input and weight gradients together
  double weight_grad_fraction = 0.5;              // of backward_seconds, for schedules that split it
  double comm_seconds = 0.0;                      // a message's flight time
  std::vector<double> recompute_seconds = {0.0};  // per stage, or one value for all
  // Measured compute instructions (a run's timeline: stage, op, micro-batch,
  // chunk, start, end) whose durations replace the per-stage values for the
  // instructions they match: the schedule replayed with a run's exact times,
  // so a gap between the run and the replay is the runtime's own.
  std::vector<TimelineEvent> replay;
};

struct SimulationResult {
  double makespan = 0;         // seconds from the first instruction to the last
  double bubble_fraction = 0;  // 1 - compute time / (stages * makespan)
  std::vector<TimelineEvent> events;
};

// Runs every stage's instruction list against the others: receives wait for
// the matching send plus comm_seconds; sends do not block. Errors on a
// schedule that deadlocks or leaves messages unmatched.
absl::StatusOr<SimulationResult> Simulate(const PipelineSchedule& schedule, const SimulationOptions& options);

// The timeline as Chrome trace-event JSON (Perfetto, chrome://tracing): one
// thread per stage (process 0), one complete event per instruction, and
// `more_events` (trace-event objects, comma-separated) beside them.
std::string ChromeTraceJson(const std::vector<TimelineEvent>& events, const std::string& more_events = "");
// The timeline as an SVG picture: one row per stage, forward, backward and
// communication in distinct colours, micro-batch numbers in the boxes.
std::string TimelineSvg(const std::vector<TimelineEvent>& events, const std::string& title);

}  // namespace trident

#endif  // TRIDENT_PIPELINE_PIPELINE_H_
