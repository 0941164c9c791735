// The tensor-parallel collectives as registered operators with autograd.
#include <algorithm>
#include <atomic>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/SequenceNumber.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/library.h>

#include "absl/strings/str_cat.h"
#include "base/autocast_state.h"
#include "kernels/kernels.h"
#include "tensor_parallel/tensor_parallel.h"
#include "topology/topology.h"

namespace trident {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::atomic<int64_t> bytes_communicated{0};

const ProcessGroup& GroupNamed(c10::string_view name) {
  auto group = FindProcessGroup(std::string(name));
  TORCH_CHECK(group.ok(), "tensor-parallel operator: ", std::string(group.status().message()));
  return **group;
}

void Check(const absl::Status& status) { TORCH_CHECK(status.ok(), std::string(status.message())); }

int64_t Bytes(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

// Normalises a possibly negative dimension.
int64_t Dim(const at::Tensor& x, int64_t dim) { return dim < 0 ? dim + x.dim() : dim; }

at::Tensor AllReduceSum(const at::Tensor& x, c10::string_view name) {
  const ProcessGroup& group = GroupNamed(name);
  at::Tensor out = x.contiguous().clone();
  if (group.size() == 1) return out;
  Check(group.AllReduce(out));
  bytes_communicated += 2 * Bytes(out) * (group.size() - 1) / group.size();
  return out;
}

at::Tensor AllGather(const at::Tensor& x, c10::string_view name, int64_t dim) {
  const ProcessGroup& group = GroupNamed(name);
  if (group.size() == 1) return x.clone();
  auto out = group.AllGather(x.contiguous(), Dim(x, dim));
  Check(out.status());
  bytes_communicated += Bytes(x) * (group.size() - 1);
  return *out;
}

at::Tensor ReduceScatter(const at::Tensor& x, c10::string_view name, int64_t dim) {
  const ProcessGroup& group = GroupNamed(name);
  if (group.size() == 1) return x.clone();
  TORCH_CHECK(x.size(Dim(x, dim)) % group.size() == 0, "reduce-scatter on group '", std::string(name), "': dimension ",
              dim, " of size ", x.size(Dim(x, dim)), " does not divide into ", group.size(), " parts");
  auto out = group.ReduceScatter(x.contiguous(), Dim(x, dim));
  Check(out.status());
  bytes_communicated += Bytes(x) * (group.size() - 1) / group.size();
  return *out;
}

at::Tensor OwnSlice(const at::Tensor& x, c10::string_view name, int64_t dim) {
  const ProcessGroup& group = GroupNamed(name);
  const int64_t d = Dim(x, dim);
  TORCH_CHECK(x.size(d) % group.size() == 0, "splitting over group '", std::string(name), "': dimension ", dim,
              " of size ", x.size(d), " does not divide into ", group.size(), " parts");
  return x.chunk(group.size(), d)[group.rank()].contiguous();
}

// The forward kernels (CPU and CUDA alike: the process group moves the data).
at::Tensor CopyToKernel(const at::Tensor& x, c10::string_view) { return x.clone(); }
at::Tensor ReduceFromKernel(const at::Tensor& x, c10::string_view g) { return AllReduceSum(x, g); }
at::Tensor GatherKernel(const at::Tensor& x, c10::string_view g) { return AllGather(x, g, -1); }
at::Tensor ScatterKernel(const at::Tensor& x, c10::string_view g) { return OwnSlice(x, g, -1); }
at::Tensor SequenceGatherKernel(const at::Tensor& x, c10::string_view g, int64_t dim) { return AllGather(x, g, dim); }
at::Tensor SequenceReduceScatterKernel(const at::Tensor& x, c10::string_view g, int64_t dim) {
  return ReduceScatter(x, g, dim);
}

// Per-token losses and the local softmax of vocabulary-sharded logits.
struct CrossEntropyParts {
  at::Tensor loss, softmax, local_targets, outside;
};

CrossEntropyParts CrossEntropyForward(const at::Tensor& logits, const at::Tensor& targets, c10::string_view name) {
  const ProcessGroup& group = GroupNamed(name);
  TORCH_CHECK(logits.dim() == 2 && targets.dim() == 1 && logits.size(0) == targets.size(0),
              "vocab_parallel_cross_entropy takes logits [N, V / tp] and targets [N]; got ", logits.sizes(), " and ",
              targets.sizes());
  const int64_t local_vocab = logits.size(1), start = local_vocab * group.rank();
  at::Tensor logits32 = logits.to(at::kFloat);
  at::Tensor max = std::get<0>(logits32.max(-1));
  if (group.size() > 1) {
    Check(group.AllReduce(max, ReduceOp::kMax));
    bytes_communicated += 2 * Bytes(max) * (group.size() - 1) / group.size();
  }
  at::Tensor shifted = logits32 - max.unsqueeze(1);
  CrossEntropyParts parts;
  parts.outside = (targets < start).logical_or(targets >= start + local_vocab);
  parts.local_targets = (targets - start).masked_fill(parts.outside, 0);
  at::Tensor predicted = shifted.gather(1, parts.local_targets.unsqueeze(1)).squeeze(1).masked_fill(parts.outside, 0);
  at::Tensor exp = shifted.exp();
  at::Tensor sums = at::stack({predicted, exp.sum(-1)});  // one message for both
  sums = AllReduceSum(sums, name);
  parts.loss = sums[1].log() - sums[0];
  parts.softmax = exp.div_(sums[1].unsqueeze(1));
  return parts;
}

at::Tensor CrossEntropyKernel(const at::Tensor& logits, const at::Tensor& targets, c10::string_view group) {
  return CrossEntropyForward(logits, targets, group).loss;
}

// Autograd: each forward/backward pair as a custom function.
struct CopyTo : torch::autograd::Function<CopyTo> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, std::string group) {
    ctx->saved_data["group"] = group;
    return x;  // autograd makes the returned input a view: no copy on the forward path
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {AllReduceSum(grads[0], ctx->saved_data["group"].toStringRef()), at::Tensor()};
  }
};

