// The built-in pairs' fused operators (trident::causal_attention,
// trident::add_layer_norm, trident::bias_gelu), registered with autograd so a
// traced graph holds each as one node and its backward runs when the graph runs.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>
#include <torch/version.h>

#include "base/autocast_state.h"
#include "kernels/internal/causal_attention_cpu.h"
#include "kernels/internal/cuda_dtype_of.h"
#include "kernels/internal/layer_norm_cuda.h"
#include "kernels/kernels.h"

namespace trident {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// ---- causal attention in blocks of queries ----

// Queries per block: each block multiplies against the keys up to its last
// query only, so the scores above the diagonal outside the block are never
// computed, and a block's scores are all that is ever held.
constexpr int64_t kQueryBlock = 128;

// The additive causal mask for query positions [first, first + rows) over keys
// [0, keys): -inf where the key comes after the query.
at::Tensor CausalMask(int64_t first, int64_t rows, int64_t keys, const at::TensorOptions& options) {
  thread_local at::Tensor mask;
  if (!mask.defined() || mask.size(0) < keys || mask.scalar_type() != options.dtype().toScalarType() ||
      mask.device() != options.device()) {
    mask = at::full({keys, keys}, -std::numeric_limits<double>::infinity(), options).triu(1);
  }
  return mask.narrow(0, first, rows).narrow(1, 0, keys);
}

// The [B*H, T, D] views of q, k, v and how the blocks run over them.
struct AttentionShape {
  AttentionShape(const at::Tensor& q, const at::Tensor& k)
      : batch_heads(q.size(0) * q.size(1)),
        queries(q.size(2)),
        keys(k.size(2)),
        dim(q.size(3)),
        offset(keys - queries),
        scale(1.0 / std::sqrt(static_cast<double>(dim))) {}
  at::Tensor Flat(const at::Tensor& x) const { return x.reshape({batch_heads, x.size(2), dim}); }
  // Calls body(first query, rows, keys it sees) for each block.
  template <typename Body>
  void ForEachBlock(Body body) const {
    for (int64_t first = 0; first < queries; first += kQueryBlock) {
      const int64_t rows = std::min(kQueryBlock, queries - first);
      body(first, rows, offset + first + rows);
    }
  }
  // softmax(mask + scale * q k^T) of one block.
  at::Tensor Probabilities(const at::Tensor& q, const at::Tensor& k, int64_t first, int64_t rows, int64_t seen) const {
    at::Tensor mask = CausalMask(offset + first, rows, seen, q.options());
    at::Tensor scores = at::baddbmm(mask.expand({batch_heads, rows, seen}), q.narrow(1, first, rows),
                                    k.narrow(1, 0, seen).transpose(1, 2), /*beta=*/1, /*alpha=*/scale);
    return at::softmax(scores, -1);
  }
  int64_t batch_heads, queries, keys, dim, offset;
  double scale;
};

// `kept` (may be null) receives the probabilities when the queries fit one
// block: short sequences keep them for backward, as the unfused path does,
// instead of computing them again.
at::Tensor AttentionForward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor* kept) {
  const AttentionShape shape(q, k);
  const at::Tensor qf = shape.Flat(q), kf = shape.Flat(k), vf = shape.Flat(v);
  if (shape.queries <= kQueryBlock) {
    at::Tensor p = shape.Probabilities(qf, kf, 0, shape.queries, shape.keys);
    if (kept != nullptr) *kept = p;
    return at::bmm(p, vf).view(q.sizes());
  }
  at::Tensor out = at::empty({shape.batch_heads, shape.queries, shape.dim}, q.options());
  shape.ForEachBlock([&](int64_t first, int64_t rows, int64_t seen) {
    out.narrow(1, first, rows).copy_(at::bmm(shape.Probabilities(qf, kf, first, rows, seen), vf.narrow(1, 0, seen)));
  });
  return out.view(q.sizes());
}

at::Tensor AttentionKernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  internal::CheckAttentionShapes(q, k, v);
  if (internal::CpuAttentionTakes(q, k, v)) return internal::CpuAttentionForward(q, k, v).first;
  return AttentionForward(q, k, v, nullptr);
}

