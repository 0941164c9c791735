// Tensor-parallel layers, shard specifications and the user-model mapping.
#include <algorithm>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/nn/functional/linear.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/module_names.h"
#include "base/status.h"
#include "kernels/kernels.h"
#include "tensor_parallel/tensor_parallel.h"
#include "topology/topology.h"

namespace trident {
namespace {

// Throws std::invalid_argument naming `what` when `size` does not divide by `parts`.
int64_t Divide(int64_t size, int64_t parts, const std::string& what) {
  if (parts < 1 || size % parts != 0) {
    throw std::invalid_argument(absl::StrCat(what, " (", size, ") is not divisible by tp (", parts, ")"));
  }
  return size / parts;
}

// The adapter's rank-r product x A^T (after its dropout) on this rank's input.
at::Tensor AdapterProduct(const LowRankAdapter& adapter, const at::Tensor& x, bool training) {
  return at::linear(adapter.dropout > 0 ? at::dropout(x, adapter.dropout, training) : x, adapter.a);
}

// y + scale * h B^T in one product (addmm) for the layer's output y [..., out].
at::Tensor AddAdapterOutput(const LowRankAdapter& adapter, const at::Tensor& h, const at::Tensor& y) {
  return at::addmm(y.reshape({-1, y.size(-1)}), h.reshape({-1, h.size(-1)}), adapter.b.t(), /*beta=*/1,
                   /*alpha=*/adapter.scale)
      .view(y.sizes());
}

// A column-parallel layer's output `y` with its adapter's, for the layer's
// input `x` before the region.
at::Tensor WithColumnAdapter(const LowRankAdapter& adapter, const at::Tensor& x, const at::Tensor& y,
                             const TensorParallelism& tp, bool training) {
  return AddAdapterOutput(adapter, ColumnParallelInput(AdapterProduct(adapter, x, training), tp), y);
}

// A row-parallel layer's output `y` with its adapter's, for its input features `x`.
at::Tensor WithRowAdapter(const LowRankAdapter& adapter, const at::Tensor& x, const at::Tensor& y,
                          const TensorParallelism& tp, bool training) {
  return AddAdapterOutput(adapter, RowParallelOutput(AdapterProduct(adapter, x, training), tp), y);
}

// Whether a layer's product is sub-pipelined (tp_overlapping_level 1).
bool SubPipelined(const TensorParallelism& tp, const LowRankAdapter& adapter) {
  return tp.overlapping_level >= 1 && tp.size > 1 && !tp.sequence_parallel && !adapter.defined();
}

// A column-parallel layer's output on this rank's columns for its input `x`
// (replicated, or sequence shards), with bias `bias` (may be undefined).
at::Tensor ColumnParallelProduct(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                 const LowRankAdapter& adapter, const TensorParallelism& tp, bool training) {
  if (SubPipelined(tp, adapter)) return SubPipelinedColumnProduct(x, weight, bias, tp.group);
  at::Tensor y = AlignedLinear(ColumnParallelInput(x, tp), weight, bias);
  return adapter.defined() ? WithColumnAdapter(adapter, x, y, tp, training) : y;
}

// A row-parallel layer's output for its input features `x`: the partial
// product summed over the group, the adapter's, then the replicated bias. At
// tp = 1 the bias enters the product (one kernel fewer per layer on the GPU).
at::Tensor RowParallelProduct(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                              const LowRankAdapter& adapter, const TensorParallelism& tp, bool training) {
  if (SubPipelined(tp, adapter)) {
    const at::Tensor y = SubPipelinedRowProduct(x, weight, tp.group);
    return bias.defined() ? y + bias : y;
  }
  const bool bias_in_product = tp.size == 1;
  at::Tensor y = RowParallelOutput(at::linear(x, weight, bias_in_product ? bias : at::Tensor()), tp);
  if (adapter.defined()) y = WithRowAdapter(adapter, x, y, tp, training);
  return bias.defined() && !bias_in_product ? y + bias : y;
}

}  // namespace

at::Tensor ColumnParallelInput(const at::Tensor& x, const TensorParallelism& tp) {
  if (tp.size == 1) return x;
  return tp.sequence_parallel ? GatherFromSequenceParallelRegion(x, tp.group, 1)
                              : CopyToTensorParallelRegion(x, tp.group);
}

at::Tensor RowParallelOutput(const at::Tensor& y, const TensorParallelism& tp) {
  if (tp.size == 1) return y;
  return tp.sequence_parallel ? ReduceScatterToSequenceParallelRegion(y, tp.group, 1)
                              : ReduceFromTensorParallelRegion(y, tp.group);
}

at::Tensor ShardSpec::Slice(const at::Tensor& full) const {
  std::vector<at::Tensor> pieces;
  for (const at::Tensor& block : full.chunk(blocks, dim)) pieces.push_back(block.chunk(parts, dim)[index]);
  return at::cat(pieces, dim).contiguous();
}

at::Tensor ShardSpec::Unslice(const std::vector<at::Tensor>& shards) const {
  // Shard r holds slice r of every block: regroup by block, then join.
  std::vector<at::Tensor> pieces;
  for (int64_t b = 0; b < blocks; ++b) {
    for (const at::Tensor& shard : shards) pieces.push_back(shard.chunk(blocks, dim)[b]);
  }
  return at::cat(pieces, dim);
}

absl::StatusOr<std::vector<int64_t>> ShardSpec::ShardShape(const std::vector<int64_t>& full) const {
  if (dim < 0 || dim >= static_cast<int64_t>(full.size()) || full[dim] % (blocks * parts) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("a tensor of shape [", absl::StrJoin(full, ", "),
                                                   "] cannot be split into ", parts, " parts along dimension ", dim,
                                                   blocks > 1 ? absl::StrCat(" (in ", blocks, " blocks)") : ""));
  }
  std::vector<int64_t> shape = full;
  shape[dim] /= parts;
  return shape;
}