struct ReduceFrom : torch::autograd::Function<ReduceFrom> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x, std::string group) { return AllReduceSum(x, group); }
  static variable_list backward(AutogradContext*, variable_list grads) { return {grads[0], at::Tensor()}; }
};

struct Gather : torch::autograd::Function<Gather> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, std::string group) {
    ctx->saved_data["group"] = group;
    return AllGather(x, group, -1);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {OwnSlice(grads[0], ctx->saved_data["group"].toStringRef(), -1), at::Tensor()};
  }
};

struct Scatter : torch::autograd::Function<Scatter> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, std::string group) {
    ctx->saved_data["group"] = group;
    return OwnSlice(x, group, -1);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {AllGather(grads[0], ctx->saved_data["group"].toStringRef(), -1), at::Tensor()};
  }
};

struct SequenceGather : torch::autograd::Function<SequenceGather> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, std::string group, int64_t dim) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["dim"] = dim;
    return AllGather(x, group, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {ReduceScatter(grads[0], ctx->saved_data["group"].toStringRef(), ctx->saved_data["dim"].toInt()),
            at::Tensor(), at::Tensor()};
  }
};

struct SequenceReduceScatter : torch::autograd::Function<SequenceReduceScatter> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, std::string group, int64_t dim) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["dim"] = dim;
    return ReduceScatter(x, group, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {AllGather(grads[0], ctx->saved_data["group"].toStringRef(), ctx->saved_data["dim"].toInt()), at::Tensor(),
            at::Tensor()};
  }
};

struct CrossEntropy : torch::autograd::Function<CrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets,
                            std::string group) {
    CrossEntropyParts parts = CrossEntropyForward(logits, targets, group);
    ctx->save_for_backward({parts.softmax, parts.local_targets, parts.outside});
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits.scalar_type());
    return parts.loss;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    at::Tensor grad = saved[0].clone();  // softmax - one_hot(target), on this rank's slice
    grad.scatter_add_(1, saved[1].unsqueeze(1), saved[2].logical_not().to(grad.scalar_type()).neg().unsqueeze(1));
    grad.mul_(grads[0].to(grad.scalar_type()).unsqueeze(1));
    return {grad.to(static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt())), at::Tensor(), at::Tensor()};
  }
};

