// Fused causal attention on the CPU, fp32: one task per (batch, head), each
// running through its queries in tiles of rows. A tile's scores against the
// keys up to its last query (scale q k^T, one oneDNN sgemm), their softmax and
// the product with v stay in a per-thread buffer of a few tiles' rows that the
// caches hold; nothing of size [B, H, Tq, Tk] is ever written. Backward
// recomputes each tile's probabilities from the forward's log-sum-exp of each
// query (as flash attention does) and accumulates dk and dv tile by tile.
#ifndef TRIDENT_KERNELS_INTERNAL_CAUSAL_ATTENTION_CPU_H_
#define TRIDENT_KERNELS_INTERNAL_CAUSAL_ATTENTION_CPU_H_

#include <tuple>
#include <utility>

#include <ATen/core/Tensor.h>

namespace trident {
namespace internal {

// Fails with an error that names the shapes unless q is [B, H, Tq, D] and k
// and v are [B, H, Tk, D] with Tk >= Tq (every path of causal_attention).
void CheckAttentionShapes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);

// Whether the kernels below take q [B, H, Tq, D] and k, v [B, H, Tk, D]: fp32
// CPU tensors, and oneDNN's sgemm in this process (kernels/kernels.h).
bool CpuAttentionTakes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);

// (out [B, H, Tq, D], a view of a [B, Tq, H, D] buffer so that merging the
// heads back is free; the log-sum-exp of each query's scaled scores [B, H, Tq]).
std::pair<at::Tensor, at::Tensor> CpuAttentionForward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);

// (dq, dk, dv) from the forward's operands, its log-sum-exp and the output's
// gradient; each a view of a [B, T, H, D] buffer.
std::tuple<at::Tensor, at::Tensor, at::Tensor> CpuAttentionBackward(const at::Tensor& q, const at::Tensor& k,
                                                                    const at::Tensor& v, const at::Tensor& lse,
                                                                    const at::Tensor& grad_out);

}  // namespace internal
}  // namespace trident

#endif  // TRIDENT_KERNELS_INTERNAL_CAUSAL_ATTENTION_CPU_H_
