#include <algorithm>
#include <deque>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "pipeline/pipeline.h"

namespace trident {
namespace {

void AppendStepEnd(std::vector<Instruction>* out) {
  out->push_back({Op::kReduceTiedGrads});
  out->push_back({Op::kReduceDataParallelGrads});
  out->push_back({Op::kOptimizerStep});
}

// Chunk `chunk` of rank `stage` as virtual stage `chunk * stages + stage` of
// `chunks * stages`, for deciding what it loads, receives and sends.
struct Place {
  int stage, stages, chunk = 0, chunks = 1;
  int virtual_stage() const { return chunk * stages + stage; }
  bool first() const { return virtual_stage() == 0; }
  bool last() const { return virtual_stage() == chunks * stages - 1; }
};

// Load, receive, forward, send of micro-batch m (as far as the place needs each).
void AppendForward(std::vector<Instruction>* out, const Place& at, int m, bool receive, bool send) {
  if (at.first() || at.last()) out->push_back({Op::kLoadMicroBatch, m, -1, at.chunk});
  if (receive && !at.first()) out->push_back({Op::kRecvActivation, m, -1, at.chunk});
  out->push_back({Op::kForward, m, -1, at.chunk});
  if (send && !at.last()) out->push_back({Op::kSendActivation, m, -1, at.chunk});
}

// Receive the gradient, run `backward` (kBackward or kBackwardInput), send the
// input gradient of micro-batch m.
void AppendBackward(std::vector<Instruction>* out, const Place& at, int m, Op backward, bool receive, bool send) {
  if (receive && !at.last()) out->push_back({Op::kRecvGrad, m, -1, at.chunk});
  out->push_back({backward, m, -1, at.chunk});
  if (send && !at.first()) out->push_back({Op::kSendGrad, m, -1, at.chunk});
}

class GPipe : public PipelineSchedule {
 public:
  std::string name() const override { return "gpipe"; }
  std::vector<Instruction> Instructions(int stage, int stages, int micro) const override {
    const Place at{stage, stages};
    std::vector<Instruction> out;
    for (int m = 0; m < micro; ++m) AppendForward(&out, at, m, true, true);
    for (int m = 0; m < micro; ++m) AppendBackward(&out, at, m, Op::kBackward, true, true);
    AppendStepEnd(&out);
    return out;
  }
};

// 1F1B and its variants: `warmup` forwards, then one forward and one backward at
// a time with fused send/receive pairs, then the remaining backwards.
class OneFOneB : public PipelineSchedule {
 public:
  struct Variant {
    std::string name = "1f1b";
    bool last_recomputes = true;
    bool pre_recompute = false;
    bool extra_warmup = false;  // stages before the last run one more warm-up forward
    int min_micro_batches = 1;
    // Split backward into input and weight gradients, deferring the latter (ZB-H1).
    bool split_backward = false;
  };
  explicit OneFOneB(Variant variant) : v_(std::move(variant)) {}
  std::string name() const override { return v_.name; }
  bool RecomputesOnLastStage() const override { return v_.last_recomputes; }
  absl::Status Check(int num_stages, int num_micro_batches) const override {
    if (num_micro_batches < v_.min_micro_batches && num_stages > 1) {
      return absl::InvalidArgumentError(absl::StrCat("schedule ", v_.name, " needs at least ", v_.min_micro_batches,
                                                     " micro-batches per step; got ", num_micro_batches,
                                                     " (raise grad_accumulation_steps by lowering micro_batch_size)"));
    }
    return PipelineSchedule::Check(num_stages, num_micro_batches);
  }
  std::vector<Instruction> Instructions(int stage, int stages, int micro) const override {
    std::vector<Instruction> out;
    const Place at{stage, stages};
    const bool first = at.first(), last = at.last();
    const Op backward = v_.split_backward ? Op::kBackwardInput : Op::kBackward;
    const bool recomputes = !last || v_.last_recomputes;
    std::deque<int> deferred;              // micro-batches whose weight gradients wait
    auto run_weights = [&](size_t keep) {  // until at most `keep` wait
      for (; deferred.size() > keep; deferred.pop_front()) {
        out.push_back({Op::kBackwardWeight, deferred.front()});
      }
    };
    auto defer_weights = [&](int m) {
      if (v_.split_backward) deferred.push_back(m);
    };
    // Weight gradients run right after their input gradient, except those of
    // the last S micro-batches: they wait, so that the step's last gradients
    // reach the first stage sooner, and fill the cool-down's waits for the next
    // gradient and the end of the step.
    auto keep = [&](int i) { return i >= micro - stages ? deferred.size() : 0; };
    const int warmup = std::min(stages - stage - 1 + (v_.extra_warmup && !last ? 1 : 0), micro);
    for (int m = 0; m < warmup; ++m) AppendForward(&out, at, m, true, true);
    // Steady state: forward warmup + i, then backward i. The activation of the
    // forward goes out fused with the wait for backward i's gradient, and the
    // gradient of backward i goes out fused with the wait for the next activation.
    const int steady = micro - warmup;
    for (int i = 0; i < steady; ++i) {
      const int f = warmup + i;
      AppendForward(&out, at, f, /*receive=*/i == 0, /*send=*/false);
      if (v_.pre_recompute && !last) {
        // Recompute backward i's activations while its gradient travels.
        out.push_back({Op::kPostSendActivationRecvGrad, f, i});
        out.push_back({Op::kRecompute, i});
        out.push_back({Op::kWaitPosted});
      } else {
        if (v_.pre_recompute && recomputes) out.push_back({Op::kRecompute, i});
        if (!last) out.push_back({Op::kSendActivationRecvGrad, f, i});
      }
      out.push_back({backward, i});
      if (!first) {
        if (i + 1 < steady) {
          out.push_back({Op::kSendGradRecvActivation, i, f + 1});
        } else {
          out.push_back({Op::kSendGrad, i});
        }
      }
      defer_weights(i);
      run_weights(keep(i));
    }
    for (int i = steady; i < micro; ++i) {
      if (!deferred.empty()) run_weights(deferred.size() - 1);
      if (v_.pre_recompute && recomputes) out.push_back({Op::kRecompute, i});
      AppendBackward(&out, at, i, backward, true, true);
      defer_weights(i);
      run_weights(keep(i));
    }
    run_weights(0);
    AppendStepEnd(&out);
    return out;
  }