at::Tensor CopyToAutograd(const at::Tensor& x, c10::string_view g) { return CopyTo::apply(x, std::string(g)); }
at::Tensor ReduceFromAutograd(const at::Tensor& x, c10::string_view g) { return ReduceFrom::apply(x, std::string(g)); }
at::Tensor GatherAutograd(const at::Tensor& x, c10::string_view g) { return Gather::apply(x, std::string(g)); }
at::Tensor ScatterAutograd(const at::Tensor& x, c10::string_view g) { return Scatter::apply(x, std::string(g)); }
at::Tensor SequenceGatherAutograd(const at::Tensor& x, c10::string_view g, int64_t dim) {
  return SequenceGather::apply(x, std::string(g), dim);
}
at::Tensor SequenceReduceScatterAutograd(const at::Tensor& x, c10::string_view g, int64_t dim) {
  return SequenceReduceScatter::apply(x, std::string(g), dim);
}
at::Tensor CrossEntropyAutograd(const at::Tensor& logits, const at::Tensor& targets, c10::string_view g) {
  return CrossEntropy::apply(logits, targets, std::string(g));
}

// ---- sub-pipelined products (tp_overlapping_level 1) ----

// Row blocks [start, start + rows) of a product of `rows` rows: kSubBatches
// near-equal ones, each reduced as soon as it is computed.
constexpr int64_t kSubBatches = 2;

std::vector<std::pair<int64_t, int64_t>> RowBlocks(int64_t rows) {
  std::vector<std::pair<int64_t, int64_t>> blocks;
  const int64_t count = std::max<int64_t>(1, std::min(kSubBatches, rows));
  for (int64_t b = 0, start = 0; b < count; ++b) {
    const int64_t end = rows * (b + 1) / count;
    blocks.emplace_back(start, end - start);
    start = end;
  }
  return blocks;
}

// Starts summing the contiguous `t` over `group` in place (throws on failure) and counts its bytes.
PendingWork StartAllReduce(const ProcessGroup& group, at::Tensor& t) {
  auto started = group.IAllReduce(t);
  Check(started.status());
  bytes_communicated += 2 * Bytes(t) * (group.size() - 1) / group.size();
  return std::move(*started);
}

// Starts the all-reduce of the contiguous block `rows` of `y`, computed first by `compute(block)`.
template <typename Compute>
PendingWork ComputeAndStartAllReduce(const ProcessGroup& group, at::Tensor& y, std::pair<int64_t, int64_t> rows,
                                     Compute compute) {
  at::Tensor block = y.narrow(0, rows.first, rows.second);
  compute(block, rows);
  return StartAllReduce(group, block);
}

// Waits for every started reduction (all of them, even after a failure), then reports the first failure.
void WaitAll(std::vector<PendingWork>& started) {
  absl::Status first = absl::OkStatus();
  for (PendingWork& work : started) {
    absl::Status waited = work.Wait();
    if (first.ok()) first = waited;
  }
  Check(first);
}

at::Tensor Rows(const at::Tensor& x) { return x.reshape({-1, x.size(-1)}); }

std::vector<int64_t> WithLastSize(at::IntArrayRef sizes, int64_t last) {
  std::vector<int64_t> out(sizes.begin(), sizes.end());
  out.back() = last;
  return out;
}