ColumnParallelLinearImpl::ColumnParallelLinearImpl(const TensorParallelism& tp, int64_t in_features,
                                                   int64_t out_features, bool bias, bool gather_output, int64_t blocks)
    : tp_(tp), gather_output_(gather_output), blocks_(blocks) {
  const int64_t local = Divide(out_features, tp.size * blocks, "output features") * blocks;
  weight = register_parameter("weight", at::empty({local, in_features}));
  if (bias) this->bias = register_parameter("bias", at::zeros({local}));
}

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& x) {
  at::Tensor y = LocalProduct(x, bias);
  return gather_output_ && tp_.size > 1 ? GatherFromTensorParallelRegion(y, tp_.group) : y;
}

at::Tensor ColumnParallelLinearImpl::ForwardSkipBias(const at::Tensor& x) {
  TORCH_CHECK(!gather_output_ || tp_.size == 1,
              "ColumnParallelLinear::ForwardSkipBias: the output must stay split (gather_output false)");
  return LocalProduct(x, at::Tensor());
}

at::Tensor ColumnParallelLinearImpl::ForwardInRegion(const at::Tensor& x, bool add_bias) {
  TORCH_CHECK(!adapter.defined() && !gather_output_ && !tp_.sequence_parallel,
              "ColumnParallelLinear::ForwardInRegion: for layers without an adapter, gathered output or "
              "sequence parallelism");
  return AlignedLinear(x, weight, add_bias ? bias : at::Tensor());
}

at::Tensor ColumnParallelLinearImpl::LocalProduct(const at::Tensor& x, const at::Tensor& b) {
  return ColumnParallelProduct(x, weight, b, adapter, tp_, is_training());
}

RowParallelLinearImpl::RowParallelLinearImpl(const TensorParallelism& tp, int64_t in_features, int64_t out_features,
                                             bool bias, bool input_is_parallel)
    : tp_(tp), input_is_parallel_(input_is_parallel) {
  weight = register_parameter("weight", at::empty({out_features, Divide(in_features, tp.size, "input features")}));
  if (bias) this->bias = register_parameter("bias", at::zeros({out_features}));
}

at::Tensor RowParallelLinearImpl::forward(const at::Tensor& x) {
  at::Tensor input = input_is_parallel_ || tp_.size == 1 ? x : ScatterToTensorParallelRegion(x, tp_.group);
  return RowParallelProduct(input, weight, bias, adapter, tp_, is_training());
}

at::Tensor RowParallelLinearImpl::PartialForward(const at::Tensor& x) {
  TORCH_CHECK(!adapter.defined() && input_is_parallel_,
              "RowParallelLinear::PartialForward: for layers without an adapter whose input is parallel");
  return at::linear(x, weight);
}

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(const TensorParallelism& tp, int64_t vocab_size, int64_t dim)
    : tp_(tp) {
  const int64_t rows = Divide(vocab_size, tp.size, "vocab_size");
  vocab_start_ = rows * tp.rank;
  vocab_end_ = vocab_start_ + rows;
  weight = register_parameter("weight", at::empty({rows, dim}));
}

at::Tensor VocabParallelEmbeddingImpl::LocalLookup(const at::Tensor& ids) {
  if (tp_.size == 1) return at::embedding(weight, ids);
  at::Tensor outside = (ids < vocab_start_).logical_or(ids >= vocab_end_);
  at::Tensor rows = at::embedding(weight, (ids - vocab_start_).masked_fill(outside, 0));
  return rows.masked_fill(outside.unsqueeze(-1), 0);
}

at::Tensor VocabParallelEmbeddingImpl::forward(const at::Tensor& ids) {
  return RowParallelOutput(LocalLookup(ids), tp_);
}

