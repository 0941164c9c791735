#include "pipeline/stage_runner.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>

#include "absl/strings/str_cat.h"
#include "base/host_copy.h"
#include "base/recompute.h"
#include "base/status.h"
#include "pipeline/weight_gradients.h"

namespace trident {
namespace {

at::Tensor Allocate(const TensorSpec& spec) { return at::empty(spec.shape, at::TensorOptions().dtype(spec.dtype)); }

// The input leaf a received tensor becomes (a gradient flows back where its spec says).
at::Tensor AsInput(const at::Tensor& received, const TensorSpec& spec) {
  return spec.requires_grad && c10::GradMode::is_enabled() ? received.requires_grad_(true) : received;
}

}  // namespace

class PipelineStageRunner::Impl {
 public:
  Impl(LayerSequence& layers, const ProcessGroup* pipeline, const PipelineSchedule& schedule,
       StageRunnerOptions options)
      : layers_(layers),
        pipeline_(pipeline),
        schedule_(schedule),
        options_(std::move(options)),
        stage_(pipeline != nullptr ? pipeline->rank() : 0),
        stages_(pipeline != nullptr ? pipeline->size() : 1),
        chunks_(static_cast<int>(options_.chunks.size())) {}

  absl::StatusOr<std::vector<double>> Run(const std::vector<Batch>& batches, const std::vector<double>& weights,
                                          bool train);

  std::vector<TimelineEvent> timeline;
  int peak_live = 0;

 private:
  // Everything one micro-batch of one chunk holds between its ops.
  struct Slot {
    Values inputs;                              // the chunk's inputs (leaves where a gradient goes back)
    Values outputs;                             // its outputs, or {the weighted, scaled loss} on the last virtual stage
    Values grads;                               // the received gradients of the outputs that need them
    Values received;                            // received activations, before their forward
    std::function<void()> recompute_last;       // reruns the last checkpointed segment ahead of backward
    internal::DeferredWeightGradients weights;  // split backward: weight gradients to run
  };

  int VirtualStage(int chunk) const { return chunk * stages_ + stage_; }
  bool FirstVirtual(int chunk) const { return VirtualStage(chunk) == 0; }
  bool LastVirtual(int chunk) const { return VirtualStage(chunk) == chunks_ * stages_ - 1; }
  int Next() const { return (stage_ + 1) % stages_; }
  int Previous() const { return (stage_ + stages_ - 1) % stages_; }
  // Message tags, by the sending virtual stage and the tensor's place at the
  // boundary: unique per message in a step.
  int Tag(int from_virtual, int m, int kind, size_t k) const {
    return static_cast<int>((2 * (from_virtual * micro_ + m) + kind) * kMaxBoundaryTensors + k);
  }
  int ActivationTag(int from_virtual, int m, size_t k) const { return Tag(from_virtual, m, 0, k); }
  int GradTag(int from_virtual, int m, size_t k) const { return Tag(from_virtual, m, 1, k); }
  Slot& At(const Instruction& inst, int m) { return slots_[inst.chunk * micro_ + m]; }

  absl::Status Execute(const Instruction& inst, const std::vector<Batch>& batches);
  absl::StatusOr<Values> Forward(int chunk, int m, const Values& inputs, const Batch& batch);
  // Reruns a slot's last checkpointed segment ahead of its backward (which
  // reruns the others, one at a time, as it reaches them).
  absl::Status Recompute(int chunk, int m);
  // The input gradients, and the weight gradients too unless `split`.
  absl::Status Backward(int chunk, int m, bool split);
  // Backward from `roots` with `grads` (empty for a scalar loss).
  void BackwardFrom(Slot& slot, const Values& roots, const Values& grads, bool split);
  absl::Status SendActivation(const Instruction& inst);
  absl::Status SendGrad(const Instruction& inst);
  absl::Status RecvActivation(const Instruction& inst, int m);
  absl::Status RecvGrad(const Instruction& inst, int m, bool post);
  absl::Status Send(const at::Tensor& tensor, int peer, int tag);
  absl::Status CompleteSends(bool all);

