#include "kernels/internal/causal_attention_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "kernels/internal/vector_math.h"
#include "kernels/kernels.h"

namespace trident {
namespace internal {
namespace {

// Query rows per tile: each tile multiplies against the keys up to its last
// query, so with T = 128 the products cover 75% of the full T x T scores.
// In the perf configuration's step (T 128, D 64), attention forward and
// backward took 10.5-10.8 ms with 64 rows, 11.6 with 32, 12.3 with 128 and
// 15 with 16.
constexpr int64_t kTileRows = 64;

// ---- row loops (internal/vector_math.h) ----

using namespace vector_math;  // NOLINT: the vector helpers

TRIDENT_VECTOR_CLONES float RowMax(const float* row, int64_t n) {
  Floats best = Splat(-INFINITY);
  for (int64_t j = 0; j < n; j += kLanes) {
    const Floats x = Inside(j, n) ? Load(row + j) : Splat(-INFINITY);  // rows have kLanes floats to spare
    best = x > best ? x : best;
  }
  float max = -INFINITY;
  for (int64_t i = 0; i < kLanes; ++i) max = std::max(max, best[i]);
  return max;
}

// row[j] = exp(row[j] - shift) for j < n (every row[j] <= shift); returns their sum.
TRIDENT_VECTOR_CLONES float ExpRow(float* row, int64_t n, float shift) {
  Floats sum{};
  for (int64_t j = 0; j < n; j += kLanes) {
    const Ints inside = Inside(j, n);
    const Floats x = Load(row + j) - shift;
    const Floats e = Exp(inside ? x : Splat(0));
    StoreInside(row + j, e, inside);
    sum += inside ? e : Splat(0);
  }
  return Sum(sum);
}

TRIDENT_VECTOR_CLONES void ScaleRow(float* row, int64_t n, float factor) {
  for (int64_t j = 0; j < n; j += kLanes) StoreInside(row + j, Load(row + j) * factor, Inside(j, n));
}

// Softmax backward of one row: grad[j] = scale p[j] (grad[j] - sum_i p[i] grad[i]).
TRIDENT_VECTOR_CLONES void SoftmaxGradRow(const float* p, float* grad, int64_t n, float scale) {
  Floats sums{};
  for (int64_t j = 0; j < n; j += kLanes) sums += Inside(j, n) ? Load(p + j) * Load(grad + j) : Splat(0);
  const float dot = Sum(sums);
  for (int64_t j = 0; j < n; j += kLanes) {
    StoreInside(grad + j, Load(p + j) * (Load(grad + j) - dot) * scale, Inside(j, n));
  }
}

// ---- tiles ----

// A [B, H, T, D] tensor read as B * H row-major [T, D] matrices.
struct Heads {
  explicit Heads(const at::Tensor& t)
      : data(t.data_ptr<float>()),
        heads(t.size(1)),
        batch_stride(t.stride(0)),
        head_stride(t.stride(1)),
        ld(t.size(2) == 1 ? t.size(3) : t.stride(2)) {}
  float* Item(int64_t item) const { return data + (item / heads) * batch_stride + (item % heads) * head_stride; }
  float* data;
  int64_t heads, batch_stride, head_stride, ld;
};

// t, or a copy when its rows are not row-major matrices sgemm can read.
at::Tensor RowMajor(const at::Tensor& t) {
  const bool rows = (t.stride(3) == 1 || t.size(3) == 1) && (t.size(2) == 1 || t.stride(2) >= t.size(3));
  return rows && t.stride(0) >= 0 && t.stride(1) >= 0 ? t : t.contiguous();
}

// An uninitialised [B, T, H, D] buffer seen as [B, H, T, D] (or zeros).
at::Tensor HeadsLast(const at::Tensor& like, int64_t tokens, bool zero) {
  const std::vector<int64_t> shape = {like.size(0), tokens, like.size(1), like.size(3)};
  return (zero ? at::zeros(shape, like.options()) : at::empty(shape, like.options())).permute({0, 2, 1, 3});
}

void Gemm(char ta, char tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda, const float* b,
          int64_t ldb, float beta, float* c, int64_t ldc) {
  const int status = OneDnnSgemm()(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  TORCH_CHECK(status == 0, "causal attention: oneDNN's sgemm failed with status ", status, " (m ", m, ", n ", n, ", k ",
              k, ")");
}

// The shape every kernel runs over: tiles of query rows, each seeing the keys
// up to its last query.
struct Tiles {
  Tiles(const at::Tensor& q, const at::Tensor& k)
      : items(q.size(0) * q.size(1)),
        queries(q.size(2)),
        keys(k.size(2)),
        dim(q.size(3)),
        offset(keys - queries),
        scale(1.0f / std::sqrt(static_cast<float>(dim))) {}
  // Calls body(first query, rows, keys the tile sees) for each tile.
  template <typename Body>
  void ForEach(Body body) const {
    for (int64_t first = 0; first < queries; first += kTileRows) {
      const int64_t rows = std::min(kTileRows, queries - first);
      body(first, rows, offset + first + rows);
    }
  }
  // Keys query `row` of the tile starting at `first` sees.
  int64_t Visible(int64_t first, int64_t row) const { return offset + first + row + 1; }
  int64_t items, queries, keys, dim, offset;
  float scale;
};

}  // namespace

void CheckAttentionShapes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && k.size(0) == q.size(0) && k.size(1) == q.size(1) &&
                  k.size(3) == q.size(3) && k.size(2) >= q.size(2) && v.sizes() == k.sizes(),
              "causal_attention: q [B, H, Tq, D] and k, v [B, H, Tk, D] with Tk >= Tq; got q ", q.sizes(), ", k ",
              k.sizes(), " and v ", v.sizes());
}

bool CpuAttentionTakes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  for (const at::Tensor* t : {&q, &k, &v}) {
    if (!t->is_cpu() || t->scalar_type() != at::kFloat || t->dim() != 4 || t->numel() == 0) return false;
  }
  return OneDnnSgemm() != nullptr;
}