absl::Status SequenceParallelGradients(const std::vector<at::Tensor>& parameters, const std::string& group) {
  std::vector<at::Tensor> grads;
  for (const at::Tensor& p : parameters) {
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  if (grads.empty()) return absl::OkStatus();
  TRIDENT_ASSIGN_OR_RETURN(ProcessGroup * tp, FindProcessGroup(group));
  if (tp->size() == 1) return absl::OkStatus();
  std::vector<at::Tensor> flat;
  for (const at::Tensor& g : grads) flat.push_back(g.reshape({-1}));
  at::Tensor sum = at::cat(flat);
  TRIDENT_RETURN_IF_ERROR(tp->AllReduce(sum));
  int64_t offset = 0;
  for (at::Tensor& g : grads) {
    g.copy_(sum.narrow(0, offset, g.numel()).view_as(g));
    offset += g.numel();
  }
  return absl::OkStatus();
}

ParallelLinearImpl::ParallelLinearImpl(int64_t in_features, int64_t out_features, bool bias) {
  weight = register_parameter("weight", at::empty({out_features, in_features}));
  if (bias) this->bias = register_parameter("bias", at::zeros({out_features}));
  // The default nn::Linear initialisation.
  const double bound = 1.0 / std::sqrt(static_cast<double>(in_features));
  c10::NoGradGuard no_grad;
  weight.uniform_(-bound, bound);
  if (bias) this->bias.uniform_(-bound, bound);
}

ShardSpec ParallelLinearImpl::weight_shard() const {
  switch (mode_) {
    case Mode::kPlain:
      return {};
    case Mode::kColumn:
      return {0, tp_.size, tp_.rank, 1};
    case Mode::kRow:
      return {1, tp_.size, tp_.rank, 1};
  }
  return {};
}

at::Tensor ParallelLinearImpl::forward(const at::Tensor& x) {
  if (mode_ == Mode::kRow) {
    return RowParallelProduct(x, weight, bias, adapter, tp_, is_training());
  }
  // Plain mode is column mode at tp = 1 (a tp of size 1).
  return ColumnParallelProduct(x, weight, bias, adapter, tp_, is_training());
}

namespace {

// The adapter slot, weight and shard of a linear module AddLowRankAdapter takes.
struct AdaptableLinear {
  LowRankAdapter* adapter = nullptr;
  at::Tensor weight;
  ShardSpec shard;
  bool row = false;
};

std::optional<AdaptableLinear> Adaptable(torch::nn::Module& module) {
  if (auto* column = dynamic_cast<ColumnParallelLinearImpl*>(&module)) {
    return AdaptableLinear{&column->adapter, column->weight, column->weight_shard(), false};
  }
  if (auto* row = dynamic_cast<RowParallelLinearImpl*>(&module)) {
    return AdaptableLinear{&row->adapter, row->weight, row->weight_shard(), true};
  }
  if (auto* linear = dynamic_cast<ParallelLinearImpl*>(&module)) {
    return AdaptableLinear{&linear->adapter, linear->weight, linear->weight_shard(),
                           linear->mode() == ParallelLinearImpl::Mode::kRow};
  }
  return std::nullopt;
}

// The Module child `name` of `parent`, registered when it has none.
std::shared_ptr<torch::nn::Module> Child(torch::nn::Module& parent, const std::string& name) {
  const auto children = parent.named_children();
  if (const auto* found = children.find(name)) return *found;
  return parent.register_module(name, std::make_shared<torch::nn::Module>());
}

// Parameter "<child>.<name>.weight" of `module`, registered (or set) to `value`.
at::Tensor SetAdapterParameter(torch::nn::Module& module, const std::string& child, const std::string& name,
                               const at::Tensor& value) {
  std::shared_ptr<torch::nn::Module> holder = Child(*Child(module, child), name);
  auto parameters = holder->named_parameters(/*recurse=*/false);
  if (at::Tensor* existing = parameters.find("weight")) {
    existing->set_data(value);
    return *existing;
  }
  return holder->register_parameter("weight", value);
}

}  // namespace

std::optional<std::pair<int64_t, int64_t>> LinearFeatures(const torch::nn::Module& module) {
  std::optional<AdaptableLinear> linear = Adaptable(const_cast<torch::nn::Module&>(module));
  if (!linear) return std::nullopt;
  std::vector<int64_t> full = linear->weight.sizes().vec();
  full[linear->shard.dim] *= linear->shard.parts;
  return std::make_pair(full[0], full[1]);
}

absl::StatusOr<std::map<std::string, ShardSpec>> AddLowRankAdapter(torch::nn::Module& module, const std::string& name,
                                                                   const at::Tensor& full_a, double scale,
                                                                   double dropout) {
  std::optional<AdaptableLinear> linear = Adaptable(module);
  if (!linear) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a LoRA adapter needs a ColumnParallelLinear, RowParallelLinear or ParallelLinear; this module is ",
        module.name(), " (build the layer as trident::ParallelLinear)"));
  }
  const auto [out_features, in_features] = *LinearFeatures(module);
  if (full_a.dim() != 2 || full_a.size(1) != in_features) {
    return absl::InvalidArgumentError(
        absl::StrCat("LoRA A must be [r, ", in_features, "]; it is ", c10::str(full_a.sizes())));
  }
  const int64_t r = full_a.size(0);
  const ShardSpec a_shard{1, linear->shard.parts, linear->shard.index, 1};
  c10::NoGradGuard no_grad;
  const at::TensorOptions options = linear->weight.options().requires_grad(false);
  at::Tensor a = (linear->row ? a_shard.Slice(full_a) : full_a).to(options).contiguous();
  at::Tensor b = at::zeros({linear->weight.size(0), r}, options);
  LowRankAdapter& adapter = *linear->adapter;
  adapter.a = SetAdapterParameter(module, "lora_A", name, a);
  adapter.b = SetAdapterParameter(module, "lora_B", name, b);
  adapter.scale = scale;
  adapter.dropout = dropout;
  std::map<std::string, ShardSpec> shards;
  if (linear->shard.parts > 1) {
    if (linear->row) {
      shards[absl::StrCat("lora_A.", name, ".weight")] = a_shard;
    } else {
      shards[absl::StrCat("lora_B.", name, ".weight")] = linear->shard;
    }
  }
  return shards;
}

