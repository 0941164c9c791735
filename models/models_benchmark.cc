// Forward and forward+backward time of the zoo's tiny presets on one thread,
// batch 16 x 128 tokens.
//
//   bazel run -c opt //models:models_benchmark
#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include "models/models.h"

namespace trident {
namespace {

std::shared_ptr<LanguageModel> Tiny(const char* model, const char* preset) {
  return *CreateModel(*PresetModelConfig(model, preset), 1);
}

void Run(benchmark::State& state, const char* model, const char* preset, bool backward) {
  at::set_num_threads(1);
  auto m = Tiny(model, preset);
  auto tokens = torch::randint(256, {16, 128}, torch::kLong);
  auto targets = torch::randint(256, {16, 128}, torch::kLong);
  for (auto _ : state) {
    if (backward) {
      m->zero_grad();
      m->Loss(tokens, targets).backward();
    } else {
      torch::NoGradGuard no_grad;
      benchmark::DoNotOptimize(m->Loss(tokens, targets));
    }
  }
  state.SetItemsProcessed(state.iterations() * 16 * 128);  // tokens
}

void BM_Gpt_Forward(benchmark::State& s) { Run(s, "gpt", "gpt-tiny", false); }
void BM_Gpt_ForwardBackward(benchmark::State& s) { Run(s, "gpt", "gpt-tiny", true); }
void BM_Llama_ForwardBackward(benchmark::State& s) { Run(s, "llama", "llama-tiny", true); }
BENCHMARK(BM_Gpt_Forward)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Gpt_ForwardBackward)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Llama_ForwardBackward)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace trident