 private:
  Variant v_;
};

// Megatron's interleaved 1F1B: rank s holds chunks c = 0..C-1 (virtual stages
// c * S + s); forwards run in groups of S micro-batches per chunk, backwards the
// same with the chunks reversed.
class Interleaved1F1B : public PipelineSchedule {
 public:
  explicit Interleaved1F1B(int chunks) : chunks_(chunks) {}
  std::string name() const override { return "interleaved_1f1b"; }
  int num_chunks() const override { return chunks_; }
  absl::Status Check(int num_stages, int num_micro_batches) const override {
    if (chunks_ < 2) {
      return absl::InvalidArgumentError(
          absl::StrCat("schedule interleaved_1f1b needs virtual_stages >= 2 (model chunks per pipeline "
                       "rank); got ",
                       chunks_, ". Use 1f1b for one chunk per rank"));
    }
    if (num_micro_batches % num_stages != 0) {
      return absl::InvalidArgumentError(absl::StrCat("schedule interleaved_1f1b needs the micro-batches per step (",
                                                     num_micro_batches, ") to be a multiple of the pipeline stages (",
                                                     num_stages, ")"));
    }
    return PipelineSchedule::Check(num_stages, num_micro_batches);
  }
  std::vector<Instruction> Instructions(int stage, int stages, int micro) const override {
    const int total = micro * chunks_;
    auto place = [&](int k, bool forward) {
      const int c = (k / stages) % chunks_;
      return Place{stage, stages, forward ? c : chunks_ - 1 - c, chunks_};
    };
    auto micro_batch = [&](int k) { return (k / (stages * chunks_)) * stages + k % stages; };
    const int warmup = micro == stages ? total : std::min((stages - stage - 1) * 2 + (chunks_ - 1) * stages, total);
    std::vector<Instruction> out;
    auto forward = [&](int k) { AppendForward(&out, place(k, true), micro_batch(k), true, true); };
    auto backward = [&](int k) { AppendBackward(&out, place(k, false), micro_batch(k), Op::kBackward, true, true); };
    for (int k = 0; k < warmup; ++k) forward(k);
    for (int i = 0; i < total - warmup; ++i) {
      forward(warmup + i);
      backward(i);
    }
    for (int i = std::max(total - warmup, 0); i < total; ++i) backward(i);
    AppendStepEnd(&out);
    return out;
  }