absl::Status ApplyTensorParallel(torch::nn::Module& model, const TensorParallelLayers& layers,
                                 const TensorParallelism& tp) {
  // An error for the first name that matched nothing.
  auto unused = [](const std::vector<std::string>& patterns, const std::vector<int>& hits, const char* what,
                   const char* kind) -> absl::Status {
    for (size_t i = 0; i < patterns.size(); ++i) {
      if (hits[i] == 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor-parallel ", what, " '", patterns[i], "' matches no ", kind, " of the model"));
      }
    }
    return absl::OkStatus();
  };
  std::vector<int> column_hits(layers.column.size()), row_hits(layers.row.size()),
      attribute_hits(layers.attributes.size());
  c10::NoGradGuard no_grad;
  for (const auto& item : model.named_modules()) {
    const std::string& name = item.key();
    auto match = [&](const std::vector<std::string>& patterns, std::vector<int>& hits) {
      bool any = false;
      for (size_t i = 0; i < patterns.size(); ++i) {
        if (ModuleNameMatches(name, patterns[i])) any = ++hits[i] > 0;
      }
      return any;
    };
    const bool column = match(layers.column, column_hits), row = match(layers.row, row_hits);
    if (!column && !row) continue;
    auto* linear = dynamic_cast<ParallelLinearImpl*>(item.value().get());
    if (linear == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("tensor-parallel layer '", name,
                                                     "' is not a ParallelLinear; build it with "
                                                     "trident::ParallelLinear to let ApplyTensorParallel shard it"));
    }
    if (column && row) {
      return absl::InvalidArgumentError(absl::StrCat("layer '", name, "' is named both column- and row-parallel"));
    }
    const ShardSpec spec{column ? 0 : 1, tp.size, tp.rank, 1};
    if (linear->weight.size(spec.dim) % tp.size != 0) {
      return absl::InvalidArgumentError(absl::StrCat("layer '", name, "': ", column ? "output" : "input", " features (",
                                                     linear->weight.size(spec.dim), ") are not divisible by tp (",
                                                     tp.size, ")"));
    }
    linear->weight.set_data(spec.Slice(linear->weight));
    if (column && linear->bias.defined()) linear->bias.set_data(spec.Slice(linear->bias));
    linear->mode_ = column ? ParallelLinearImpl::Mode::kColumn : ParallelLinearImpl::Mode::kRow;
    linear->tp_ = tp;
  }
  for (auto& item : model.named_buffers()) {
    for (size_t i = 0; i < layers.attributes.size(); ++i) {
      if (!ModuleNameMatches(item.key(), layers.attributes[i])) continue;
      ++attribute_hits[i];
      at::Tensor& value = item.value();
      const int64_t v = value.item<int64_t>();
      if (v % tp.size != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("attribute '", item.key(), "' (", v, ") is not divisible by tp (", tp.size, ")"));
      }
      value.fill_(v / tp.size);
    }
  }
  TRIDENT_RETURN_IF_ERROR(unused(layers.column, column_hits, "column layer", "ParallelLinear module"));
  TRIDENT_RETURN_IF_ERROR(unused(layers.row, row_hits, "row layer", "ParallelLinear module"));
  return unused(layers.attributes, attribute_hits, "attribute", "buffer");
}

}  // namespace trident