std::pair<at::Tensor, at::Tensor> CpuAttentionForward(const at::Tensor& q_in, const at::Tensor& k_in,
                                                      const at::Tensor& v_in) {
  const at::Tensor q = RowMajor(q_in), k = RowMajor(k_in), v = RowMajor(v_in);
  const Tiles tiles(q, k);
  at::Tensor out = HeadsLast(q, tiles.queries, /*zero=*/false);
  at::Tensor lse = at::empty({q.size(0), q.size(1), tiles.queries}, q.options());
  const Heads qh(q), kh(k), vh(v), oh(out);
  float* lse_data = lse.data_ptr<float>();
  at::parallel_for(0, tiles.items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> probs(kTileRows * tiles.keys + kLanes);
    for (int64_t item = begin; item < end; ++item) {
      const float *Q = qh.Item(item), *K = kh.Item(item), *V = vh.Item(item);
      float* O = oh.Item(item);
      float* L = lse_data + item * tiles.queries;
      tiles.ForEach([&](int64_t first, int64_t rows, int64_t seen) {
        Gemm('N', 'T', rows, seen, tiles.dim, tiles.scale, Q + first * qh.ld, qh.ld, K, kh.ld, 0, probs.data(), seen);
        for (int64_t r = 0; r < rows; ++r) {
          float* row = probs.data() + r * seen;
          const int64_t visible = tiles.Visible(first, r);
          const float max = RowMax(row, visible), sum = ExpRow(row, visible, max);
          ScaleRow(row, visible, 1 / sum);
          std::fill(row + visible, row + seen, 0.0f);
          L[first + r] = max + std::log(sum);
        }
        Gemm('N', 'N', rows, tiles.dim, seen, 1, probs.data(), seen, V, vh.ld, 0, O + first * oh.ld, oh.ld);
      });
    }
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> CpuAttentionBackward(const at::Tensor& q_in, const at::Tensor& k_in,
                                                                    const at::Tensor& v_in, const at::Tensor& lse,
                                                                    const at::Tensor& grad_out) {
  const at::Tensor q = RowMajor(q_in), k = RowMajor(k_in), v = RowMajor(v_in), go = RowMajor(grad_out);
  const Tiles tiles(q, k);
  at::Tensor dq = HeadsLast(q, tiles.queries, /*zero=*/false);
  at::Tensor dk = HeadsLast(k, tiles.keys, /*zero=*/true), dv = HeadsLast(v, tiles.keys, /*zero=*/true);
  const Heads qh(q), kh(k), vh(v), goh(go), dqh(dq), dkh(dk), dvh(dv);
  const at::Tensor lse_rows = lse.contiguous();
  const float* lse_data = lse_rows.data_ptr<float>();
  at::parallel_for(0, tiles.items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> probs(kTileRows * tiles.keys + kLanes), grads(kTileRows * tiles.keys + kLanes);
    for (int64_t item = begin; item < end; ++item) {
      const float *Q = qh.Item(item), *K = kh.Item(item), *V = vh.Item(item), *dO = goh.Item(item);
      float *dQ = dqh.Item(item), *dK = dkh.Item(item), *dV = dvh.Item(item);
      const float* L = lse_data + item * tiles.queries;
      tiles.ForEach([&](int64_t first, int64_t rows, int64_t seen) {
        // The tile's probabilities again: exp(scale q k^T - lse), divided by
        // their sum. Rounding in lse scales a whole row by one factor; without
        // the division, rowsum(dS) = rowsum(P dP) (1 - rowsum(P)) would carry
        // it into every gradient that should be zero (a key bias's), which
        // AdamW would then turn into full-sized steps.
        Gemm('N', 'T', rows, seen, tiles.dim, tiles.scale, Q + first * qh.ld, qh.ld, K, kh.ld, 0, probs.data(), seen);
        for (int64_t r = 0; r < rows; ++r) {
          float* row = probs.data() + r * seen;
          const int64_t visible = tiles.Visible(first, r);
          ScaleRow(row, visible, 1 / ExpRow(row, visible, L[first + r]));
          std::fill(row + visible, row + seen, 0.0f);
        }
        const float* dO_tile = dO + first * goh.ld;
        Gemm('T', 'N', seen, tiles.dim, rows, 1, probs.data(), seen, dO_tile, goh.ld, 1, dV, dvh.ld);  // dv += P^T dO
        Gemm('N', 'T', rows, seen, tiles.dim, 1, dO_tile, goh.ld, V, vh.ld, 0, grads.data(), seen);    // dP = dO v^T
        for (int64_t r = 0; r < rows; ++r) {  // dS = scale P (dP - rowsum(P dP)), zero where masked
          SoftmaxGradRow(probs.data() + r * seen, grads.data() + r * seen, seen, tiles.scale);
        }
        Gemm('N', 'N', rows, tiles.dim, seen, 1, grads.data(), seen, K, kh.ld, 0, dQ + first * dqh.ld, dqh.ld);
        Gemm('T', 'N', seen, tiles.dim, rows, 1, grads.data(), seen, Q + first * qh.ld, qh.ld, 1, dK, dkh.ld);
      });
    }
  });
  return {dq, dk, dv};
}

}  // namespace internal
}  // namespace trident
