#include "pipeline/stage_runner.h"

#include <chrono>
#include <cmath>
#include <limits>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/autograd.h>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "pipeline/weight_gradients.h"

namespace trident {

class PipelineStageRunner::Impl {
 public:
  Impl(LayerSequence& layers, const ProcessGroup& pipeline, const PipelineSchedule& schedule,
       StageRunnerOptions options)
      : layers_(layers),
        pipeline_(pipeline),
        schedule_(schedule),
        options_(std::move(options)),
        stage_(pipeline.rank()),
        stages_(pipeline.size()),
        chunks_(static_cast<int>(options_.chunks.size())) {}

  absl::StatusOr<double> Run(const std::vector<at::Tensor>& inputs,
                             const std::vector<at::Tensor>& targets, bool train);

  std::vector<TimelineEvent> timeline;
  int peak_live = 0;

 private:
  // A checkpointed segment of one micro-batch: layers [first, end) ran on
  // `input` without gradients; `after` is the leaf later layers saw.
  struct Checkpointed {
    int64_t first, end;
    at::Tensor input, after, rng;
    at::Tensor recomputed;  // the segment's output rerun with gradients, once recomputed
  };
  // Everything one micro-batch of one chunk holds between its ops.
  struct Slot {
    at::Tensor input;     // the chunk's input (a leaf when received, to read its gradient)
    at::Tensor output;    // its output, or the scaled loss on the last virtual stage
    at::Tensor grad;      // the received gradient of `output`
    at::Tensor received;  // the received activation, before its forward
    std::vector<Checkpointed> checkpoints;
    internal::DeferredWeightGradients weights;  // split backward: weight gradients to run
  };

  int VirtualStage(int chunk) const { return chunk * stages_ + stage_; }
  bool FirstVirtual(int chunk) const { return VirtualStage(chunk) == 0; }
  bool LastVirtual(int chunk) const { return VirtualStage(chunk) == chunks_ * stages_ - 1; }
  int Next() const { return (stage_ + 1) % stages_; }
  int Previous() const { return (stage_ + stages_ - 1) % stages_; }
  // Message tags, by the sending virtual stage: unique per message in a step.
  int ActivationTag(int from_virtual, int m) const { return 2 * (from_virtual * micro_ + m); }
  int GradTag(int from_virtual, int m) const { return 2 * (from_virtual * micro_ + m) + 1; }
  Slot& At(const Instruction& inst, int m) { return slots_[inst.chunk * micro_ + m]; }
  at::Tensor Buffer() const {
    return at::empty(options_.boundary_shape, at::TensorOptions().dtype(options_.boundary_dtype));
  }

  absl::Status Execute(const Instruction& inst, const std::vector<at::Tensor>& inputs);
  absl::StatusOr<at::Tensor> Forward(int chunk, int m, const at::Tensor& input);
  // Reruns a slot's checkpointed segments (once; Backward calls it too).
  absl::Status Recompute(int chunk, int m);
  // The input gradient, and the weight gradients too unless `split`.
  absl::Status Backward(int chunk, int m, bool split);
  // Backward from `root` with gradient `grad` (undefined for a scalar loss).
  void BackwardFrom(Slot& slot, const at::Tensor& root, const at::Tensor& grad, bool split);
  absl::Status SendActivation(const Instruction& inst);
  absl::Status SendGrad(const Instruction& inst);
  absl::Status RecvActivation(const Instruction& inst, int m);
  absl::Status RecvGrad(const Instruction& inst, int m);
  absl::Status CompleteSends(bool all);
  static at::Tensor RngState();
  static void SetRngState(const at::Tensor& state);

