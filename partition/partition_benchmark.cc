// Time to trace a gpt2-350m-sized model (24 layers, width 1024) on a short
// sequence and to plan its stages, with both split methods.
//
//   bazel run -c opt //partition:partition_benchmark
#include <benchmark/benchmark.h>
#include <torch/torch.h>

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
BENCHMARK_CAPTURE(BM_PlanStages_Gpt2_350m, farthest_min_deps, "farthest_min_deps")
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_PlanStages_Gpt2_350m, nearest_min_deps, "nearest_min_deps")
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace trident
