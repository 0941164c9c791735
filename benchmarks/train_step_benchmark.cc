// Tokens/s, step time and peak memory of gpt-tiny training: one rank, 2
// data-parallel ranks, 2 tensor-parallel ranks, 2 pipeline stages (1f1b, 4
// micro-batches), ZeRO stages 1 to 3 at dp = 2 and 4, and bf16 against fp32;
// each rank on one intra-op thread (so 2 ranks on 2 cores measure scaling; 4
// ranks oversubscribe them).
//
//   bazel run -c opt //benchmarks:train_step_benchmark
//
// Each benchmark run launches the ranks as processes of this binary
// (testing/rank_workers.h); they train warm-up steps, then time `kTimedSteps`
// steps, and rank 0 reports the mean step time.
#include <benchmark/benchmark.h>

#include <sys/resource.h>

#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>

#include <ATen/Parallel.h>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "testing/rank_workers.h"
#include "topology/topology.h"
#include "trainer/trainer.h"

namespace trident {
namespace {

constexpr int kWarmupSteps = 3;
constexpr int kTimedSteps = 20;

TrainerConfig BenchmarkConfig(int dp, int tp, int pp, int zero_stage, bool bf16) {
  TrainerConfig c = DefaultTrainerConfig();
  c.mutable_plan()->mutable_zero()->set_stage(zero_stage);
  c.mutable_plan()->mutable_zero()->set_reduce_bucket_bytes(int64_t{4} << 20);  // 2^20 fp32 elements
  if (bf16) c.mutable_plan()->mutable_precision()->set_mode("bf16");
  c.mutable_model()->set_type("gpt");
  (*c.mutable_model()->mutable_args())["preset"] = "gpt-tiny";  // n_layer 4, n_head 4, n_embd 256, block 128, vocab 256
  c.mutable_plan()->set_dp(dp);
  c.mutable_plan()->set_tp(tp);
  c.mutable_plan()->set_pp(pp);
  c.mutable_loop()->set_global_batch_size(16);
  c.mutable_plan()->set_micro_batch_size(pp > 1 ? 4 : 16 / dp);
  c.mutable_loop()->set_max_steps(kWarmupSteps + kTimedSteps);
  c.mutable_loop()->set_eval_every(0);
  c.mutable_loop()->set_eval_steps(1);
  c.mutable_generation()->set_sample_tokens(0);
  c.mutable_output()->set_enable_progress_bar(false);
  c.mutable_output()->set_log_every(1000);
  return c;
}

// Mean step time (ms) of the timed steps, on every rank.
class StepTimer : public TrainerHooks {
 public:
  void OnStepEnd(const TrainerState&, const StepMetrics& m) override {
    if (m.step > kWarmupSteps) total_ms += m.step_time_ms;
  }
  double total_ms = 0;
};

// args: {tp, pp, zero_stage, bf16 0|1}; rank 0 reports "step_ms peak_rss_mb".
absl::Status RunWorker(const std::vector<std::string>& args, std::string* result) {
  const int tp = std::stoi(args.at(0)), pp = std::stoi(args.at(1)), zero_stage = std::stoi(args.at(2));
  const bool bf16 = args.at(3) == "1";
  TuneAllocatorForTraining();
  at::set_num_threads(1);
  TopologyOptions options;
  options.mesh_axes = {{"tensor", tp}, {"pipeline", pp}, {"data", DeviceMesh::kInferSize}};
  TRIDENT_ASSIGN_OR_RETURN(auto topology, Topology::CreateFromEnvironment(options));
  TRIDENT_ASSIGN_OR_RETURN(
      auto trainer,
      Trainer::Create(BenchmarkConfig(topology->world_size() / tp / pp, tp, pp, zero_stage, bf16), topology.get()));
  auto timer = std::make_shared<StepTimer>();
  trainer->AddHooks(timer);
  TRIDENT_RETURN_IF_ERROR(trainer->Train().status());
  struct rusage usage;
  getrusage(RUSAGE_SELF, &usage);
  if (topology->rank() == 0) *result = absl::StrCat(timer->total_ms / kTimedSteps, " ", usage.ru_maxrss / 1024.0);
  return absl::OkStatus();
}

void BM_TrainStep_GptTiny(benchmark::State& state) {
  const int dp = static_cast<int>(state.range(0)), tp = static_cast<int>(state.range(1));
  const int pp = static_cast<int>(state.range(2));
  const int zero_stage = static_cast<int>(state.range(3));
  const bool bf16 = state.range(4) != 0;
  double step_ms = 0, peak_mb = 0;
  for (auto _ : state) {
    auto results = testing::RunRankWorkers(
        dp * tp * pp, {std::to_string(tp), std::to_string(pp), std::to_string(zero_stage), bf16 ? "1" : "0"});
    if (!results.ok()) {
      state.SkipWithError(std::string(results.status().message()).c_str());
      return;
    }
    std::istringstream((*results)[0]) >> step_ms >> peak_mb;
    state.SetIterationTime(step_ms / 1000.0);
  }
  state.counters["step_ms"] = step_ms;
  state.counters["peak_rss_mb_rank0"] = peak_mb;
  state.counters["tokens_per_s"] = benchmark::Counter(16.0 * 128 / (step_ms / 1000.0));
}
BENCHMARK(BM_TrainStep_GptTiny)
    ->Args({1, 1, 1, 0, 0})
    ->Args({2, 1, 1, 0, 0})
    ->Args({1, 2, 1, 0, 0})  // dp, tp scaling
    ->Args({1, 1, 2, 0, 0})  // pp
    ->Args({2, 1, 1, 1, 0})
    ->Args({2, 1, 1, 2, 0})
    ->Args({2, 1, 1, 3, 0})
    ->Args({4, 1, 1, 0, 0})
    ->Args({4, 1, 1, 1, 0})
    ->Args({4, 1, 1, 2, 0})
    ->Args({4, 1, 1, 3, 0})  // ZeRO stages
    ->Args({1, 1, 1, 0, 1})  // bf16
    ->ArgNames({"dp", "tp", "pp", "zero", "bf16"})
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