  LayerSequence& layers_;
  const ProcessGroup& pipeline_;
  const PipelineSchedule& schedule_;
  StageRunnerOptions options_;
  int stage_, stages_, chunks_;
  int micro_ = 0;
  std::vector<Slot> slots_;  // chunk * micro_ + m
  std::vector<at::Tensor> targets_;
  std::vector<std::pair<PendingWork, at::Tensor>> sends_;  // in flight, with their tensors
  std::vector<PendingWork> posted_;  // receives started by kPostSendActivationRecvGrad
  internal::DeferredWeightGradients::Parameters parameters_;
  double loss_sum_ = 0;
};

absl::StatusOr<at::Tensor> PipelineStageRunner::Impl::Forward(int chunk, int m,
                                                              const at::Tensor& input) {
  const StageChunk& c = options_.chunks[chunk];
  const int64_t checkpoint_end = c.first_layer + c.checkpointed_layers;
  at::Tensor x = input;
  std::vector<Checkpointed>& saved = slots_[chunk * micro_ + m].checkpoints;
  saved.clear();
  TRIDENT_RETURN_IF_ERROR(CatchExceptions(absl::StrCat("forward of micro-batch ", m), [&] {
    for (int64_t first = c.first_layer; first < c.end_layer;) {
      const int64_t end =
          std::min(first + std::max<int64_t>(1, options_.checkpoint_num_layers), c.end_layer);
      if (first >= checkpoint_end) {
        for (int64_t i = first; i < end; ++i) x = layers_.RunLayer(i, x);
        first = end;
        continue;
      }
      // Keep only the segment's input and the RNG state; rerun it in backward.
      Checkpointed segment{first, std::min(end, checkpoint_end), x, at::Tensor(), RngState(),
                           at::Tensor()};
      at::Tensor out = x;
      {
        at::NoGradGuard no_grad;
        for (int64_t i = segment.first; i < segment.end; ++i) out = layers_.RunLayer(i, out);
      }
      segment.after = out.requires_grad_(at::GradMode::is_enabled());
      x = segment.after;
      first = segment.end;
      saved.push_back(std::move(segment));
    }
    if (LastVirtual(chunk)) {
      at::Tensor loss = layers_.SequenceLoss(x, targets_[m]);
      loss_sum_ += loss.item<double>();
      const double scale = options_.loss_scale ? options_.loss_scale() : 1.0;
      x = loss / static_cast<double>(micro_);
      if (scale != 1.0) x = x * scale;
    }
  }));
  return x;
}

at::Tensor PipelineStageRunner::Impl::RngState() {
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

void PipelineStageRunner::Impl::SetRngState(const at::Tensor& state) {
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
}

absl::Status PipelineStageRunner::Impl::Recompute(int chunk, int m) {
  return CatchExceptions(absl::StrCat("recomputation of micro-batch ", m), [&] {
    std::vector<Checkpointed>& saved = slots_[chunk * micro_ + m].checkpoints;
    if (saved.empty() || saved.front().recomputed.defined()) return;
    // Each segment reruns with the RNG state of its forward, so dropout masks match.
    const at::Tensor state = RngState();
    for (Checkpointed& c : saved) {
      SetRngState(c.rng);
      at::Tensor out = c.input;
      for (int64_t i = c.first; i < c.end; ++i) out = layers_.RunLayer(i, out);
      c.recomputed = out;
    }
    SetRngState(state);
  });
}

void PipelineStageRunner::Impl::BackwardFrom(Slot& slot, const at::Tensor& root,
                                             const at::Tensor& grad, bool split) {
  const bool retain = split && slot.weights.Defer(root, parameters_);
  if (grad.defined()) {
    torch::autograd::backward({root}, {grad}, retain);
  } else {
    torch::autograd::backward({root}, {}, retain);
  }
}

absl::Status PipelineStageRunner::Impl::Backward(int chunk, int m, bool split) {
  TRIDENT_RETURN_IF_ERROR(Recompute(chunk, m));
  return CatchExceptions(absl::StrCat("backward of micro-batch ", m), [&] {
    Slot& slot = slots_[chunk * micro_ + m];
    BackwardFrom(slot, slot.output, LastVirtual(chunk) ? at::Tensor() : slot.grad, split);
    // Carry the gradient through the recomputed segments, latest first.
    for (auto it = slot.checkpoints.rbegin(); it != slot.checkpoints.rend(); ++it) {
      at::Tensor grad = it->after.grad();
      if (grad.defined() && it->recomputed.requires_grad()) {
        BackwardFrom(slot, it->recomputed, grad, split);
      }
    }
    slot.checkpoints.clear();
    slot.output = at::Tensor();  // free the activations as soon as they are used
    slot.grad = at::Tensor();
  });
}

absl::Status PipelineStageRunner::Impl::SendActivation(const Instruction& inst) {
  at::Tensor out = At(inst, inst.micro_batch).output.detach();
  TRIDENT_ASSIGN_OR_RETURN(
      PendingWork work,
      pipeline_.ISend(out, Next(), ActivationTag(VirtualStage(inst.chunk), inst.micro_batch)));
  sends_.emplace_back(std::move(work), out);
  return absl::OkStatus();
}

absl::Status PipelineStageRunner::Impl::SendGrad(const Instruction& inst) {
  Slot& slot = At(inst, inst.micro_batch);
  at::Tensor grad = slot.input.grad();
  if (!grad.defined()) grad = at::zeros(options_.boundary_shape);
  slot.input = at::Tensor();
  TRIDENT_ASSIGN_OR_RETURN(
      PendingWork work,
      pipeline_.ISend(grad, Previous(), GradTag(VirtualStage(inst.chunk), inst.micro_batch)));
  sends_.emplace_back(std::move(work), grad);
  return absl::OkStatus();
}

absl::Status PipelineStageRunner::Impl::RecvActivation(const Instruction& inst, int m) {
  Slot& slot = At(inst, m);
  slot.received = Buffer();
  return pipeline_.Recv(slot.received, Previous(), ActivationTag(VirtualStage(inst.chunk) - 1, m));
}

absl::Status PipelineStageRunner::Impl::RecvGrad(const Instruction& inst, int m) {
  Slot& slot = At(inst, m);
  slot.grad = Buffer();
  return pipeline_.Recv(slot.grad, Next(), GradTag(VirtualStage(inst.chunk) + 1, m));
}

// Completes the finished sends (all of them when `all`), surfacing their errors.
absl::Status PipelineStageRunner::Impl::CompleteSends(bool all) {
  std::vector<std::pair<PendingWork, at::Tensor>> still;
  for (auto& [work, tensor] : sends_) {
    if (all || work.IsCompleted()) {
      TRIDENT_RETURN_IF_ERROR(work.Wait());
    } else {
      still.emplace_back(std::move(work), std::move(tensor));
    }
  }
  sends_ = std::move(still);
  return absl::OkStatus();
}

absl::Status PipelineStageRunner::Impl::Execute(const Instruction& inst,
                                                const std::vector<at::Tensor>& inputs) {
  const int m = inst.micro_batch;
  switch (inst.op) {
    case Op::kLoadMicroBatch:
      return absl::OkStatus();  // the micro-batches are in memory already
    case Op::kRecvActivation:
      return RecvActivation(inst, m);
    case Op::kForward: {
      Slot& slot = At(inst, m);
      slot.input = FirstVirtual(inst.chunk)
                       ? inputs[m]
                       : slot.received.requires_grad_(at::GradMode::is_enabled());
      slot.received = at::Tensor();
      TRIDENT_ASSIGN_OR_RETURN(slot.output, Forward(inst.chunk, m, slot.input));
      peak_live = std::max<int>(peak_live, std::count_if(slots_.begin(), slots_.end(), [](const Slot& s) {
                                  return s.output.defined();
                                }));
      return absl::OkStatus();
    }
    case Op::kSendActivation:
      return SendActivation(inst);
    case Op::kRecvGrad:
      return RecvGrad(inst, m);
    case Op::kBackward:
    case Op::kBackwardInput:
      return Backward(inst.chunk, m, inst.op == Op::kBackwardInput);
    case Op::kBackwardWeight:
      return CatchExceptions(absl::StrCat("weight gradients of micro-batch ", m),
                             [&] { At(inst, m).weights.Run(); });
    case Op::kSendGrad:
      return SendGrad(inst);
    case Op::kSendActivationRecvGrad:
      TRIDENT_RETURN_IF_ERROR(SendActivation(inst));
      return RecvGrad(inst, inst.other);
    case Op::kSendGradRecvActivation:
      TRIDENT_RETURN_IF_ERROR(SendGrad(inst));
      return RecvActivation(inst, inst.other);
    case Op::kPostSendActivationRecvGrad: {
      TRIDENT_RETURN_IF_ERROR(SendActivation(inst));
      Slot& slot = At(inst, inst.other);
      slot.grad = Buffer();
      TRIDENT_ASSIGN_OR_RETURN(PendingWork recv,
                               pipeline_.IRecv(slot.grad, Next(),
                                               GradTag(VirtualStage(inst.chunk) + 1, inst.other)));
      posted_.push_back(std::move(recv));
      return absl::OkStatus();
    }
    case Op::kWaitPosted:
      for (PendingWork& work : posted_) TRIDENT_RETURN_IF_ERROR(work.Wait());
      posted_.clear();
      return absl::OkStatus();
    case Op::kRecompute:
      return Recompute(inst.chunk, m);
    case Op::kReduceTiedGrads:
      TRIDENT_RETURN_IF_ERROR(CompleteSends(/*all=*/true));
      return options_.reduce_tied_grads ? options_.reduce_tied_grads() : absl::OkStatus();
    case Op::kReduceDataParallelGrads:
      return options_.reduce_data_parallel_grads ? options_.reduce_data_parallel_grads()
                                                 : absl::OkStatus();
    case Op::kOptimizerStep:
      return options_.optimizer_step ? options_.optimizer_step() : absl::OkStatus();
  }
  return absl::InternalError(absl::StrCat("unknown pipeline instruction ", static_cast<int>(inst.op)));
}

absl::StatusOr<double> PipelineStageRunner::Impl::Run(const std::vector<at::Tensor>& inputs,
                                                      const std::vector<at::Tensor>& targets,
                                                      bool train) {
  micro_ = static_cast<int>(std::max(inputs.size(), targets.size()));
  TRIDENT_RETURN_IF_ERROR(schedule_.Check(stages_, micro_));
  if (chunks_ != schedule_.num_chunks()) {
    return absl::InvalidArgumentError(absl::StrCat("schedule ", schedule_.name(), " runs ",
                                                   schedule_.num_chunks(),
                                                   " model chunk(s) per rank; the runner got ",
                                                   chunks_));
  }
  if (parameters_.empty()) {
    TRIDENT_RETURN_IF_ERROR(CatchExceptions("listing the stage's parameters", [&] {
      for (const StageChunk& c : options_.chunks) {
        for (int64_t i = c.first_layer; i < c.end_layer; ++i) {
          for (const auto& [name, p] : layers_.LayerParameters(i)) {
            parameters_.insert(p.unsafeGetTensorImpl());
          }
        }
      }
    }));
  }
  targets_ = targets;
  slots_.clear();
  slots_.resize(chunks_ * micro_);
  loss_sum_ = 0;
  peak_live = 0;
  std::vector<Instruction> program;
  if (train) {
    program = schedule_.Instructions(stage_, stages_, micro_);
  } else {
    // Forwards only, micro-batch by micro-batch through the chunks.
    for (int m = 0; m < micro_; ++m) {
      for (int c = 0; c < chunks_; ++c) {
        if (!FirstVirtual(c)) program.push_back({Op::kRecvActivation, m, -1, c});
        program.push_back({Op::kForward, m, -1, c});
        if (!LastVirtual(c)) program.push_back({Op::kSendActivation, m, -1, c});
      }
    }
  }
  timeline.clear();
  const auto step_start = std::chrono::steady_clock::now();
  auto seconds = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start).count();
  };
  for (const Instruction& inst : program) {
    const double start = seconds();
    TRIDENT_RETURN_IF_ERROR(Execute(inst, inputs));
    if (inst.op != Op::kLoadMicroBatch) {
      timeline.push_back({stage_, inst.op, inst.micro_batch, inst.chunk, start, seconds()});
    }
    TRIDENT_RETURN_IF_ERROR(CompleteSends(/*all=*/false));
  }
  TRIDENT_RETURN_IF_ERROR(CompleteSends(/*all=*/true));
  slots_.clear();
  if (!LastVirtual(chunks_ - 1)) return std::numeric_limits<double>::quiet_NaN();
  return loss_sum_ / micro_;
}