// A column-parallel layer's product from replicated input: forward as linear;
// backward sums the input's gradient over the group block by block, the
// blocks travelling while the weight's gradient is computed.
struct SubPipelinedColumn : torch::autograd::Function<SubPipelinedColumn> {
  // `bias` is empty for a layer without one (a custom function takes no undefined inputs).
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                            std::string group) {
    ctx->save_for_backward({x, weight});
    ctx->saved_data["group"] = group;
    ctx->saved_data["bias"] = bias.numel() > 0;
    return AlignedLinear(x, weight, bias.numel() > 0 ? bias : at::Tensor());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1];
    const at::Tensor g = Rows(grads[0]);
    const ProcessGroup& group = GroupNamed(ctx->saved_data["group"].toStringRef());
    at::Tensor grad_x = at::empty({g.size(0), weight.size(1)}, g.options());
    std::vector<PendingWork> started;
    for (const auto& rows : RowBlocks(g.size(0))) {
      started.push_back(ComputeAndStartAllReduce(group, grad_x, rows, [&](at::Tensor& block, auto r) {
        at::mm_out(block, g.narrow(0, r.first, r.second), weight);
      }));
    }
    at::Tensor grad_weight = g.t().mm(Rows(x));
    at::Tensor grad_bias = ctx->saved_data["bias"].toBool() ? g.sum(0) : at::Tensor();
    WaitAll(started);
    return {grad_x.view(x.sizes()), grad_weight, grad_bias, at::Tensor()};
  }
};

// A row-parallel layer's product summed over the group: each block of rows
// travels while the next is multiplied; backward as linear's (no collective).
struct SubPipelinedRow : torch::autograd::Function<SubPipelinedRow> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, std::string group) {
    ctx->save_for_backward({x, weight});
    const at::Tensor rows = Rows(x), weight_t = weight.t();
    at::Tensor y = at::empty({rows.size(0), weight.size(0)}, rows.options());
    const ProcessGroup& process_group = GroupNamed(group);
    std::vector<PendingWork> started;
    for (const auto& blocks : RowBlocks(rows.size(0))) {
      started.push_back(ComputeAndStartAllReduce(process_group, y, blocks, [&](at::Tensor& block, auto r) {
        at::mm_out(block, rows.narrow(0, r.first, r.second), weight_t);
      }));
    }
    WaitAll(started);
    return y.view(WithLastSize(x.sizes(), weight.size(0)));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1];
    const at::Tensor g = Rows(grads[0]);
    return {g.mm(weight).view(x.sizes()), g.t().mm(Rows(x)), at::Tensor()};
  }
};

// ---- sub-pipelined blocks (tp_overlapping_level 2) ----

std::atomic<int64_t> gradient_sums_started{0}, gradient_sums_overlapped{0};

// One sub-micro-batch's column-input gradient sum, shared by the node that
// starts it and the node that awaits it.
struct GradientSumInFlight {
  const ProcessGroup* group = nullptr;
  PendingWork work;
  bool started = false;
  int64_t started_as = 0;  // its place among all sums started (gradient_sums_started)
};

// Backward of a column input (forward: identity): starts summing the incoming
// gradient over the group, in place, and passes it on to the awaiting node.
class StartGradientSum : public torch::autograd::Node {
 public:
  StartGradientSum(std::shared_ptr<GradientSumInFlight> sum, torch::autograd::edge_list&& next)
      : Node(std::move(next)), sum_(std::move(sum)) {}
  std::string name() const override { return "trident::StartGradientSum"; }
  variable_list apply(variable_list&& grads) override {
    at::Tensor grad = grads[0];
    if (!grad.defined()) return {grad};
    grad = grad.contiguous();  // the engine's own buffer: summed in place
    sum_->work = StartAllReduce(*sum_->group, grad);
    sum_->started = true;
    sum_->started_as = ++gradient_sums_started;
    return {grad};
  }

 private:
  std::shared_ptr<GradientSumInFlight> sum_;
};

// Waits for the sum StartGradientSum began, then passes the summed gradient
// on. Built with an explicit sequence number below every operator of its block
// (`priority`): the engine runs the ready node with the highest number first,
// so it runs the other sub-micro-batch's backward while the sum travels and
// waits only when nothing else in the block is ready.
class AwaitGradientSum : public torch::autograd::Node {
 public:
  AwaitGradientSum(uint64_t priority, std::shared_ptr<GradientSumInFlight> sum, torch::autograd::edge_list&& next)
      : Node(priority, std::move(next)), sum_(std::move(sum)) {}
  std::string name() const override { return "trident::AwaitGradientSum"; }
  variable_list apply(variable_list&& grads) override {
    if (std::exchange(sum_->started, false)) {
      if (gradient_sums_started.load() > sum_->started_as) ++gradient_sums_overlapped;
      Check(sum_->work.Wait());
    }
    return {grads[0]};
  }