 private:
  int chunks_;
};

}  // namespace

const char* OpName(Op op) {
  switch (op) {
    case Op::kLoadMicroBatch:
      return "load";
    case Op::kForward:
      return "forward";
    case Op::kBackward:
      return "backward";
    case Op::kBackwardInput:
      return "backward_input";
    case Op::kBackwardWeight:
      return "backward_weight";
    case Op::kSendActivation:
      return "send_activation";
    case Op::kRecvActivation:
      return "recv_activation";
    case Op::kSendGrad:
      return "send_grad";
    case Op::kRecvGrad:
      return "recv_grad";
    case Op::kSendActivationRecvGrad:
      return "send_activation_recv_grad";
    case Op::kSendGradRecvActivation:
      return "send_grad_recv_activation";
    case Op::kPostSendActivationRecvGrad:
      return "post_send_activation_recv_grad";
    case Op::kWaitPosted:
      return "wait_posted";
    case Op::kRecompute:
      return "recompute";
    case Op::kReduceTiedGrads:
      return "reduce_tied_grads";
    case Op::kReduceDataParallelGrads:
      return "reduce_data_parallel_grads";
    case Op::kOptimizerStep:
      return "optimizer_step";
  }
  return "?";
}

absl::Status PipelineSchedule::Check(int num_stages, int num_micro_batches) const {
  if (num_stages < 1 || num_micro_batches < 1) {
    return absl::InvalidArgumentError(absl::StrCat("schedule ", name(),
                                                   " needs at least one stage "
                                                   "and one micro-batch; got ",
                                                   num_stages, " stages and ", num_micro_batches, " micro-batches"));
  }
  return absl::OkStatus();
}

Registry<ScheduleFactory>& ScheduleRegistry() {
  static auto* registry = new Registry<ScheduleFactory>("schedule");
  return *registry;
}

std::vector<std::string> ScheduleNames() { return ScheduleRegistry().Names(); }

absl::StatusOr<std::unique_ptr<PipelineSchedule>> MakeSchedule(absl::string_view name, int virtual_stages) {
  TRIDENT_ASSIGN_OR_RETURN(ScheduleFactory make, ScheduleRegistry().Find(name));
  return make(virtual_stages);
}

namespace {

// A schedule of one model chunk per rank: `variant` of 1F1B, or GPipe.
ScheduleFactory OneChunk(std::function<PipelineSchedule*()> make) {
  return [make](int virtual_stages) -> absl::StatusOr<std::unique_ptr<PipelineSchedule>> {
    std::unique_ptr<PipelineSchedule> schedule(make());
    if (virtual_stages != 1) {
      return absl::InvalidArgumentError(absl::StrCat("virtual_stages = ", virtual_stages,
                                                     " needs schedule interleaved_1f1b; schedule ", schedule->name(),
                                                     " runs one model chunk per pipeline rank"));
    }
    return schedule;
  };
}

// A variant of 1F1B named `name`, edited by `change`.
ScheduleFactory OneFOneBVariant(const char* name, std::function<void(OneFOneB::Variant&)> change) {
  return OneChunk([name, change] {
    OneFOneB::Variant v;
    v.name = name;
    change(v);
    return new OneFOneB(v);
  });
}

TRIDENT_REGISTER(ScheduleRegistry, "gpipe", OneChunk([] { return new GPipe(); }));
TRIDENT_REGISTER(ScheduleRegistry, "1f1b", OneFOneBVariant("1f1b", [](OneFOneB::Variant&) {}));
TRIDENT_REGISTER(ScheduleRegistry, "last_no_recompute_1f1b",
                 OneFOneBVariant("last_no_recompute_1f1b", [](OneFOneB::Variant& v) { v.last_recomputes = false; }));
TRIDENT_REGISTER(ScheduleRegistry, "pre_recompute_1f1b",
                 OneFOneBVariant("pre_recompute_1f1b", [](OneFOneB::Variant& v) { v.pre_recompute = true; }));
TRIDENT_REGISTER(ScheduleRegistry, "shifted_critical_path",
                 OneFOneBVariant("shifted_critical_path", [](OneFOneB::Variant& v) {
                   v.last_recomputes = false;
                   v.pre_recompute = true;
                   v.extra_warmup = true;
                   v.min_micro_batches = 4;
                 }));
TRIDENT_REGISTER(ScheduleRegistry, "zb_h1",
                 OneFOneBVariant("zb_h1", [](OneFOneB::Variant& v) { v.split_backward = true; }));
TRIDENT_REGISTER(ScheduleRegistry, "interleaved_1f1b",
                 [](int virtual_stages) -> absl::StatusOr<std::unique_ptr<PipelineSchedule>> {
                   return std::unique_ptr<PipelineSchedule>(new Interleaved1F1B(virtual_stages));
                 });

}  // namespace

}  // namespace trident
