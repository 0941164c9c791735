// Forward + backward time of each built-in replacement pair against the
// operators it replaces, at gpt-tiny's shapes (16 x 128 tokens, width 256, 4
// heads, vocabulary 256) and gpt2-124m's (1 x 1024 tokens, width 768, 12 heads,
// vocabulary 50257; one sequence keeps the unfused attention's scores at 48 MB).
//
//   bazel run -c opt //replace:replace_benchmark
//   (arguments: shape 0 = gpt-tiny, 1 = gpt2-124m; 0 = original, 1 = fused)
#include <cmath>
#include <limits>

#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include "base/memory_counter.h"
#include "kernels/kernels.h"
#include "replace/replace.h"

namespace trident {
namespace {

struct Shape {
  int64_t batch, tokens, width, heads, vocab;
};
constexpr Shape kShapes[] = {{16, 128, 256, 4, 256}, {1, 1024, 768, 12, 50257}};

// Runs forward + backward of `f` on leaves made from `inputs`, state.range(0)
// picking the shape, reporting tokens per second and the peak of tensor bytes
// a forward + backward allocates beyond its inputs (`peak_mb`).
template <typename Make, typename F>
void Run(benchmark::State& state, Make make, F f) {
  at::set_num_threads(1);
  MemoryCounter& memory = MemoryCounter::Install();
  const Shape& shape = kShapes[state.range(0)];
  torch::manual_seed(1);
  std::vector<at::Tensor> inputs = make(shape);
  for (at::Tensor& t : inputs) t.requires_grad_(true);
  int64_t peak = 0;
  for (auto _ : state) {
    for (at::Tensor& t : inputs) t.mutable_grad() = at::Tensor();
    memory.ResetPeak();
    const int64_t before = memory.live_bytes();
    f(inputs, shape).sum().backward();
    peak = memory.peak_bytes() - before;
  }
  state.SetItemsProcessed(state.iterations() * shape.batch * shape.tokens);
  state.counters["peak_mb"] = peak / 1e6;
}

void BM_Attention(benchmark::State& state) {
  const bool fused = state.range(1) == 1;
  Run(
      state,
      [](const Shape& s) {
        const int64_t d = s.width / s.heads;
        return std::vector<at::Tensor>{at::randn({s.batch, s.heads, s.tokens, d}),
                                       at::randn({s.batch, s.heads, s.tokens, d}),
                                       at::randn({s.batch, s.heads, s.tokens, d})};
      },
      [fused](const std::vector<at::Tensor>& in, const Shape& s) {
        if (fused) return FusedCausalAttention(in[0], in[1], in[2]);
        // The zoo's unfused path: one masked, scaled product, softmax, product.
        const int64_t t = s.tokens, bh = s.batch * s.heads, d = s.width / s.heads;
        at::Tensor mask = at::full({t, t}, -std::numeric_limits<double>::infinity()).triu(1);
        at::Tensor scores = at::baddbmm(mask.expand({bh, t, t}), in[0].reshape({bh, t, d}),
                                        in[1].reshape({bh, t, d}).transpose(1, 2), 1, 1.0 / std::sqrt(d));
        return at::bmm(at::softmax(scores, -1), in[2].reshape({bh, t, d}));
      });
}

void BM_AddLayerNorm(benchmark::State& state) {
  const bool fused = state.range(1) == 1;
  Run(
      state,
      [](const Shape& s) {
        return std::vector<at::Tensor>{at::randn({s.batch, s.tokens, s.width}), at::randn({s.batch, s.tokens, s.width}),
                                       at::ones({s.width}), at::zeros({s.width})};
      },
      [fused](const std::vector<at::Tensor>& in, const Shape& s) {
        if (fused) {
          auto [sum, out] = FusedAddLayerNorm(in[0], in[1], 1.0, {s.width}, in[2], in[3], 1e-5);
          return sum + out;
        }
        at::Tensor sum = in[0] + in[1];
        return sum + at::layer_norm(sum, {s.width}, in[2], in[3], 1e-5);
      });
}

void BM_BiasGelu(benchmark::State& state) {
  const bool fused = state.range(1) == 1;
  Run(
      state,
      [](const Shape& s) {
        return std::vector<at::Tensor>{at::randn({s.batch, s.tokens, 4 * s.width}), at::randn({4 * s.width})};
      },
      [fused](const std::vector<at::Tensor>& in, const Shape&) {
        return fused ? FusedBiasGelu(in[0], in[1]) : at::gelu(in[0] + in[1]);
      });
}

void BM_CrossEntropy(benchmark::State& state) {
  const bool fused = state.range(1) == 1;
  const Shape& shape = kShapes[state.range(0)];
  const at::Tensor targets = at::randint(shape.vocab, {shape.batch * shape.tokens}, at::kLong);
  Run(
      state,
      [](const Shape& s) {
        return std::vector<at::Tensor>{at::randn({s.batch * s.tokens, s.vocab})};
      },
      [fused, targets](const std::vector<at::Tensor>& in, const Shape&) {
        return fused ? FusedCrossEntropy(in[0], targets) : torch::nn::functional::cross_entropy(in[0], targets);
      });
}

BENCHMARK(BM_Attention)->ArgsProduct({{0, 1}, {0, 1}})->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AddLayerNorm)->ArgsProduct({{0, 1}, {0, 1}})->Unit(benchmark::kMillisecond);
BENCHMARK(BM_BiasGelu)->ArgsProduct({{0, 1}, {0, 1}})->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CrossEntropy)->ArgsProduct({{0, 1}, {0, 1}})->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace trident