 private:
  std::shared_ptr<GradientSumInFlight> sum_;
};

// `h` as the input of a region's column-parallel layers (forward: `h` itself):
// its gradient is summed over `group` by the two nodes above, awaited at
// `priority`.
at::Tensor ColumnInputSummingGradient(const at::Tensor& h, const ProcessGroup& group, uint64_t priority) {
  if (!at::GradMode::is_enabled() || !h.requires_grad()) return h;
  auto sum = std::make_shared<GradientSumInFlight>();
  sum->group = &group;
  auto await = std::make_shared<AwaitGradientSum>(priority, sum, torch::autograd::collect_next_edges(h));
  at::Tensor awaited = h.detach();
  torch::autograd::set_history(awaited, await);
  auto start = std::make_shared<StartGradientSum>(sum, torch::autograd::collect_next_edges(awaited));
  at::Tensor started = h.detach();
  torch::autograd::set_history(started, start);
  return started;
}

// A row-parallel partial output being summed over the group, in place.
struct SumInFlight {
  at::Tensor sum;
  PendingWork work;
  at::Tensor Wait() {
    Check(work.Wait());
    return sum;
  }
};

// Starts summing `partial` in place. Its autograd history stays: the sum's
// backward is the identity (each rank's partial product gets the whole
// gradient), so the summed tensor keeps the product's gradient function.
SumInFlight StartSum(const at::Tensor& partial, const ProcessGroup& group) {
  SumInFlight in_flight{partial.contiguous(), PendingWork()};
  in_flight.work = StartAllReduce(group, in_flight.sum);
  return in_flight;
}

// Under autocast, `t` in the autocast dtype (as linear's operands would be), through a recorded cast.
at::Tensor AutocastOperand(const at::Tensor& t) {
  const AutocastState autocast = GetAutocastState(t.device().type());
  return autocast.enabled && at::isFloatingType(t.scalar_type()) ? t.to(autocast.dtype) : t;
}

template <typename Signature>
c10::TypedOperatorHandle<Signature> Op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

using Unary = at::Tensor(const at::Tensor&, c10::string_view);
using Sequence = at::Tensor(const at::Tensor&, c10::string_view, int64_t);

}  // namespace

TORCH_LIBRARY(trident, m) {
  m.def("copy_to_tp_region(Tensor x, str group) -> Tensor");
  m.def("reduce_from_tp_region(Tensor x, str group) -> Tensor");
  m.def("gather_from_tp_region(Tensor x, str group) -> Tensor");
  m.def("scatter_to_tp_region(Tensor x, str group) -> Tensor");
  m.def("gather_from_sequence_region(Tensor x, str group, int dim) -> Tensor");
  m.def("reduce_scatter_to_sequence_region(Tensor x, str group, int dim) -> Tensor");
  m.def("vocab_parallel_cross_entropy(Tensor logits, Tensor targets, str group) -> Tensor");
}

#define TRIDENT_TP_KERNELS(m)                                               \
  m.impl("copy_to_tp_region", CopyToKernel);                                \
  m.impl("reduce_from_tp_region", ReduceFromKernel);                        \
  m.impl("gather_from_tp_region", GatherKernel);                            \
  m.impl("scatter_to_tp_region", ScatterKernel);                            \
  m.impl("gather_from_sequence_region", SequenceGatherKernel);              \
  m.impl("reduce_scatter_to_sequence_region", SequenceReduceScatterKernel); \
  m.impl("vocab_parallel_cross_entropy", CrossEntropyKernel)

TORCH_LIBRARY_IMPL(trident, CPU, m) { TRIDENT_TP_KERNELS(m); }
TORCH_LIBRARY_IMPL(trident, CUDA, m) { TRIDENT_TP_KERNELS(m); }