  static constexpr int kMaxBoundaryTensors = 256;
  LayerSequence& layers_;
  const ProcessGroup* pipeline_;  // nullptr: one stage, no messages
  const PipelineSchedule& schedule_;
  StageRunnerOptions options_;
  int stage_, stages_, chunks_;
  int micro_ = 0;
  std::vector<Slot> slots_;  // chunk * micro_ + m
  std::vector<double> weights_;
  // Each micro-batch's loss, copied out as its forward computes it and read
  // once the step's work is queued: reading it with item() would wait for the
  // queued backward too (a GPU sync) and leave the GPU idle after it.
  std::vector<PendingScalar> losses_;
  std::vector<std::pair<PendingWork, at::Tensor>> sends_;  // in flight, with their tensors
  std::vector<PendingWork> posted_;                        // receives started by kPostSendActivationRecvGrad
  internal::DeferredWeightGradients::Parameters parameters_;
  size_t backwards_left_ = 0;  // backward instructions still to run in this step
};

absl::StatusOr<Values> PipelineStageRunner::Impl::Forward(int chunk, int m, const Values& inputs, const Batch& batch) {
  const StageChunk& c = options_.chunks[chunk];
  Values x = inputs;
  Slot& slot = slots_[chunk * micro_ + m];
  slot.recompute_last = nullptr;
  TRIDENT_RETURN_IF_ERROR(CatchExceptions(absl::StrCat("forward of micro-batch ", m), [&] {
    for (int64_t first = c.first_layer; first < c.end_layer;) {
      if (!c.Recomputes(first)) {
        x = layers_.RunLayer(first++, x, batch);
        continue;
      }
      // A segment of up to checkpoint_num_layers recomputed layers keeps only
      // its inputs; it reruns within backward (RecomputeInBackward), so the
      // step's backward stays one pass.
      int64_t end = first + 1;
      while (end < c.end_layer && end - first < options_.checkpoint_num_layers && c.Recomputes(end)) ++end;
      Values parameters;
      for (int64_t i = first; i < end; ++i) {
        for (auto& [name, p] : layers_.LayerParameters(i)) parameters.push_back(p);
      }
      LayerSequence* layers = &layers_;
      auto run = [layers, first, end, batch](const Values& in) {
        Values out = in;
        for (int64_t i = first; i < end; ++i) out = layers->RunLayer(i, out, batch);
        return out;
      };
      x = RecomputeInBackward(run, x, parameters, &slot.recompute_last);
      first = end;
    }
    if (LastVirtual(chunk)) {
      at::Tensor loss = options_.loss ? options_.loss(x, batch) : layers_.Loss(x, batch);
      TORCH_CHECK(loss.defined() && loss.numel() == 1, "the loss must be a scalar; it has shape ", loss.sizes());
      losses_[m] = PendingScalar(loss);
      const double scale = options_.loss_scale ? options_.loss_scale() : 1.0;
      loss = loss * weights_[m];
      if (scale != 1.0) loss = loss * scale;
      x = {loss};
    }
  }));
  return x;
}

absl::Status PipelineStageRunner::Impl::Recompute(int chunk, int m) {
  return CatchExceptions(absl::StrCat("recomputation of micro-batch ", m), [&] {
    Slot& slot = slots_[chunk * micro_ + m];
    if (slot.recompute_last) slot.recompute_last();
  });
}

void PipelineStageRunner::Impl::BackwardFrom(Slot& slot, const Values& roots, const Values& grads, bool split) {
  Values from, with;
  for (size_t k = 0; k < roots.size(); ++k) {
    if (!roots[k].defined() || !roots[k].requires_grad()) continue;
    if (!grads.empty() && !grads[k].defined()) continue;
    from.push_back(roots[k]);
    if (!grads.empty()) with.push_back(grads[k]);
  }
  if (from.empty()) return;
  const bool retain = split && slot.weights.Defer(from, parameters_);
  if (with.empty()) {  // the loss
    torch::autograd::backward(from, with, retain);
    return;
  }
  // From the roots' autograd nodes: a root whose values were released after
  // it was sent (dealloc_sent_outputs) still has its node and its shape there.
  torch::autograd::edge_list edges;
  for (const at::Tensor& root : from) edges.push_back(torch::autograd::impl::gradient_edge(root));
  torch::autograd::Engine::get_default_engine().execute(edges, with, /*keep_graph=*/retain,
                                                        /*create_graph=*/false, /*accumulate_grad=*/true);
}

absl::Status PipelineStageRunner::Impl::Backward(int chunk, int m, bool split) {
  if (options_.before_backward) options_.before_backward(--backwards_left_ == 0);
  return CatchExceptions(absl::StrCat("backward of micro-batch ", m), [&] {
    Slot& slot = slots_[chunk * micro_ + m];
    if (LastVirtual(chunk)) {
      BackwardFrom(slot, slot.outputs, {}, split);
    } else {
      // The received gradients belong to the outputs whose spec needs one.
      const std::vector<TensorSpec>& sent = options_.chunks[chunk].sent;
      Values grads(slot.outputs.size());
      for (size_t k = 0, g = 0; k < sent.size() && k < grads.size(); ++k) {
        if (sent[k].requires_grad) grads[k] = slot.grads[g++];
      }
      BackwardFrom(slot, slot.outputs, grads, split);
    }
    slot.recompute_last = nullptr;
    slot.outputs.clear();  // free the activations as soon as they are used
    slot.grads.clear();
  });
}

absl::Status PipelineStageRunner::Impl::Send(const at::Tensor& tensor, int peer, int tag) {
  TRIDENT_ASSIGN_OR_RETURN(PendingWork work, pipeline_->ISend(tensor, peer, tag));
  sends_.emplace_back(std::move(work), tensor);
  return absl::OkStatus();
}

absl::Status PipelineStageRunner::Impl::SendActivation(const Instruction& inst) {
  // Gloo's sends report completion only when waited for, and hold their
  // values until then: with dealloc_sent_outputs the earlier sends complete
  // first, so at most one micro-batch's sent values are held. Not with
  // several chunks per rank: their sends run around a ring, where two ranks
  // could each wait for the other to receive.
  if (options_.dealloc_sent_outputs && chunks_ == 1) TRIDENT_RETURN_IF_ERROR(CompleteSends(/*all=*/true));
  Values& outputs = At(inst, inst.micro_batch).outputs;
  for (size_t k = 0; k < outputs.size(); ++k) {
    TRIDENT_RETURN_IF_ERROR(
        Send(outputs[k].detach().contiguous(), Next(), ActivationTag(VirtualStage(inst.chunk), inst.micro_batch, k)));
    // The send holds the values until it completes; the slot keeps the node.
    // (A leaf passed through, or a view, keeps its values: its gradient lands there.)
    const at::Tensor& sent = outputs[k];
    if (options_.dealloc_sent_outputs && sent.grad_fn() != nullptr && !sent.is_view()) {
      sent.set_data(at::empty({0}, sent.options()));
    }
  }
  return absl::OkStatus();
}

absl::Status PipelineStageRunner::Impl::SendGrad(const Instruction& inst) {
  Slot& slot = At(inst, inst.micro_batch);
  const std::vector<TensorSpec>& received = options_.chunks[inst.chunk].received;
  for (size_t k = 0, g = 0; k < received.size(); ++k) {
    if (!received[k].requires_grad) continue;
    at::Tensor grad = slot.inputs[k].grad();
    if (!grad.defined()) grad = at::zeros(received[k].shape, at::TensorOptions().dtype(received[k].dtype));
    TRIDENT_RETURN_IF_ERROR(
        Send(grad.contiguous(), Previous(), GradTag(VirtualStage(inst.chunk), inst.micro_batch, g++)));
  }
  slot.inputs.clear();
  return absl::OkStatus();
}

absl::Status PipelineStageRunner::Impl::RecvActivation(const Instruction& inst, int m) {
  Slot& slot = At(inst, m);
  const std::vector<TensorSpec>& received = options_.chunks[inst.chunk].received;
  slot.received.clear();
  for (size_t k = 0; k < received.size(); ++k) {
    slot.received.push_back(Allocate(received[k]));
    TRIDENT_RETURN_IF_ERROR(
        pipeline_->Recv(slot.received.back(), Previous(), ActivationTag(VirtualStage(inst.chunk) - 1, m, k)));
  }
  return absl::OkStatus();
}

absl::Status PipelineStageRunner::Impl::RecvGrad(const Instruction& inst, int m, bool post) {
  Slot& slot = At(inst, m);
  slot.grads.clear();
  int g = 0;
  for (const TensorSpec& spec : options_.chunks[inst.chunk].sent) {
    if (!spec.requires_grad) continue;
    slot.grads.push_back(Allocate(spec));
    const int tag = GradTag(VirtualStage(inst.chunk) + 1, m, g++);
    if (post) {
      TRIDENT_ASSIGN_OR_RETURN(PendingWork recv, pipeline_->IRecv(slot.grads.back(), Next(), tag));
      posted_.push_back(std::move(recv));
    } else {
      TRIDENT_RETURN_IF_ERROR(pipeline_->Recv(slot.grads.back(), Next(), tag));
    }
  }
  return absl::OkStatus();
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

absl::Status PipelineStageRunner::Impl::Execute(const Instruction& inst, const std::vector<Batch>& batches) {
  const int m = inst.micro_batch;
  static const Batch kNoBatch;
  const Batch& batch = m >= 0 && m < static_cast<int>(batches.size()) ? batches[m] : kNoBatch;
  switch (inst.op) {
    case Op::kLoadMicroBatch:
      return absl::OkStatus();  // the micro-batches are in memory already
    case Op::kRecvActivation:
      return RecvActivation(inst, m);
    case Op::kForward: {
      Slot& slot = At(inst, m);
      const std::vector<TensorSpec>& received = options_.chunks[inst.chunk].received;
      slot.inputs.clear();
      for (size_t k = 0; k < slot.received.size(); ++k) {
        slot.inputs.push_back(AsInput(slot.received[k], received[k]));
      }
      slot.received.clear();
      TRIDENT_ASSIGN_OR_RETURN(slot.outputs, Forward(inst.chunk, m, slot.inputs, batch));
      peak_live = std::max<int>(
          peak_live, std::count_if(slots_.begin(), slots_.end(), [](const Slot& s) { return !s.outputs.empty(); }));
      return absl::OkStatus();
    }
    case Op::kSendActivation:
      return SendActivation(inst);
    case Op::kRecvGrad:
      return RecvGrad(inst, m, /*post=*/false);
    case Op::kBackward:
    case Op::kBackwardInput:
      return Backward(inst.chunk, m, inst.op == Op::kBackwardInput);
    case Op::kBackwardWeight:
      if (options_.before_backward) options_.before_backward(--backwards_left_ == 0);
      return CatchExceptions(absl::StrCat("weight gradients of micro-batch ", m), [&] { At(inst, m).weights.Run(); });
    case Op::kSendGrad:
      return SendGrad(inst);
    case Op::kSendActivationRecvGrad:
      TRIDENT_RETURN_IF_ERROR(SendActivation(inst));
      return RecvGrad(inst, inst.other, /*post=*/false);
    case Op::kSendGradRecvActivation:
      TRIDENT_RETURN_IF_ERROR(SendGrad(inst));
      return RecvActivation(inst, inst.other);
    case Op::kPostSendActivationRecvGrad:
      TRIDENT_RETURN_IF_ERROR(SendActivation(inst));
      return RecvGrad(inst, inst.other, /*post=*/true);
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
      return options_.reduce_data_parallel_grads ? options_.reduce_data_parallel_grads() : absl::OkStatus();
    case Op::kOptimizerStep:
      return options_.optimizer_step ? options_.optimizer_step() : absl::OkStatus();
  }
  return absl::InternalError(absl::StrCat("unknown pipeline instruction ", static_cast<int>(inst.op)));
}

absl::StatusOr<std::vector<double>> PipelineStageRunner::Impl::Run(const std::vector<Batch>& batches,
                                                                   const std::vector<double>& weights, bool train) {
  micro_ = static_cast<int>(batches.size());
  TRIDENT_RETURN_IF_ERROR(schedule_.Check(stages_, micro_));
  if (chunks_ != schedule_.num_chunks()) {
    return absl::InvalidArgumentError(absl::StrCat("schedule ", schedule_.name(), " runs ", schedule_.num_chunks(),
                                                   " model chunk(s) per rank; the runner got ", chunks_));
  }
  for (const StageChunk& c : options_.chunks) {
    if (c.received.size() > kMaxBoundaryTensors || c.sent.size() > kMaxBoundaryTensors) {
      return absl::InvalidArgumentError(absl::StrCat("a pipeline stage boundary carries more than ",
                                                     kMaxBoundaryTensors,
                                                     " tensors; cut the model elsewhere (fewer, larger shards)"));
    }
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
  weights_ = weights;
  weights_.resize(micro_, 1.0 / std::max(1, micro_));
  losses_.assign(micro_, PendingScalar());
  slots_.clear();
  slots_.resize(chunks_ * micro_);
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
  backwards_left_ = std::count_if(program.begin(), program.end(), [](const Instruction& i) {
    return i.op == Op::kBackward || i.op == Op::kBackwardInput || i.op == Op::kBackwardWeight;
  });
  timeline.clear();
  const auto step_start = std::chrono::steady_clock::now();
  auto seconds = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start).count(); };
  for (const Instruction& inst : program) {
    const double start = seconds();
    TRIDENT_RETURN_IF_ERROR(Execute(inst, batches));
    if (inst.op != Op::kLoadMicroBatch) {
      timeline.push_back({stage_, inst.op, inst.micro_batch, inst.chunk, start, seconds()});
    }
    TRIDENT_RETURN_IF_ERROR(CompleteSends(/*all=*/false));
  }
  TRIDENT_RETURN_IF_ERROR(CompleteSends(/*all=*/true));
  slots_.clear();
  if (!LastVirtual(chunks_ - 1)) return std::vector<double>();
  std::vector<double> losses;
  for (const PendingScalar& loss : losses_) losses.push_back(loss.defined() ? loss.Get() : 0.0);
  losses_.clear();
  return losses;
}

PipelineStageRunner::PipelineStageRunner(LayerSequence& layers, const ProcessGroup* pipeline,
                                         const PipelineSchedule& schedule, StageRunnerOptions options)
    : impl_(std::make_unique<Impl>(layers, pipeline, schedule, std::move(options))) {}

PipelineStageRunner::~PipelineStageRunner() = default;

absl::StatusOr<std::vector<double>> PipelineStageRunner::RunStep(const std::vector<Batch>& batches,
                                                                 const std::vector<double>& loss_weights) {
  return impl_->Run(batches, loss_weights, /*train=*/true);
}

absl::StatusOr<std::vector<double>> PipelineStageRunner::RunForward(const std::vector<Batch>& batches) {
  c10::NoGradGuard no_grad;
  return impl_->Run(batches, {}, /*train=*/false);
}

const std::vector<TimelineEvent>& PipelineStageRunner::timeline() const { return impl_->timeline; }

int PipelineStageRunner::peak_live_activations() const { return impl_->peak_live; }

namespace {

// Specs travel as int64 tensors: a length message, then
// [count, (dtype, requires_grad, rank, sizes...) per tensor]; the tensors follow.
constexpr int kSpecTag = 1 << 30;
int PassTensorTag(int virtual_stage, size_t k) { return (1 << 29) + virtual_stage * 4096 + static_cast<int>(k); }

// nullopt: the sender failed (count -1).
absl::Status SendSpecs(const std::optional<std::vector<TensorSpec>>& specs, const ProcessGroup& group, int peer,
                       int tag) {
  std::vector<int64_t> encoded = {specs ? static_cast<int64_t>(specs->size()) : -1};
  for (const TensorSpec& spec : specs ? *specs : std::vector<TensorSpec>()) {
    encoded.push_back(static_cast<int64_t>(spec.dtype));
    encoded.push_back(spec.requires_grad ? 1 : 0);
    encoded.push_back(static_cast<int64_t>(spec.shape.size()));
    encoded.insert(encoded.end(), spec.shape.begin(), spec.shape.end());
  }
  at::Tensor length = at::full({1}, static_cast<int64_t>(encoded.size()), at::kLong);
  TRIDENT_RETURN_IF_ERROR(group.Send(length, peer, tag));
  return group.Send(at::tensor(encoded, at::kLong), peer, tag + 1);
}

absl::StatusOr<std::optional<std::vector<TensorSpec>>> RecvSpecs(const ProcessGroup& group, int peer, int tag) {
  at::Tensor length = at::empty({1}, at::kLong);
  TRIDENT_RETURN_IF_ERROR(group.Recv(length, peer, tag));
  at::Tensor encoded = at::empty({length.item<int64_t>()}, at::kLong);
  TRIDENT_RETURN_IF_ERROR(group.Recv(encoded, peer, tag + 1));
  const int64_t* e = encoded.data_ptr<int64_t>();
  if (e[0] < 0) return std::optional<std::vector<TensorSpec>>();
  std::vector<TensorSpec> specs(e[0]);
  int64_t at = 1;
  for (TensorSpec& spec : specs) {
    spec.dtype = static_cast<at::ScalarType>(e[at++]);
    spec.requires_grad = e[at++] != 0;
    const int64_t rank = e[at++];
    spec.shape.assign(e + at, e + at + rank);
    at += rank;
  }
  return std::optional<std::vector<TensorSpec>>(std::move(specs));
}

std::vector<TensorSpec> SpecsOf(const Values& values) {
  std::vector<TensorSpec> specs;
  for (const at::Tensor& t : values) {
    specs.push_back({t.sizes().vec(), t.scalar_type(), t.requires_grad()});
  }
  return specs;
}

}  // namespace

absl::StatusOr<StagePass> ForwardThroughStages(LayerSequence& layers, std::vector<StageChunk>& chunks,
                                               const ProcessGroup* pipeline, const Batch& batch) {
  const int stages = pipeline != nullptr ? pipeline->size() : 1;
  const int stage = pipeline != nullptr ? pipeline->rank() : 0;
  const int virtual_stages = stages * static_cast<int>(chunks.size());
  const int next = (stage + 1) % stages, previous = (stage + stages - 1) % stages;
  StagePass pass;
  pass.received.resize(chunks.size());
  pass.sent.resize(chunks.size());
  absl::Status failed;  // the first failure here or upstream; passed on downstream
  for (int v = stage; v < virtual_stages; v += stages) {
    const size_t c = static_cast<size_t>(v / stages);
    Values x;
    if (v > 0) {
      auto specs = RecvSpecs(*pipeline, previous, kSpecTag + 2 * v);
      if (!specs.ok()) return specs.status();  // the link itself is broken
      if (!*specs) {
        if (failed.ok()) {
          failed = absl::AbortedError(
              absl::StrCat("pipeline stage ", v - 1, " failed in its first forward (see its error)"));
        }
      } else {
        pass.received[c] = **specs;
        for (size_t k = 0; k < pass.received[c].size(); ++k) {
          const TensorSpec& spec = pass.received[c][k];
          x.push_back(Allocate(spec));
          TRIDENT_RETURN_IF_ERROR(pipeline->Recv(x.back(), previous, PassTensorTag(v, k)));
          x.back() = AsInput(x.back(), spec);
        }
      }
    }
    if (failed.ok()) {
      failed = CatchExceptions(absl::StrCat("the first forward of pipeline stage ", v), [&] {
        for (int64_t i = chunks[c].first_layer; i < chunks[c].end_layer; ++i) x = layers.RunLayer(i, x, batch);
      });
    }
    if (v + 1 < virtual_stages) {
      if (!failed.ok()) {
        TRIDENT_RETURN_IF_ERROR(SendSpecs(std::nullopt, *pipeline, next, kSpecTag + 2 * (v + 1)));
        continue;
      }
      pass.sent[c] = SpecsOf(x);
      TRIDENT_RETURN_IF_ERROR(SendSpecs(pass.sent[c], *pipeline, next, kSpecTag + 2 * (v + 1)));
      for (size_t k = 0; k < x.size(); ++k) {
        TRIDENT_RETURN_IF_ERROR(pipeline->Send(x[k].detach().contiguous(), next, PassTensorTag(v + 1, k)));
      }
    } else {
      pass.outputs = x;
    }
    chunks[c].received = pass.received[c];
    chunks[c].sent = pass.sent[c];
  }
  TRIDENT_RETURN_IF_ERROR(failed);
  return pass;
}

absl::Status ReduceTiedGradients(const NamedTensors& tied, const std::vector<std::vector<int>>& holders,
                                 const ProcessGroup& pipeline) {
  const int stage = pipeline.rank();
  int tag = 1 << 20;
  for (size_t i = 0; i < tied.size(); ++i, ++tag) {
    const std::vector<int>& owners = holders[i];
    if (owners.size() < 2) continue;
    at::Tensor parameter = tied[i].second;
    at::Tensor mine = parameter.grad().defined() ? parameter.grad().contiguous() : at::zeros_like(parameter);
    // Every holder sends its part to every other at once and adds all parts
    // in stage order, so every copy gets the same sum.
    std::vector<at::Tensor> parts(owners.size());
    std::vector<PendingWork> works;
    for (size_t k = 0; k < owners.size(); ++k) {
      if (owners[k] == stage) {
        parts[k] = mine;
        continue;
      }
      parts[k] = at::empty_like(mine);
      TRIDENT_ASSIGN_OR_RETURN(PendingWork recv, pipeline.IRecv(parts[k], owners[k], tag));
      TRIDENT_ASSIGN_OR_RETURN(PendingWork send, pipeline.ISend(mine, owners[k], tag));
      works.push_back(std::move(recv));
      works.push_back(std::move(send));
    }
    for (PendingWork& work : works) TRIDENT_RETURN_IF_ERROR(work.Wait());
    at::Tensor sum = parts[0] + parts[1];
    for (size_t k = 2; k < parts.size(); ++k) sum.add_(parts[k]);
    if (parameter.grad().defined()) {
      parameter.grad().copy_(sum);
    } else {
      parameter.mutable_grad() = sum;
    }
  }
  return absl::OkStatus();
}

}  // namespace trident