// fp32 on the CPU: the fused kernels of internal/causal_attention_cpu.h, which
// keep each query's log-sum-exp for backward (saved[3]). Otherwise the blocks
// above.
struct CausalAttentionFunction : torch::autograd::Function<CausalAttentionFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    internal::CheckAttentionShapes(q, k, v);
    if (internal::CpuAttentionTakes(q, k, v)) {
      auto [out, lse] = internal::CpuAttentionForward(q, k, v);
      ctx->save_for_backward({q, k, v, lse});
      return out;
    }
    at::Tensor kept;
    at::Tensor out = AttentionForward(q, k, v, &kept);
    ctx->save_for_backward({q, k, v, kept});
    return out;
  }
  // Per block: the probabilities (kept, or again), then dV += P^T dO, dS = P (dP - rowsum(dP P)),
  // dQ = scale dS K, dK += scale dS^T Q.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2];
    if (internal::CpuAttentionTakes(q, k, v)) {
      auto [dq, dk, dv] = internal::CpuAttentionBackward(q, k, v, saved[3], grads[0]);
      return {dq, dk, dv};
    }
    const AttentionShape shape(q, k);
    const at::Tensor qf = shape.Flat(q), kf = shape.Flat(k), vf = shape.Flat(v), go = shape.Flat(grads[0]);
    at::Tensor dq = at::empty_like(qf), dk = at::zeros_like(kf), dv = at::zeros_like(vf);
    shape.ForEachBlock([&](int64_t first, int64_t rows, int64_t seen) {
      const at::Tensor p = saved[3].defined() ? saved[3] : shape.Probabilities(qf, kf, first, rows, seen);
      const at::Tensor g = go.narrow(1, first, rows);
      dv.narrow(1, 0, seen).baddbmm_(p.transpose(1, 2), g);
      at::Tensor ds =
          at::_softmax_backward_data(at::bmm(g, vf.narrow(1, 0, seen).transpose(1, 2)), p, -1, p.scalar_type());
      ds.mul_(shape.scale);
      dq.narrow(1, first, rows).copy_(at::bmm(ds, kf.narrow(1, 0, seen)));
      dk.narrow(1, 0, seen).baddbmm_(ds.transpose(1, 2), qf.narrow(1, first, rows));
    });
    return {dq.view(q.sizes()), dk.view(k.sizes()), dv.view(v.sizes())};
  }
};

at::Tensor CausalAttentionAutograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
#if TORCH_VERSION_MAJOR >= 2
  // LibTorch 2's fused kernels (flash, memory-efficient, cuDNN) with their own backward.
  if (q.is_cuda() && q.size(2) == k.size(2)) {
    return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, 0.0, /*is_causal=*/true);
  }
#endif
  return CausalAttentionFunction::apply(q, k, v);
}

// ---- residual add + LayerNorm ----

// A custom function's tensor arguments must be defined: an absent residual,
// weight or bias travels as an empty tensor.
at::Tensor PresentOrEmpty(const c10::optional<at::Tensor>& t, const at::Tensor& like) {
  return t && t->defined() ? *t : at::empty({0}, like.options());
}
c10::optional<at::Tensor> AbsentIfEmpty(const at::Tensor& t) {
  return t.defined() && t.numel() > 0 ? c10::optional<at::Tensor>(t) : c10::nullopt;
}

struct NormParts {
  at::Tensor sum, out, mean, rstd;
};

// The sum (x itself without a residual) and LayerNorm's output, mean and
// 1/std, through ATen's kernels: a one-pass loop of this file's own, compiled
// for the baseline instruction set, measured 1.2-1.35x slower on CPU than
// ATen's add and LayerNorm, which dispatch to AVX2.
NormParts AddLayerNormForward(const at::Tensor& x, const at::Tensor& r, double alpha, at::IntArrayRef shape,
                              const at::Tensor& weight, const at::Tensor& bias, double eps) {
  TORCH_CHECK(!r.defined() || x.sizes() == r.sizes(), "add_layer_norm: x ", x.sizes(), " and residual ", r.sizes(),
              " must have one shape");
  NormParts parts;
  parts.sum = r.defined() ? at::add(x, r, alpha) : x;
  std::tie(parts.out, parts.mean, parts.rstd) = at::native_layer_norm(parts.sum, shape, weight, bias, eps);
  return parts;
}

