#include <algorithm>
#include <map>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "pipeline/pipeline.h"

namespace trident {
namespace {

// A message between virtual stages: (is_gradient, from, to, micro-batch).
using Message = std::tuple<bool, int, int, int>;

absl::StatusOr<std::vector<double>> PerStage(const std::vector<double>& values, int stages, const char* what) {
  if (values.size() == 1) return std::vector<double>(stages, values[0]);
  if (static_cast<int>(values.size()) == stages) return values;
  return absl::InvalidArgumentError(
      absl::StrCat(what, " has ", values.size(), " values; give one, or one per stage (", stages, ")"));
}

}  // namespace

absl::StatusOr<SimulationResult> Simulate(const PipelineSchedule& schedule, const SimulationOptions& options) {
  const int S = options.num_stages, M = options.num_micro_batches;
  TRIDENT_RETURN_IF_ERROR(schedule.Check(S, M));
  TRIDENT_ASSIGN_OR_RETURN(std::vector<double> forward, PerStage(options.forward_seconds, S, "forward_seconds"));
  TRIDENT_ASSIGN_OR_RETURN(std::vector<double> backward, PerStage(options.backward_seconds, S, "backward_seconds"));
  TRIDENT_ASSIGN_OR_RETURN(std::vector<double> recompute, PerStage(options.recompute_seconds, S, "recompute_seconds"));
  const int C = schedule.num_chunks();
  std::map<std::tuple<int, Op, int, int>, double> replayed;  // (stage, op, micro-batch, chunk) -> seconds
  for (const TimelineEvent& e : options.replay) replayed[{e.stage, e.op, e.micro_batch, e.chunk}] = e.end - e.start;
  std::vector<Instruction> posted(S, Instruction{Op::kWaitPosted});  // receive awaited by kWaitPosted
  std::vector<std::vector<Instruction>> programs;
  for (int s = 0; s < S; ++s) {
    programs.push_back(schedule.Instructions(s, S, M));
    // A schedule without explicit recomputation recomputes inside backward.
    const bool explicit_recompute = std::any_of(programs[s].begin(), programs[s].end(),
                                                [](const Instruction& inst) { return inst.op == Op::kRecompute; });
    if (!explicit_recompute && (s < S - 1 || schedule.RecomputesOnLastStage())) {
      backward[s] += recompute[s];
    }
  }
  std::vector<size_t> pc(S, 0);
  std::vector<double> clock(S, 0);
  std::vector<bool> fused_sent(S, false);
  std::map<Message, double> in_flight;  // sent, not yet received: arrival time
  SimulationResult result;
  double compute = 0;
  // Messages go between virtual stages: chunk c of rank s is c * S + s.
  auto send = [&](int s, const Instruction& inst, bool gradient) {
    const int from = inst.chunk * S + s, to = gradient ? from - 1 : from + 1;
    in_flight[{gradient, from, to, inst.micro_batch}] = clock[s] + options.comm_seconds;
    result.events.push_back({s, gradient ? Op::kSendGrad : Op::kSendActivation, inst.micro_batch, inst.chunk, clock[s],
                             clock[s] + options.comm_seconds});
  };
  // Receives micro-batch m if it was sent; false when the stage must wait.
  auto receive = [&](int s, const Instruction& inst, bool gradient, int m) {
    const int to = inst.chunk * S + s, from = gradient ? to + 1 : to - 1;
    auto it = in_flight.find({gradient, from, to, m});
    if (it == in_flight.end()) return false;
    clock[s] = std::max(clock[s], it->second);
    in_flight.erase(it);
    return true;
  };
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < S; ++s) {
      while (pc[s] < programs[s].size()) {
        const Instruction& inst = programs[s][pc[s]];
        bool done = true;
        switch (inst.op) {
          case Op::kPostSendActivationRecvGrad:
            send(s, inst, false);
            posted[s] = inst;
            break;
          case Op::kWaitPosted:
            done = posted[s].op != Op::kPostSendActivationRecvGrad || receive(s, posted[s], true, posted[s].other);
            if (done) posted[s] = Instruction{Op::kWaitPosted};
            break;
          case Op::kForward:
          case Op::kBackward:
          case Op::kBackwardInput:
          case Op::kBackwardWeight:
          case Op::kRecompute: {
            const double weight = backward[s] * options.weight_grad_fraction;
            double duration = inst.op == Op::kForward          ? forward[s]
                              : inst.op == Op::kBackward       ? backward[s]
                              : inst.op == Op::kBackwardInput  ? backward[s] - weight
                              : inst.op == Op::kBackwardWeight ? weight
                                                               : recompute[s];
            duration /= C;  // a chunk holds 1/C of the rank's layers
            auto measured = replayed.find({s, inst.op, inst.micro_batch, inst.chunk});
            if (measured != replayed.end()) duration = measured->second;
            result.events.push_back({s, inst.op, inst.micro_batch, inst.chunk, clock[s], clock[s] + duration});
            clock[s] += duration;
            compute += duration;
            break;
          }
          case Op::kSendActivation:
            send(s, inst, false);
            break;
          case Op::kSendGrad:
            send(s, inst, true);
            break;
          case Op::kRecvActivation:
            done = receive(s, inst, false, inst.micro_batch);
            break;
          case Op::kRecvGrad:
            done = receive(s, inst, true, inst.micro_batch);
            break;
          case Op::kSendActivationRecvGrad:
          case Op::kSendGradRecvActivation: {
            const bool gradient_out = inst.op == Op::kSendGradRecvActivation;
            if (!fused_sent[s]) {
              send(s, inst, gradient_out);
              fused_sent[s] = true;
            }
            done = receive(s, inst, !gradient_out, inst.other);
            if (done) fused_sent[s] = false;
            break;
          }
          default:
            break;  // loads, reductions and the optimizer step take no simulated time
        }
        if (!done) break;
        ++pc[s];
        progress = true;
      }
    }
  }
  std::vector<std::string> blocked;
  for (int s = 0; s < S; ++s) {
    if (pc[s] < programs[s].size()) {
      const Instruction& inst = programs[s][pc[s]];
      blocked.push_back(absl::StrCat("stage ", s, " at ", OpName(inst.op), " of micro-batch ",
                                     inst.op == Op::kSendActivationRecvGrad || inst.op == Op::kSendGradRecvActivation
                                         ? inst.other
                                         : inst.micro_batch));
    }
  }
  if (!blocked.empty()) {
    return absl::InternalError(absl::StrCat("schedule ", schedule.name(), " deadlocks with ", S, " stages and ", M,
                                            " micro-batches: ", absl::StrJoin(blocked, "; ")));
  }
  if (!in_flight.empty()) {
    return absl::InternalError(
        absl::StrCat("schedule ", schedule.name(), " sends ", in_flight.size(), " message(s) nobody receives"));
  }
  for (double c : clock) result.makespan = std::max(result.makespan, c);
  result.bubble_fraction = result.makespan > 0 ? 1.0 - compute / (S * result.makespan) : 0.0;
  return result;
}

}  // namespace trident
