#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "pipeline/pipeline.h"

namespace trident {
namespace {

void AppendStepEnd(std::vector<Instruction>* out) {
  out->push_back({Op::kReduceTiedGrads});
  out->push_back({Op::kReduceDataParallelGrads});
  out->push_back({Op::kOptimizerStep});
}

// Load, receive, forward, send of micro-batch m (as far as `stage` needs each).
void AppendForward(std::vector<Instruction>* out, int stage, int stages, int m, bool receive,
                   bool send) {
  if (stage == 0 || stage == stages - 1) out->push_back({Op::kLoadMicroBatch, m});
  if (receive && stage > 0) out->push_back({Op::kRecvActivation, m});
  out->push_back({Op::kForward, m});
  if (send && stage < stages - 1) out->push_back({Op::kSendActivation, m});
}

class GPipe : public PipelineSchedule {
 public:
  std::string name() const override { return "gpipe"; }
  std::vector<Instruction> Instructions(int stage, int stages, int micro) const override {
    std::vector<Instruction> out;
    for (int m = 0; m < micro; ++m) AppendForward(&out, stage, stages, m, true, true);
    for (int m = 0; m < micro; ++m) {
      if (stage < stages - 1) out.push_back({Op::kRecvGrad, m});
      out.push_back({Op::kBackward, m});
      if (stage > 0) out.push_back({Op::kSendGrad, m});
    }
    AppendStepEnd(&out);
    return out;
  }
};

class OneFOneB : public PipelineSchedule {
 public:
  explicit OneFOneB(std::string name = "1f1b", bool last_recomputes = true,
                    bool pre_recompute = false)
      : name_(std::move(name)), last_recomputes_(last_recomputes), pre_recompute_(pre_recompute) {}
  std::string name() const override { return name_; }
  bool RecomputesOnLastStage() const override { return last_recomputes_; }
  std::vector<Instruction> Instructions(int stage, int stages, int micro) const override {
    std::vector<Instruction> out;
    const bool first = stage == 0, last = stage == stages - 1;
    const int warmup = std::min(stages - stage - 1, micro);
    for (int m = 0; m < warmup; ++m) AppendForward(&out, stage, stages, m, true, true);
    // Steady state: forward warmup + i, then backward i. The activation of the
    // forward goes out fused with the wait for backward i's gradient, and the
    // gradient of backward i goes out fused with the wait for the next activation.
    const int steady = micro - warmup;
    for (int i = 0; i < steady; ++i) {
      const int f = warmup + i;
      AppendForward(&out, stage, stages, f, /*receive=*/i == 0, /*send=*/false);
      if (pre_recompute_ && !last) {
        // Recompute backward i's activations while its gradient travels.
        out.push_back({Op::kPostSendActivationRecvGrad, f, i});
        out.push_back({Op::kRecompute, i});
        out.push_back({Op::kWaitPosted});
      } else {
        if (pre_recompute_) out.push_back({Op::kRecompute, i});
        if (!last) out.push_back({Op::kSendActivationRecvGrad, f, i});
      }
      out.push_back({Op::kBackward, i});
      if (!first) {
        if (i + 1 < steady) {
          out.push_back({Op::kSendGradRecvActivation, i, f + 1});
        } else {
          out.push_back({Op::kSendGrad, i});
        }
      }
    }
    for (int i = steady; i < micro; ++i) {
      if (pre_recompute_) out.push_back({Op::kRecompute, i});
      if (!last) out.push_back({Op::kRecvGrad, i});
      out.push_back({Op::kBackward, i});
      if (!first) out.push_back({Op::kSendGrad, i});
    }
    AppendStepEnd(&out);
    return out;
  }

 private:
  std::string name_;
  bool last_recomputes_;
  bool pre_recompute_;
};

}  // namespace

const char* OpName(Op op) {
  switch (op) {
    case Op::kLoadMicroBatch: return "load";
    case Op::kForward: return "forward";
    case Op::kBackward: return "backward";
    case Op::kSendActivation: return "send_activation";
    case Op::kRecvActivation: return "recv_activation";
    case Op::kSendGrad: return "send_grad";
    case Op::kRecvGrad: return "recv_grad";
    case Op::kSendActivationRecvGrad: return "send_activation_recv_grad";
    case Op::kSendGradRecvActivation: return "send_grad_recv_activation";
    case Op::kPostSendActivationRecvGrad: return "post_send_activation_recv_grad";
    case Op::kWaitPosted: return "wait_posted";
    case Op::kRecompute: return "recompute";
    case Op::kReduceTiedGrads: return "reduce_tied_grads";
    case Op::kReduceDataParallelGrads: return "reduce_data_parallel_grads";
    case Op::kOptimizerStep: return "optimizer_step";
  }
  return "?";
}

absl::Status PipelineSchedule::Check(int num_stages, int num_micro_batches) const {
  if (num_stages < 1 || num_micro_batches < 1) {
    return absl::InvalidArgumentError(absl::StrCat("schedule ", name(), " needs at least one stage "
                                                   "and one micro-batch; got ", num_stages,
                                                   " stages and ", num_micro_batches,
                                                   " micro-batches"));
  }
  return absl::OkStatus();
}

std::vector<std::string> ScheduleNames() {
  return {"gpipe", "1f1b", "last_no_recompute_1f1b", "pre_recompute_1f1b"};
}

absl::StatusOr<std::unique_ptr<PipelineSchedule>> MakeSchedule(absl::string_view name) {
  if (name == "gpipe") return std::unique_ptr<PipelineSchedule>(new GPipe());
  if (name == "1f1b") return std::unique_ptr<PipelineSchedule>(new OneFOneB());
  if (name == "last_no_recompute_1f1b") {
    return std::unique_ptr<PipelineSchedule>(new OneFOneB(std::string(name), false));
  }
  if (name == "pre_recompute_1f1b") {
    return std::unique_ptr<PipelineSchedule>(new OneFOneB(std::string(name), true, true));
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown schedule '", name, "'; choose ",
                                                 absl::StrJoin(ScheduleNames(), ", ")));
}

}  // namespace trident