struct AddLayerNormFunction : torch::autograd::Function<AddLayerNormFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& r, double alpha,
                               std::vector<int64_t> shape, const at::Tensor& weight, const at::Tensor& bias,
                               double eps) {
    const at::Tensor present_weight = AbsentIfEmpty(weight).value_or(at::Tensor()),
                     present_bias = AbsentIfEmpty(bias).value_or(at::Tensor());
    NormParts parts = AddLayerNormForward(x, AbsentIfEmpty(r).value_or(at::Tensor()), alpha, shape, present_weight,
                                          present_bias, eps);
    ctx->save_for_backward({parts.sum, parts.mean, parts.rstd, present_weight, present_bias});
    ctx->saved_data["alpha"] = alpha;
    ctx->saved_data["shape"] = shape;
    ctx->saved_data["residual"] = r.numel() > 0;
    return {parts.sum, parts.out};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &sum = saved[0], &weight = saved[3], &bias = saved[4];
    const std::vector<int64_t> shape = ctx->saved_data["shape"].toIntVector();
    at::Tensor grad_sum, grad_weight, grad_bias;
    if (grads[1].defined()) {
      std::tie(grad_sum, grad_weight, grad_bias) =
          at::native_layer_norm_backward(grads[1].contiguous(), sum, shape, saved[1], saved[2], weight, bias,
                                         {true, weight.defined(), bias.defined()});
      if (grads[0].defined()) grad_sum.add_(grads[0]);
    } else {
      grad_sum = grads[0];
    }
    const double alpha = ctx->saved_data["alpha"].toDouble();
    at::Tensor grad_residual;
    if (ctx->saved_data["residual"].toBool()) {
      grad_residual = grad_sum.defined() && alpha != 1.0 ? grad_sum * alpha : grad_sum;
    }
    return {grad_sum, grad_residual, at::Tensor(), at::Tensor(), grad_weight, grad_bias, at::Tensor()};
  }
};

template <typename Signature>
c10::TypedOperatorHandle<Signature> Op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// On CUDA, where layer_norm_cuda.cu's kernels take the types and width
// (trident::add_layer_norm_rows and its backward): forward reads x and the
// residual once and writes the output in the type the next product reads
// (autocast's); backward adds the sum's gradient in the same pass, so a
// residual stream's gradient needs no addition of its own.
struct AddLayerNormCudaFunction : torch::autograd::Function<AddLayerNormCudaFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& r, double alpha,
                               const at::Tensor& weight, const at::Tensor& bias, double eps, int64_t out_dtype) {
    static const auto rows_op = Op<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
        const at::Tensor&, const c10::optional<at::Tensor>&, double, const c10::optional<at::Tensor>&,
        const c10::optional<at::Tensor>&, double, at::ScalarType)>("trident::add_layer_norm_rows");
    auto [sum, out, mean, rstd] = rows_op.call(x, AbsentIfEmpty(r), alpha, AbsentIfEmpty(weight), AbsentIfEmpty(bias),
                                               eps, static_cast<at::ScalarType>(out_dtype));
    const bool has_residual = r.numel() > 0;
    if (!has_residual) sum = x;  // the sum's gradient joins x's in backward's pass
    ctx->save_for_backward({sum, mean, rstd, weight, bias});
    ctx->saved_data["alpha"] = alpha;
    ctx->saved_data["residual_dtype"] = has_residual ? static_cast<int64_t>(r.scalar_type()) : int64_t{-1};
    return {sum, out};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto backward_op = Op<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
        const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&,
        const c10::optional<at::Tensor>&, double, c10::optional<at::ScalarType>, bool, bool)>(
        "trident::add_layer_norm_rows_backward");
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &sum = saved[0], &weight = saved[3], &bias = saved[4];
    const double alpha = ctx->saved_data["alpha"].toDouble();
    const int64_t residual_code = ctx->saved_data["residual_dtype"].toInt();
    const c10::optional<at::ScalarType> residual_dtype =
        residual_code < 0 ? c10::nullopt : c10::optional<at::ScalarType>(static_cast<at::ScalarType>(residual_code));
    if (!grads[1].defined()) {  // only the sum was used
      const at::Tensor& g = grads[0];
      at::Tensor grad_residual = residual_dtype && g.defined() ? (g * alpha).to(*residual_dtype) : at::Tensor();
      return {g, grad_residual, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }
    auto [grad_x, grad_residual, grad_weight, grad_bias] = backward_op.call(
        sum, grads[1], grads[0].defined() ? c10::optional<at::Tensor>(grads[0]) : c10::nullopt, saved[1], saved[2],
        AbsentIfEmpty(weight), alpha, residual_dtype, weight.numel() > 0, bias.numel() > 0);
    const auto as = [](const at::Tensor& grad, const at::Tensor& like) {
      return like.numel() > 0 ? grad.to(like.scalar_type()) : at::Tensor();
    };
    if (!residual_dtype) grad_residual = at::Tensor();
    return {grad_x,       grad_residual, at::Tensor(), as(grad_weight, weight), as(grad_bias, bias),
            at::Tensor(), at::Tensor()};
  }
};

