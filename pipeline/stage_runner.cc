#include "pipeline/stage_runner.h"

#include <chrono>
#include <cmath>
#include <limits>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/autograd.h>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace trident {
namespace {

// Message tags: activations and gradients of micro-batch m never share a tag.
int ActivationTag(int m) { return 2 * m; }
int GradTag(int m) { return 2 * m + 1; }

}  // namespace

PipelineStageRunner::PipelineStageRunner(LayerSequence& layers, const ProcessGroup& pipeline,
                                         const PipelineSchedule& schedule,
                                         StageRunnerOptions options)
    : layers_(layers),
      pipeline_(pipeline),
      schedule_(schedule),
      options_(std::move(options)),
      stage_(pipeline.rank()),
      stages_(pipeline.size()) {}

absl::StatusOr<at::Tensor> PipelineStageRunner::Forward(int m, const at::Tensor& input) {
  at::Tensor x = input;
  std::vector<Checkpointed>& saved = checkpoints_[m];
  saved.clear();
  TRIDENT_RETURN_IF_ERROR(CatchExceptions(absl::StrCat("forward of micro-batch ", m), [&] {
    for (int64_t first = options_.first_layer; first < options_.end_layer;) {
      const int64_t end = std::min(first + std::max<int64_t>(1, options_.checkpoint_num_layers),
                                   options_.end_layer);
      const bool checkpoint = first < options_.first_layer + options_.checkpointed_layers;
      if (!checkpoint) {
        for (int64_t i = first; i < end; ++i) x = layers_.ForwardLayer(i, x);
      } else {
        // Keep only the segment's input and the RNG state; rerun it in backward.
        Checkpointed c{first, std::min(end, options_.first_layer + options_.checkpointed_layers), x,
                       at::Tensor(), RngState(), at::Tensor()};
        at::Tensor out = x;
        {
          at::NoGradGuard no_grad;
          for (int64_t i = c.first; i < c.end; ++i) out = layers_.ForwardLayer(i, out);
        }
        c.after = out.requires_grad_(true);
        x = c.after;
        first = c.end;
        saved.push_back(std::move(c));
        continue;
      }
      first = end;
    }
    if (stage_ == stages_ - 1) {
      at::Tensor loss = layers_.SequenceLoss(x, targets_[m]);
      loss_sum_ += loss.item<double>();
      x = loss / static_cast<double>(targets_.size());
    }
  }));
  return x;
}