TORCH_LIBRARY_IMPL(trident, Autograd, m) {
  m.impl("copy_to_tp_region", CopyToAutograd);
  m.impl("reduce_from_tp_region", ReduceFromAutograd);
  m.impl("gather_from_tp_region", GatherAutograd);
  m.impl("scatter_to_tp_region", ScatterAutograd);
  m.impl("gather_from_sequence_region", SequenceGatherAutograd);
  m.impl("reduce_scatter_to_sequence_region", SequenceReduceScatterAutograd);
  m.impl("vocab_parallel_cross_entropy", CrossEntropyAutograd);
}

at::Tensor CopyToTensorParallelRegion(const at::Tensor& x, const std::string& group) {
  static const auto op = Op<Unary>("trident::copy_to_tp_region");
  return op.call(x, group);
}

at::Tensor ReduceFromTensorParallelRegion(const at::Tensor& x, const std::string& group) {
  static const auto op = Op<Unary>("trident::reduce_from_tp_region");
  return op.call(x, group);
}

at::Tensor GatherFromTensorParallelRegion(const at::Tensor& x, const std::string& group) {
  static const auto op = Op<Unary>("trident::gather_from_tp_region");
  return op.call(x, group);
}

at::Tensor ScatterToTensorParallelRegion(const at::Tensor& x, const std::string& group) {
  static const auto op = Op<Unary>("trident::scatter_to_tp_region");
  return op.call(x, group);
}

at::Tensor GatherFromSequenceParallelRegion(const at::Tensor& x, const std::string& group, int64_t dim) {
  static const auto op = Op<Sequence>("trident::gather_from_sequence_region");
  return op.call(x, group, dim);
}

at::Tensor ReduceScatterToSequenceParallelRegion(const at::Tensor& x, const std::string& group, int64_t dim) {
  static const auto op = Op<Sequence>("trident::reduce_scatter_to_sequence_region");
  return op.call(x, group, dim);
}

at::Tensor VocabParallelCrossEntropy(const at::Tensor& logits, const at::Tensor& targets, const std::string& group) {
  static const auto op =
      Op<at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view)>("trident::vocab_parallel_cross_entropy");
  return op.call(logits, targets, group);
}

at::Tensor SubPipelinedColumnProduct(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                     const std::string& group) {
  const at::Tensor b = bias.defined() ? AutocastOperand(bias) : at::empty({0}, weight.options());
  return SubPipelinedColumn::apply(AutocastOperand(x), AutocastOperand(weight), b, group);
}

at::Tensor SubPipelinedRowProduct(const at::Tensor& x, const at::Tensor& weight, const std::string& group) {
  return SubPipelinedRow::apply(AutocastOperand(x), AutocastOperand(weight), group);
}

bool SubPipelinesBlock(const TensorParallelism& tp, const at::Tensor& x) {
  return tp.overlapping_level >= 2 && tp.size > 1 && !tp.sequence_parallel && x.dim() > 0 && x.size(0) >= 2;
}

at::Tensor RunSubPipelinedBlock(const at::Tensor& x, const std::vector<BlockRegion>& regions,
                                const std::string& group) {
  const ProcessGroup& process_group = GroupNamed(group);
  std::vector<at::Tensor> stream = x.chunk(kSubBatches, 0);  // each sub-micro-batch's residual stream
  // The await nodes' sequence numbers: below this block's operators, rising
  // in the order they are made, so backward awaits the sums in the order it
  // starts them.
  const uint64_t awaits = regions.size() * stream.size(), first = at::sequence_number::peek();
  uint64_t priority = first > awaits ? first - awaits : 0;
  std::vector<SumInFlight> in_flight(stream.size());
  for (size_t r = 0; r <= regions.size(); ++r) {
    for (size_t i = 0; i < stream.size(); ++i) {
      if (r > 0) stream[i] = regions[r - 1].leave(stream[i], in_flight[i].Wait());
      if (r == regions.size()) continue;
      const at::Tensor input = ColumnInputSummingGradient(regions[r].enter(stream[i]), process_group, priority++);
      in_flight[i] = StartSum(regions[r].partial(input), process_group);
    }
  }
  return at::cat(stream, 0);
}

int64_t SubPipelinedGradientSumsOverlapped() { return gradient_sums_overlapped.load(); }

int64_t TensorParallelBytesCommunicated() { return bytes_communicated.load(); }

}  // namespace trident