PipelineStageRunner::PipelineStageRunner(LayerSequence& layers, const ProcessGroup& pipeline,
                                         const PipelineSchedule& schedule,
                                         StageRunnerOptions options)
    : impl_(std::make_unique<Impl>(layers, pipeline, schedule, std::move(options))) {}

PipelineStageRunner::~PipelineStageRunner() = default;

absl::StatusOr<double> PipelineStageRunner::RunStep(const std::vector<at::Tensor>& inputs,
                                                    const std::vector<at::Tensor>& targets) {
  return impl_->Run(inputs, targets, /*train=*/true);
}

absl::StatusOr<double> PipelineStageRunner::RunForward(const std::vector<at::Tensor>& inputs,
                                                       const std::vector<at::Tensor>& targets) {
  at::NoGradGuard no_grad;
  return impl_->Run(inputs, targets, /*train=*/false);
}

const std::vector<TimelineEvent>& PipelineStageRunner::timeline() const { return impl_->timeline; }

int PipelineStageRunner::peak_live_activations() const { return impl_->peak_live; }

absl::Status ReduceTiedGradients(const std::vector<std::pair<std::string, at::Tensor>>& tied,
                                 const ProcessGroup& pipeline) {
  const int stage = pipeline.rank(), last = pipeline.size() - 1;
  if (last == 0 || (stage != 0 && stage != last)) return absl::OkStatus();
  const int peer = stage == 0 ? last : 0;
  int tag = 1 << 20;
  for (const auto& [name, parameter] : tied) {
    at::Tensor mine = parameter.grad().defined() ? parameter.grad() : at::zeros_like(parameter);
    at::Tensor theirs = at::empty_like(mine);
    TRIDENT_ASSIGN_OR_RETURN(PendingWork recv, pipeline.IRecv(theirs, peer, tag));
    TRIDENT_ASSIGN_OR_RETURN(PendingWork send, pipeline.ISend(mine, peer, tag));
    TRIDENT_RETURN_IF_ERROR(send.Wait());
    TRIDENT_RETURN_IF_ERROR(recv.Wait());
    // The first stage's part first on both sides, so both sums round the same way.
    at::Tensor sum = stage == 0 ? mine + theirs : theirs + mine;
    if (parameter.grad().defined()) {
      parameter.grad().copy_(sum);
    } else {
      at::Tensor p = parameter;
      p.mutable_grad() = sum;
    }
    ++tag;
  }
  return absl::OkStatus();
}

}  // namespace trident