at::Tensor PipelineStageRunner::RngState() {
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

void PipelineStageRunner::SetRngState(const at::Tensor& state) {
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
}

absl::Status PipelineStageRunner::Recompute(int m) {
  return CatchExceptions(absl::StrCat("recomputation of micro-batch ", m), [&] {
    std::vector<Checkpointed>& saved = checkpoints_[m];
    if (saved.empty() || saved.front().recomputed.defined()) return;
    // Each segment reruns with the RNG state of its forward, so dropout masks match.
    const at::Tensor state = RngState();
    for (Checkpointed& c : saved) {
      SetRngState(c.rng);
      at::Tensor out = c.input;
      for (int64_t i = c.first; i < c.end; ++i) out = layers_.ForwardLayer(i, out);
      c.recomputed = out;
    }
    SetRngState(state);
  });
}

absl::Status PipelineStageRunner::Backward(int m) {
  TRIDENT_RETURN_IF_ERROR(Recompute(m));
  return CatchExceptions(absl::StrCat("backward of micro-batch ", m), [&] {
    if (stage_ == stages_ - 1) {
      outputs_[m].backward();
    } else {
      torch::autograd::backward({outputs_[m]}, {grads_[m]});
    }
    // Carry the gradient through the recomputed segments, latest first.
    std::vector<Checkpointed>& saved = checkpoints_[m];
    for (auto it = saved.rbegin(); it != saved.rend(); ++it) {
      at::Tensor grad = it->after.grad();
      if (grad.defined() && it->recomputed.requires_grad()) {
        torch::autograd::backward({it->recomputed}, {grad});
      }
    }
    saved.clear();
    outputs_[m] = at::Tensor();  // free the activations as soon as they are used
    grads_[m] = at::Tensor();
  });
}

absl::StatusOr<double> PipelineStageRunner::RunStep(const std::vector<at::Tensor>& inputs,
                                                    const std::vector<at::Tensor>& targets) {
  const int M = static_cast<int>(std::max(inputs.size(), targets.size()));
  TRIDENT_RETURN_IF_ERROR(schedule_.Check(stages_, M));
  targets_ = targets;
  inputs_.assign(M, at::Tensor());
  outputs_.assign(M, at::Tensor());
  grads_.assign(M, at::Tensor());
  received_activations_.assign(M, at::Tensor());
  checkpoints_.assign(M, {});
  loss_sum_ = 0;
  peak_live_ = 0;
  auto buffer = [&] {
    return at::empty(options_.boundary_shape, at::TensorOptions().dtype(options_.boundary_dtype));
  };
  auto recv_activation = [&](int m) -> absl::Status {
    received_activations_[m] = buffer();
    return pipeline_.Recv(received_activations_[m], stage_ - 1, ActivationTag(m));
  };
  auto recv_grad = [&](int m) -> absl::Status {
    grads_[m] = buffer();
    return pipeline_.Recv(grads_[m], stage_ + 1, GradTag(m));
  };
  auto input_grad = [&](int m) {
    at::Tensor g = inputs_[m].grad();
    inputs_[m] = at::Tensor();
    return g.defined() ? g : at::zeros(options_.boundary_shape);
  };
  timeline_.clear();
  const auto step_start = std::chrono::steady_clock::now();
  auto seconds = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start).count();
  };
  for (const Instruction& inst : schedule_.Instructions(stage_, stages_, M)) {
    const int m = inst.micro_batch;
    const double start = seconds();
    switch (inst.op) {
      case Op::kLoadMicroBatch:
        break;  // the micro-batches are in memory already
      case Op::kRecvActivation:
        TRIDENT_RETURN_IF_ERROR(recv_activation(m));
        break;
      case Op::kForward: {
        at::Tensor input = stage_ == 0 ? inputs[m] : received_activations_[m].requires_grad_(true);
        inputs_[m] = input;
        received_activations_[m] = at::Tensor();
        TRIDENT_ASSIGN_OR_RETURN(outputs_[m], Forward(m, input));
        peak_live_ = std::max<int>(
            peak_live_, std::count_if(outputs_.begin(), outputs_.end(),
                                      [](const at::Tensor& t) { return t.defined(); }));
        break;
      }
      case Op::kSendActivation:
        TRIDENT_RETURN_IF_ERROR(pipeline_.Send(outputs_[m].detach(), stage_ + 1, ActivationTag(m)));
        break;
      case Op::kRecvGrad:
        TRIDENT_RETURN_IF_ERROR(recv_grad(m));
        break;
      case Op::kBackward:
        TRIDENT_RETURN_IF_ERROR(Backward(m));
        break;
      case Op::kSendGrad:
        TRIDENT_RETURN_IF_ERROR(pipeline_.Send(input_grad(m), stage_ - 1, GradTag(m)));
        break;
      case Op::kSendActivationRecvGrad: {
        // NOTE: both directions are posted before either is waited on, so two
        // neighbours exchanging at once cannot block each other.
        grads_[inst.other] = buffer();
        TRIDENT_ASSIGN_OR_RETURN(PendingWork recv, pipeline_.IRecv(grads_[inst.other], stage_ + 1, GradTag(inst.other)));
        TRIDENT_ASSIGN_OR_RETURN(PendingWork send, pipeline_.ISend(outputs_[m].detach(), stage_ + 1, ActivationTag(m)));
        TRIDENT_RETURN_IF_ERROR(send.Wait());
        TRIDENT_RETURN_IF_ERROR(recv.Wait());
        break;
      }
      case Op::kSendGradRecvActivation: {
        received_activations_[inst.other] = buffer();
        TRIDENT_ASSIGN_OR_RETURN(PendingWork recv, pipeline_.IRecv(received_activations_[inst.other], stage_ - 1, ActivationTag(inst.other)));
        TRIDENT_ASSIGN_OR_RETURN(PendingWork send, pipeline_.ISend(input_grad(m), stage_ - 1, GradTag(m)));
        TRIDENT_RETURN_IF_ERROR(send.Wait());
        TRIDENT_RETURN_IF_ERROR(recv.Wait());
        break;
      }
      case Op::kPostSendActivationRecvGrad: {
        grads_[inst.other] = buffer();
        TRIDENT_ASSIGN_OR_RETURN(PendingWork recv, pipeline_.IRecv(grads_[inst.other], stage_ + 1, GradTag(inst.other)));
        TRIDENT_ASSIGN_OR_RETURN(PendingWork send, pipeline_.ISend(outputs_[m].detach(), stage_ + 1, ActivationTag(m)));
        posted_.push_back(std::move(send));
        posted_.push_back(std::move(recv));
        break;
      }
      case Op::kWaitPosted:
        for (PendingWork& work : posted_) TRIDENT_RETURN_IF_ERROR(work.Wait());
        posted_.clear();
        break;
      case Op::kRecompute:
        TRIDENT_RETURN_IF_ERROR(Recompute(m));
        break;
      case Op::kReduceTiedGrads:
        if (options_.reduce_tied_grads) TRIDENT_RETURN_IF_ERROR(options_.reduce_tied_grads());
        break;
      case Op::kReduceDataParallelGrads:
        if (options_.reduce_data_parallel_grads) {
          TRIDENT_RETURN_IF_ERROR(options_.reduce_data_parallel_grads());
        }
        break;
      case Op::kOptimizerStep:
        if (options_.optimizer_step) TRIDENT_RETURN_IF_ERROR(options_.optimizer_step());
        break;
    }
    if (inst.op != Op::kLoadMicroBatch) timeline_.push_back({stage_, inst.op, m, start, seconds()});
  }
  if (stage_ != stages_ - 1) return std::numeric_limits<double>::quiet_NaN();
  return loss_sum_ / M;
}

absl::StatusOr<double> PipelineStageRunner::RunForward(const std::vector<at::Tensor>& inputs,
                                                       const std::vector<at::Tensor>& targets) {
  at::NoGradGuard no_grad;
  const int M = static_cast<int>(std::max(inputs.size(), targets.size()));
  targets_ = targets;
  loss_sum_ = 0;
  checkpoints_.assign(M, {});
  for (int m = 0; m < M; ++m) {
    at::Tensor input = stage_ == 0 ? inputs[m]
                                   : at::empty(options_.boundary_shape,
                                               at::TensorOptions().dtype(options_.boundary_dtype));
    if (stage_ > 0) TRIDENT_RETURN_IF_ERROR(pipeline_.Recv(input, stage_ - 1, ActivationTag(m)));
    TRIDENT_ASSIGN_OR_RETURN(at::Tensor output, Forward(m, input));
    if (stage_ < stages_ - 1) {
      TRIDENT_RETURN_IF_ERROR(pipeline_.Send(output, stage_ + 1, ActivationTag(m)));
    }
  }
  if (stage_ != stages_ - 1) return std::numeric_limits<double>::quiet_NaN();
  return loss_sum_ / M;
}

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
