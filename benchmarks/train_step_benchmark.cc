// Tokens/s and step time of gpt-tiny training on one rank, on 2 data-parallel
// ranks and on 2 tensor-parallel ranks, each rank on one intra-op thread (so 2
// ranks on 2 cores measure scaling).
//
//   bazel run -c opt //benchmarks:train_step_benchmark
//
// Each benchmark run launches the ranks as processes of this binary (through
// the local launcher); they train warm-up steps, then time `kTimedSteps` steps,
// and rank 0 reports the mean step time back through a file.
#include <benchmark/benchmark.h>

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

TrainerConfig BenchmarkConfig(int dp, int tp) {
  TrainerConfig c;
  c.set_model("gpt");
  c.set_preset("gpt-tiny");  // n_layer 4, n_head 4, n_embd 256, block 128, vocab 256
  c.set_dp(dp);
  c.set_tp(tp);
  c.set_global_batch_size(16);
  c.set_micro_batch_size(16 / dp);
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

absl::Status RunWorker(int tp, const std::string& result_path) {
  TuneAllocatorForTraining();
  at::set_num_threads(1);
  TopologyOptions options;
  options.mesh_axes = {{"tensor", tp}, {"data", DeviceMesh::kInferSize}};
  TRIDENT_ASSIGN_OR_RETURN(auto topology, Topology::CreateFromEnvironment(options));
  TRIDENT_ASSIGN_OR_RETURN(
      auto trainer,
      Trainer::Create(BenchmarkConfig(topology->world_size() / tp, tp), topology.get()));
  auto timer = std::make_shared<StepTimer>();
  trainer->AddHooks(timer);
  TRIDENT_RETURN_IF_ERROR(trainer->Train().status());
  if (topology->rank() == 0) std::ofstream(result_path) << timer->total_ms / kTimedSteps;
  return absl::OkStatus();
}

void BM_TrainStep_GptTiny(benchmark::State& state) {
  const int dp = static_cast<int>(state.range(0)), tp = static_cast<int>(state.range(1));
  const std::string result_path = absl::StrCat("/tmp/trident_train_step_", getpid(), ".txt");
  double step_ms = 0;
  for (auto _ : state) {
    LaunchOptions launch;
    launch.nproc_per_node = dp * tp;
    launch.command = {"/proc/self/exe", kWorkerFlag, std::to_string(tp), result_path};
    launch.env["OMP_NUM_THREADS"] = "1";
    launch.env["OPENBLAS_NUM_THREADS"] = "1";
    launch.on_output = [](int, bool, absl::string_view) {};
    LaunchResult result = RunLocalGroup(launch);
    if (!result.status.ok()) {
      state.SkipWithError(std::string(result.status.message()).c_str());
      return;
    }
    std::ifstream(result_path) >> step_ms;
    state.SetIterationTime(step_ms / 1000.0);
  }
  std::remove(result_path.c_str());
  state.counters["step_ms"] = step_ms;
  state.counters["tokens_per_s"] = benchmark::Counter(16.0 * 128 / (step_ms / 1000.0));
}
BENCHMARK(BM_TrainStep_GptTiny)->Args({1, 1})->Args({2, 1})->Args({1, 2})->ArgNames({"dp", "tp"})
    ->UseManualTime()->Iterations(1)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace trident

int main(int argc, char** argv) {
  if (argc == 4 && std::string(argv[1]) == trident::kWorkerFlag) {
    return trident::ExitCodeFor("train_step_worker", trident::RunWorker(std::atoi(argv[2]), argv[3]));
  }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  return 0;
}
