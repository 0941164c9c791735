// Time to trace a gpt2-350m-sized model (24 layers, width 1024) on a short
// sequence and to plan its stages, with both split methods.
//
//   bazel run -c opt //benchmarks:partition_benchmark
#include <benchmark/benchmark.h>

#include <torch/torch.h>
#include <algorithm>
#include <chrono>

#include "models/models.h"
#include "partition/partition.h"

namespace trident {
namespace {

std::shared_ptr<LanguageModel> Gpt350m() {
  static auto model = *CreateModel(*PresetModelConfig("gpt", "gpt2-350m"), 1);
  return model;
}

std::unique_ptr<ModelGraph> Trace(LanguageModel& model) {
  auto tokens = torch::randint(256, {1, 64}, torch::kLong);
  return *ModelGraph::Trace(model, {tokens, tokens}, [&](const std::vector<at::Tensor>& in) {
    return std::vector<at::Tensor>{model.Loss(in[0], in[1])};
  });
}

void BM_Trace_Gpt2_350m(benchmark::State& state) {
  auto model = Gpt350m();
  for (auto _ : state) benchmark::DoNotOptimize(Trace(*model));
}
BENCHMARK(BM_Trace_Gpt2_350m)->Unit(benchmark::kMillisecond);

void BM_PlanStages_Gpt2_350m(benchmark::State& state, const char* split_method) {
  auto graph = Trace(*Gpt350m());
  GraphPartitionOptions options;
  options.split_method = split_method;
  options.shard_count = 2 * 24 + 4;
  options.num_stages = 8;
  options.partition_method = "parameters";
  for (auto _ : state) benchmark::DoNotOptimize(*PlanGraphStages(*graph, options));
  state.counters["nodes"] = static_cast<double>(graph->nodes().size());
}
BENCHMARK_CAPTURE(BM_PlanStages_Gpt2_350m, farthest_min_deps, "farthest_min_deps")->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_PlanStages_Gpt2_350m, nearest_min_deps, "nearest_min_deps")->Unit(benchmark::kMillisecond);

// Plans 4 stages of a 12-layer gpt-tiny by measured layer times (cost), then
// times each stage: `imbalance` is the slowest stage's time over the mean.
void BM_CostBalance_Gpt12Layers(benchmark::State& state) {
  ModelConfig config = *PresetModelConfig("gpt", "gpt-tiny");
  config.n_layer = 12;
  auto model = *CreateModel(config, 1);
  auto tokens = torch::randint(256, {4, 128}, torch::kLong);
  auto profile = *ProfileLayers(*model, {tokens});
  PartitionOptions options;
  options.num_stages = 4;
  options.partition_method = "cost";
  options.cost_source = "measured";
  Plan plan = *PlanStages(profile, options);
  double imbalance = 0;
  torch::NoGradGuard no_grad;
  for (auto _ : state) {
    std::vector<double> seconds;
    at::Tensor x = tokens;
    for (const StagePlan& stage : plan.stages()) {
      std::vector<double> runs;
      at::Tensor out;
      for (int run = 0; run < 5; ++run) {
        const auto start = std::chrono::steady_clock::now();
        out = x;
        for (int64_t i = stage.first_layer(); i < stage.end_layer(); ++i) out = model->ForwardLayer(i, out);
        runs.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      }
      std::sort(runs.begin(), runs.end());
      seconds.push_back(runs[2]);
      x = out;
    }
    double total = 0, slowest = 0;
    for (double s : seconds) {
      total += s;
      slowest = std::max(slowest, s);
    }
    imbalance = slowest / (total / seconds.size());
  }
  state.counters["imbalance"] = imbalance;
}
BENCHMARK(BM_CostBalance_Gpt12Layers)->Iterations(1)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace trident
