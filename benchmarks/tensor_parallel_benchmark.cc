// One gpt-tiny transformer block (n_embd 256, 4 heads) at tp = 1, 2 and 4:
// forward + backward time of a [16, 128, 256] activation and the bytes each
// rank communicates per forward + backward, with and without sequence
// parallelism, and sub-pipelined (tp_overlapping_level 1: inside each layer;
// 2: the block as two halves of the batch); one thread per rank.
//
//   bazel run -c opt //benchmarks:tensor_parallel_benchmark
#include <benchmark/benchmark.h>

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "models/models.h"
#include "testing/rank_workers.h"
#include "topology/topology.h"

namespace trident {
namespace {

constexpr int kWarmup = 2, kTimed = 10;

// One rank: times kTimed forward + backward passes of block 0; rank 0 reports
// "milliseconds bytes" per pass. args: {sequence_parallel 0|1, overlapping_level 0|1|2}.
absl::Status RunWorker(const std::vector<std::string>& args, std::string* result) {
  const bool sequence_parallel = args.at(0) == "1";
  const int overlapping_level = std::stoi(args.at(1));
  at::set_num_threads(1);
  TopologyOptions options;
  options.mesh_axes = {{"tensor", DeviceMesh::kInferSize}};
  TRIDENT_ASSIGN_OR_RETURN(auto topology, Topology::CreateFromEnvironment(options));
  const int tp = topology->world_size(), rank = topology->rank();
  TRIDENT_ASSIGN_OR_RETURN(ModelConfig config, PresetModelConfig("gpt", "gpt-tiny"));
  config.tp = {tp, rank, "tp", sequence_parallel && tp > 1, /*parallel_vocab=*/true, overlapping_level};
  TRIDENT_ASSIGN_OR_RETURN(auto block, CreateModelLayers(config, 1, 1, 2));
  const int64_t T = config.block_size / (config.tp.sequence_parallel ? tp : 1);
  at::Tensor x = at::randn({16, T, config.n_embd}).requires_grad_(true);
  double seconds = 0;
  int64_t bytes = 0;
  for (int i = 0; i < kWarmup + kTimed; ++i) {
    const int64_t sent = TensorParallelBytesCommunicated();
    const auto start = std::chrono::steady_clock::now();
    block->ForwardLayer(1, x).sum().backward();
    if (i >= kWarmup) {
      seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      bytes += TensorParallelBytesCommunicated() - sent;
    }
  }
  TRIDENT_RETURN_IF_ERROR(topology->world().Barrier());
  if (rank == 0) *result = absl::StrCat(1000 * seconds / kTimed, " ", bytes / kTimed);
  return absl::OkStatus();
}

void BM_TransformerBlock(benchmark::State& state) {
  const int tp = static_cast<int>(state.range(0));
  const bool sequence_parallel = state.range(1) != 0;
  const std::string overlapping_level = std::to_string(state.range(2));
  double ms = 0, bytes = 0;
  for (auto _ : state) {
    auto results = testing::RunRankWorkers(tp, {sequence_parallel ? "1" : "0", overlapping_level});
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
BENCHMARK(BM_TransformerBlock)
    ->Args({1, 0, 0})
    ->Args({2, 0, 0})
    ->Args({4, 0, 0})
    ->Args({2, 1, 0})
    ->Args({4, 1, 0})
    ->Args({2, 0, 1})
    ->Args({4, 0, 1})
    ->Args({2, 0, 2})
    ->Args({4, 0, 2})
    ->ArgNames({"tp", "sp", "overlap"})
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
