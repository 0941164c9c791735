// Tokens/s, step time and peak memory of gpt-tiny training: one rank, 2
// data-parallel ranks, 2 tensor-parallel ranks, 2 pipeline stages (1f1b, 4
// micro-batches), ZeRO stages 1 to 3 at dp = 2 and 4, and bf16 against fp32;
// each rank on one intra-op thread (so 2 ranks on 2 cores measure scaling; 4
// ranks oversubscribe them).
//
//   bazel run -c opt //benchmarks:train_step_benchmark
//
// Each benchmark run launches the ranks as processes of this binary (through
// the local launcher); they train warm-up steps, then time `kTimedSteps` steps,
// and rank 0 reports the mean step time back through a file.
#include <benchmark/benchmark.h>

#include <sys/resource.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include <ATen/Parallel.h>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "topology/topology.h"
#include "trainer/trainer.h"

namespace trident {
namespace {

constexpr int kWarmupSteps = 3;
constexpr int kTimedSteps = 20;
constexpr char kWorkerFlag[] = "--train_step_worker";

TrainerConfig BenchmarkConfig(int dp, int tp, int pp, int zero_stage, bool bf16) {
  TrainerConfig c;
  c.set_zero_stage(zero_stage);
  c.set_zero_reduce_bucket_size(1 << 20);
  if (bf16) c.set_precision("bf16");
  c.set_model("gpt");
  c.set_preset("gpt-tiny");  // n_layer 4, n_head 4, n_embd 256, block 128, vocab 256
  c.set_dp(dp);
  c.set_tp(tp);
  c.set_pp(pp);
  c.set_global_batch_size(16);
  c.set_micro_batch_size(pp > 1 ? 4 : 16 / dp);
  c.set_max_steps(kWarmupSteps + kTimedSteps);
  c.set_eval_every(0);
  c.set_eval_steps(1);
  c.set_sample_tokens(0);
  c.set_enable_progress_bar(false);
  c.set_log_every(1000);
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

absl::Status RunWorker(int tp, int pp, int zero_stage, bool bf16, const std::string& result_path) {
  TuneAllocatorForTraining();
  at::set_num_threads(1);
  TopologyOptions options;
  options.mesh_axes = {{"tensor", tp}, {"pipeline", pp}, {"data", DeviceMesh::kInferSize}};
  TRIDENT_ASSIGN_OR_RETURN(auto topology, Topology::CreateFromEnvironment(options));
  TRIDENT_ASSIGN_OR_RETURN(
      auto trainer,
      Trainer::Create(BenchmarkConfig(topology->world_size() / tp / pp, tp, pp, zero_stage, bf16),
                      topology.get()));
  auto timer = std::make_shared<StepTimer>();
  trainer->AddHooks(timer);
  TRIDENT_RETURN_IF_ERROR(trainer->Train().status());
  struct rusage usage;
  getrusage(RUSAGE_SELF, &usage);
  if (topology->rank() == 0) {
    std::ofstream(result_path) << timer->total_ms / kTimedSteps << " " << usage.ru_maxrss / 1024.0;
  }
  return absl::OkStatus();
}

void BM_TrainStep_GptTiny(benchmark::State& state) {
  const int dp = static_cast<int>(state.range(0)), tp = static_cast<int>(state.range(1));
  const int pp = static_cast<int>(state.range(2));
  const int zero_stage = static_cast<int>(state.range(3));
  const bool bf16 = state.range(4) != 0;
  const std::string result_path = absl::StrCat("/tmp/trident_train_step_", getpid(), ".txt");
  double step_ms = 0, peak_mb = 0;
  for (auto _ : state) {
    LaunchOptions launch;
    launch.nproc_per_node = dp * tp * pp;
    launch.command = {"/proc/self/exe", kWorkerFlag, std::to_string(tp), std::to_string(pp),
                      std::to_string(zero_stage), bf16 ? "1" : "0", result_path};
    launch.env["OMP_NUM_THREADS"] = "1";
    launch.env["OPENBLAS_NUM_THREADS"] = "1";
    launch.on_output = [](int, bool, absl::string_view) {};
    LaunchResult result = RunLocalGroup(launch);
    if (!result.status.ok()) {
      state.SkipWithError(std::string(result.status.message()).c_str());
      return;
    }
    std::ifstream(result_path) >> step_ms >> peak_mb;
    state.SetIterationTime(step_ms / 1000.0);
  }
  std::remove(result_path.c_str());
  state.counters["step_ms"] = step_ms;
  state.counters["peak_rss_mb_rank0"] = peak_mb;
  state.counters["tokens_per_s"] = benchmark::Counter(16.0 * 128 / (step_ms / 1000.0));
}
BENCHMARK(BM_TrainStep_GptTiny)
    ->Args({1, 1, 1, 0, 0})->Args({2, 1, 1, 0, 0})->Args({1, 2, 1, 0, 0})  // dp, tp scaling
    ->Args({1, 1, 2, 0, 0})                                                // pp
    ->Args({2, 1, 1, 1, 0})->Args({2, 1, 1, 2, 0})->Args({2, 1, 1, 3, 0})->Args({4, 1, 1, 0, 0})
    ->Args({4, 1, 1, 1, 0})->Args({4, 1, 1, 2, 0})->Args({4, 1, 1, 3, 0})  // ZeRO stages
    ->Args({1, 1, 1, 0, 1})                                                // bf16
    ->ArgNames({"dp", "tp", "pp", "zero", "bf16"})->UseManualTime()->Iterations(1)
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace trident

int main(int argc, char** argv) {
  if (argc == 7 && std::string(argv[1]) == trident::kWorkerFlag) {
    return trident::ExitCodeFor("train_step_worker",
                                trident::RunWorker(std::atoi(argv[2]), std::atoi(argv[3]), std::atoi(argv[4]),
                                                   std::string(argv[5]) == "1", argv[6]));
  }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  return 0;
}
