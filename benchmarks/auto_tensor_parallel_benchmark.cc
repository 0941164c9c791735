// The automatic tensor-parallel plan against the zoo's hand plan on the whole
// gpt-tiny model (4 blocks, n_embd 256, 4 heads, vocabulary 256; micro-batch
// [16, 128]): forward + backward time (median of 10) and the bytes each rank
// communicates per pass, at tp = 2 and 4, with and without sequence
// parallelism; one thread per rank. The automatic plan is the single-process
// module traced and rewritten by AutoTensorParallel (split regardless of the
// cost model, as the hand plan is); the hand plan is the zoo's model built
// tensor-parallel, run eagerly.
//
//   bazel run -c opt //benchmarks:auto_tensor_parallel_benchmark
#include <benchmark/benchmark.h>

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "graph/model_graph.h"
#include "models/models.h"
#include "tensor_parallel/tensor_parallel.h"
#include "testing/rank_workers.h"
#include "topology/topology.h"

namespace trident {
namespace {

constexpr int kWarmup = 3, kTimed = 10;

// One rank: times forward + backward of the whole model; rank 0 reports
// "milliseconds bytes" per pass. args: {"hand" | "auto", sequence_parallel 0|1}.
absl::Status RunWorker(const std::vector<std::string>& args, std::string* result) {
  const bool automatic = args.at(0) == "auto", sequence_parallel = args.at(1) == "1";
  at::set_num_threads(1);
  TopologyOptions options;
  options.mesh_axes = {{"tensor", DeviceMesh::kInferSize}};
  TRIDENT_ASSIGN_OR_RETURN(auto topology, Topology::CreateFromEnvironment(options));
  const int tp = topology->world_size(), rank = topology->rank();
  TRIDENT_ASSIGN_OR_RETURN(ModelConfig config, PresetModelConfig("gpt", "gpt-tiny"));
  torch::manual_seed(1);
  const at::Tensor tokens = torch::randint(config.vocab_size, {16, config.block_size}, torch::kLong);
  const at::Tensor targets = torch::randint(config.vocab_size, {16, config.block_size}, torch::kLong);
  const TensorParallelism parallelism{tp, rank, "tp", sequence_parallel};
  std::function<at::Tensor()> loss;
  std::shared_ptr<LanguageModel> model;
  std::unique_ptr<ModelGraph> part;
  if (automatic) {
    TRIDENT_ASSIGN_OR_RETURN(model, CreateModel(config, 1));
    TRIDENT_ASSIGN_OR_RETURN(auto whole,
                             ModelGraph::Trace(*model, {tokens, targets}, [&](const std::vector<at::Tensor>& in) {
                               return std::vector<at::Tensor>{model->Loss(in[0], in[1])};
                             }));
    TRIDENT_ASSIGN_OR_RETURN(TensorParallelGraph sharded, AutoTensorParallel(*whole, parallelism));
    TRIDENT_ASSIGN_OR_RETURN(part, ModelGraph::Trace(sharded.parameters, {tokens, targets}, sharded.forward));
    loss = [&] { return (*part->Run({tokens, targets}))[0]; };
  } else {
    config.tp = parallelism;
    TRIDENT_ASSIGN_OR_RETURN(model, CreateModel(config, 1));
    loss = [&] { return model->Loss(tokens, targets); };
  }
  std::vector<double> milliseconds;
  int64_t bytes = 0;
  for (int i = 0; i < kWarmup + kTimed; ++i) {
    TRIDENT_RETURN_IF_ERROR(topology->world().Barrier());
    const int64_t sent = TensorParallelBytesCommunicated();
    const auto start = std::chrono::steady_clock::now();
    loss().backward();
    if (i >= kWarmup) {
      milliseconds.push_back(1e3 * std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      bytes += TensorParallelBytesCommunicated() - sent;
    }
  }
  std::sort(milliseconds.begin(), milliseconds.end());
  if (rank == 0) *result = absl::StrCat(milliseconds[kTimed / 2], " ", bytes / kTimed);
  return absl::OkStatus();
}

void BM_WholeGpt(benchmark::State& state, const std::string& plan) {
  const int tp = static_cast<int>(state.range(0));
  const bool sequence_parallel = state.range(1) != 0;
  double ms = 0, bytes = 0;
  for (auto _ : state) {
    auto results = testing::RunRankWorkers(tp, {plan, sequence_parallel ? "1" : "0"});
    if (!results.ok()) {
      state.SkipWithError(std::string(results.status().message()).c_str());
      return;
    }
    std::istringstream((*results)[0]) >> ms >> bytes;
    state.SetIterationTime(ms / 1000);
  }
  state.counters["fwd_bwd_ms"] = ms;
  state.counters["bytes_per_rank"] = bytes;
}
void BM_HandPlan(benchmark::State& state) { BM_WholeGpt(state, "hand"); }
void BM_AutomaticPlan(benchmark::State& state) { BM_WholeGpt(state, "auto"); }
BENCHMARK(BM_HandPlan)
    ->Args({2, 0})
    ->Args({2, 1})
    ->Args({4, 0})
    ->ArgNames({"tp", "sp"})
    ->UseManualTime()
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AutomaticPlan)
    ->Args({2, 0})
    ->Args({2, 1})
    ->Args({4, 0})
    ->ArgNames({"tp", "sp"})
    ->UseManualTime()
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace trident

int main(int argc, char** argv) {
  if (auto code = trident::testing::RunIfRankWorker(argc, argv, trident::RunWorker)) return *code;
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  return 0;
}