// The output type of the CUDA kernels' path, when they take x, the residual
// and the normalized shape: autocast's lower precision for fp32 x under
// autocast, else x's own.
c10::optional<at::ScalarType> CudaNormOutput(const at::Tensor& x, const c10::optional<at::Tensor>& r,
                                             at::IntArrayRef shape) {
  if (!x.is_cuda() || x.numel() == 0 || shape.size() != 1 || shape[0] != x.size(-1)) return c10::nullopt;
  const bool has_residual = r && r->defined();
  if (has_residual && r->sizes() != x.sizes()) return c10::nullopt;
  const AutocastState autocast = GetAutocastState(x.device().type());
  const at::ScalarType out = autocast.enabled && x.scalar_type() == at::kFloat ? autocast.dtype : x.scalar_type();
  AddLayerNormDtypes dtypes;
  const bool known = CudaDtypeOf(x.scalar_type(), &dtypes.x) &&
                     CudaDtypeOf(has_residual ? r->scalar_type() : x.scalar_type(), &dtypes.residual) &&
                     CudaDtypeOf(out, &dtypes.out);
  return known && AddLayerNormTakes(dtypes, x.size(-1)) ? c10::optional<at::ScalarType>(out) : c10::nullopt;
}

std::tuple<at::Tensor, at::Tensor> AddLayerNormAutograd(const at::Tensor& x, const c10::optional<at::Tensor>& r,
                                                        const c10::Scalar& alpha, at::IntArrayRef shape,
                                                        const c10::optional<at::Tensor>& weight,
                                                        const c10::optional<at::Tensor>& bias, double eps) {
  if (const c10::optional<at::ScalarType> out = CudaNormOutput(x, r, shape)) {
    variable_list parts =
        AddLayerNormCudaFunction::apply(x, PresentOrEmpty(r, x), alpha.toDouble(), PresentOrEmpty(weight, x),
                                        PresentOrEmpty(bias, x), eps, static_cast<int64_t>(*out));
    return {parts[0], parts[1]};
  }
  // Mixed precision: the sum in the wider type, as x + r would promote.
  const bool has_residual = r && r->defined();
  const at::ScalarType dtype = has_residual ? at::promote_types(x.scalar_type(), r->scalar_type()) : x.scalar_type();
  variable_list parts =
      AddLayerNormFunction::apply(x.to(dtype), has_residual ? r->to(dtype) : PresentOrEmpty(r, x), alpha.toDouble(),
                                  shape.vec(), PresentOrEmpty(weight, x), PresentOrEmpty(bias, x), eps);
  return {parts[0], parts[1]};
}

std::tuple<at::Tensor, at::Tensor> AddLayerNormKernel(const at::Tensor& x, const c10::optional<at::Tensor>& r,
                                                      const c10::Scalar& alpha, at::IntArrayRef shape,
                                                      const c10::optional<at::Tensor>& weight,
                                                      const c10::optional<at::Tensor>& bias, double eps) {
  NormParts parts = AddLayerNormForward(x, r.value_or(at::Tensor()), alpha.toDouble(), shape,
                                        weight.value_or(at::Tensor()), bias.value_or(at::Tensor()), eps);
  // An operator's outputs are its own: without a residual the sum is a copy of x.
  return {parts.sum.is_same(x) ? x.clone() : parts.sum, parts.out};
}

// ---- bias add + GELU ----

// gelu(x + bias) written once: the sum's buffer becomes the output in place.
at::Tensor BiasGeluForward(const at::Tensor& x, const at::Tensor& bias, c10::string_view approximate) {
  at::Tensor out = at::add(x, bias);
  return at::gelu_(out, approximate);
}

struct BiasGeluFunction : torch::autograd::Function<BiasGeluFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& bias,
                            std::string approximate) {
    ctx->save_for_backward({x, bias});  // not x + bias: backward adds again, in the buffer it returns
    ctx->saved_data["approximate"] = approximate;
    return BiasGeluForward(x, bias, approximate);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &bias = saved[1];
    at::Tensor grad = at::add(x, bias);
    at::gelu_backward_out(grad, grads[0], grad, ctx->saved_data["approximate"].toStringRef());
    std::vector<int64_t> rows(x.dim() - 1);
    std::iota(rows.begin(), rows.end(), 0);
    return {grad, grad.sum(rows).view(bias.sizes()), at::Tensor()};
  }
};

at::Tensor BiasGeluAutograd(const at::Tensor& x, const at::Tensor& bias, c10::string_view approximate) {
  // Under autocast the product arrives in the lower precision; the bias joins it there, as in linear.
  return BiasGeluFunction::apply(x, bias.to(x.scalar_type()), std::string(approximate));
}

at::Tensor BiasGeluKernel(const at::Tensor& x, const at::Tensor& bias, c10::string_view approximate) {
  return BiasGeluForward(x, bias.to(x.scalar_type()), approximate);
}

// ---- cross-entropy ----

// The loss and, with `gradient`, d(loss)/d(logits) in fp32 from the same
// buffer: log-softmax, then softmax in place, minus the one-hot target, over
// the count of counted rows (ignored rows zero).
std::pair<at::Tensor, at::Tensor> CrossEntropyForward(const at::Tensor& logits, const at::Tensor& targets,
                                                      int64_t ignore_index, bool gradient) {
  TORCH_CHECK(logits.dim() == 2 && targets.dim() == 1 && targets.size(0) == logits.size(0),
              "trident::cross_entropy takes logits [N, C] and targets [N]; got ", logits.sizes(), " and ",
              targets.sizes());
  at::Tensor log_p = at::log_softmax(logits, 1, at::kFloat);
  const at::Tensor counted = targets.ne(ignore_index);
  const at::Tensor rows = at::where(counted, targets, at::zeros({}, targets.options())).unsqueeze(1);
  const at::Tensor count = counted.sum().to(at::kFloat);
  const at::Tensor picked = log_p.gather(1, rows).squeeze(1);
  at::Tensor loss = at::where(counted, picked, at::zeros({}, picked.options())).sum().neg_().div_(count);
  if (!gradient) return {loss, at::Tensor()};
  const at::Tensor weight = counted.to(at::kFloat).div_(count).unsqueeze(1);
  at::Tensor grad = log_p.exp_();  // the softmax, in the log-softmax's buffer
  grad.scatter_add_(1, rows, at::full_like(weight, -1)).mul_(weight);
  return {loss, grad};
}

// On the CPU: the loss and its gradient from one fp32 buffer, made in forward
// (all backward keeps). On CUDA: each row's log-sum-exp in one pass over the
// logits (trident::cross_entropy_rows, kept with the logits), and backward
// writes the gradient in the logits' precision in one more pass
// (trident::cross_entropy_rows_backward); both kernels are in
// cross_entropy_cuda.cu.
struct CrossEntropyFunction : torch::autograd::Function<CrossEntropyFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets,
                            int64_t ignore_index) {
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits.scalar_type());
    if (logits.is_cuda()) {
      static const auto rows_op = Op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, int64_t)>(
          "trident::cross_entropy_rows");
      auto [lse, losses] = rows_op.call(logits, targets, ignore_index);
      const at::Tensor count = targets.ne(ignore_index).sum().to(at::kFloat);
      ctx->save_for_backward({logits, targets, lse, count});
      ctx->saved_data["ignore_index"] = ignore_index;
      return losses.sum().div_(count);
    }
    auto [loss, grad] = CrossEntropyForward(logits, targets, ignore_index, /*gradient=*/true);
    ctx->saved_data["grad"] = grad;  // all backward needs: not the logits, not their log-softmax
    return loss;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (ctx->saved_data.count("ignore_index") > 0) {  // the CUDA path
      static const auto backward_op =
          Op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t)>(
              "trident::cross_entropy_rows_backward");
      const auto saved = ctx->get_saved_variables();
      const at::Tensor scale = grads[0].to(at::kFloat) / saved[3];  // on the device: no wait for the loss
      return {backward_op.call(saved[0], saved[1], saved[2], scale, ctx->saved_data["ignore_index"].toInt()),
              at::Tensor(), at::Tensor()};
    }
    at::Tensor grad = ctx->saved_data["grad"].toTensor();
    ctx->saved_data.erase("grad");  // the only reference: a leaf's .grad may take the buffer itself
    grad.mul_(grads[0]);            // in place: a graph is run backward once
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    return {grad.to(dtype), at::Tensor(), at::Tensor()};
  }
};

at::Tensor CrossEntropyAutograd(const at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index) {
  return CrossEntropyFunction::apply(logits, targets, ignore_index);
}

at::Tensor CrossEntropyKernel(const at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index) {
  return CrossEntropyForward(logits, targets, ignore_index, /*gradient=*/false).first;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(trident, m) {
  m.def("causal_attention(Tensor q, Tensor k, Tensor v) -> Tensor");
  m.def(
      "add_layer_norm(Tensor x, Tensor? residual, Scalar alpha, int[] normalized_shape, Tensor? weight, "
      "Tensor? bias, float eps) -> (Tensor, Tensor)");
  m.def("bias_gelu(Tensor x, Tensor bias, str approximate) -> Tensor");
  m.def("cross_entropy(Tensor logits, Tensor targets, int ignore_index) -> Tensor");
  // CUDA only (cross_entropy_cuda.cc): each row's log-sum-exp and loss in fp32; the logits' gradient.
  m.def("cross_entropy_rows(Tensor logits, Tensor targets, int ignore_index) -> (Tensor, Tensor)");
  m.def(
      "cross_entropy_rows_backward(Tensor logits, Tensor targets, Tensor lse, Tensor scale, int ignore_index) -> "
      "Tensor");
  // CUDA only (layer_norm_cuda.cc): x (+ alpha residual) over the last dimension; outputs not asked for are
  // empty: (sum, out, mean, rstd) and (grad_x, grad_residual, grad_weight, grad_bias).
  m.def(
      "add_layer_norm_rows(Tensor x, Tensor? residual, float alpha, Tensor? weight, Tensor? bias, float eps, "
      "ScalarType out_dtype) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "add_layer_norm_rows_backward(Tensor sum, Tensor grad_out, Tensor? grad_sum, Tensor mean, Tensor rstd, "
      "Tensor? weight, float alpha, ScalarType? residual_dtype, bool weight_grad, bool bias_grad) -> "
      "(Tensor, Tensor, Tensor, Tensor)");
}

#define TRIDENT_FUSED_KERNELS(m)                \
  m.impl("causal_attention", AttentionKernel);  \
  m.impl("add_layer_norm", AddLayerNormKernel); \
  m.impl("bias_gelu", BiasGeluKernel);          \
  m.impl("cross_entropy", CrossEntropyKernel)

TORCH_LIBRARY_IMPL(trident, CPU, m) { TRIDENT_FUSED_KERNELS(m); }
TORCH_LIBRARY_IMPL(trident, CUDA, m) { TRIDENT_FUSED_KERNELS(m); }

TORCH_LIBRARY_IMPL(trident, Autograd, m) {
  m.impl("causal_attention", CausalAttentionAutograd);
  m.impl("add_layer_norm", AddLayerNormAutograd);
  m.impl("bias_gelu", BiasGeluAutograd);
  m.impl("cross_entropy", CrossEntropyAutograd);
}

at::Tensor FusedCausalAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  static const auto op =
      Op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>("trident::causal_attention");
  return op.call(q, k, v);
}

bool FusedCausalAttentionOnCpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  return internal::CpuAttentionTakes(q, k, v);
}

std::pair<at::Tensor, at::Tensor> FusedAddLayerNorm(const at::Tensor& x, const at::Tensor& residual, double alpha,
                                                    at::IntArrayRef normalized_shape, const at::Tensor& weight,
                                                    const at::Tensor& bias, double eps) {
  static const auto op = Op<std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const c10::optional<at::Tensor>&, const c10::Scalar&, at::IntArrayRef,
      const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&, double)>("trident::add_layer_norm");
  const auto optional = [](const at::Tensor& t) { return t.defined() ? c10::optional<at::Tensor>(t) : c10::nullopt; };
  auto [sum, out] = op.call(x, optional(residual), alpha, normalized_shape, optional(weight), optional(bias), eps);
  return {sum, out};
}

at::Tensor FusedBiasGelu(const at::Tensor& x, const at::Tensor& bias, const std::string& approximate) {
  static const auto op = Op<at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view)>("trident::bias_gelu");
  return op.call(x, bias, approximate);
}

at::Tensor FusedCrossEntropy(const at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index) {
  static const auto op = Op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)>("trident::cross_entropy");
  return op.call(logits, targets, ignore_index);
}

}  // namespace trident
