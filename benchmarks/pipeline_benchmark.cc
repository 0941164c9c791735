// Step time and measured bubble of each schedule for gpt-tiny (4 blocks, 6
// layers) at pp = 2 and 4 (interleaved: pp = 2 with 2 chunks per rank), M = 8
// micro-batches of 2 x 128 tokens, one thread per rank; and
// the step time the simulator predicts from the measured stage times
// (`vs_simulated` near 1 means communication overlaps as modelled) and from
// the measured time of every forward and backward (`vs_replayed`: the
// runtime's own cost, messages and the instructions between computations;
// it differs from `vs_simulated` where micro-batch or chunk times differ
// from the stage means), and the
// first stage's peak of CPU tensor bytes over the step (`peak_mb`; the
// `_dealloc` runs free each sent activation's values: dealloc_pipeoutput).
// Each figure is the median over the timed steps (the first step is a
// warm-up), each step's ratio taken against its own stage times.
//
//   bazel run -c opt //benchmarks:pipeline_benchmark
#include <benchmark/benchmark.h>

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "base/memory_counter.h"
#include "base/status.h"
#include "models/models.h"
#include "partition/partition.h"
#include "pipeline/stage_runner.h"
#include "testing/rank_workers.h"

namespace trident {
namespace {

constexpr int kMicroBatches = 8, kSteps = 6;

// Model chunks per rank for a schedule.
int Chunks(const std::string& schedule) { return schedule == "interleaved_1f1b" ? 2 : 1; }

// One rank: runs kSteps steps and reports, for each but the first, a line
// "step_seconds forward_seconds backward_seconds compute_seconds
// weight_grad_seconds peak_bytes n" and n compute instructions "op
// micro_batch chunk seconds". args: {schedule, "dealloc" or "keep"}.
absl::Status RunWorker(const std::vector<std::string>& args, std::string* result) {
  const std::string& schedule_name = args.at(0);
  at::set_num_threads(1);
  MemoryCounter& memory = MemoryCounter::Install();
  TRIDENT_ASSIGN_OR_RETURN(auto env, DistributedEnvFromEnvironment());
  TopologyOptions options;
  options.mesh_axes = {{"pipeline", env.world_size}};
  TRIDENT_ASSIGN_OR_RETURN(auto topology, Topology::Create(env, options));
  const ProcessGroup& pipeline = **topology->Group("pp");
  ModelConfig config = *PresetModelConfig("gpt", "gpt-tiny");
  const int stages = pipeline.size(), stage = pipeline.rank(), chunks = Chunks(schedule_name);
  TRIDENT_ASSIGN_OR_RETURN(auto bounds,
                           PartitionLayers("uniform", std::vector<double>(config.n_layer + 2, 1.0), stages * chunks));
  StageRunnerOptions runner_options;
  runner_options.dealloc_sent_outputs = args.at(1) == "dealloc";
  LayerRanges ranges;
  for (int c = 0; c < chunks; ++c) {
    const int v = c * stages + stage;
    runner_options.chunks.push_back({bounds[v], bounds[v + 1]});
    ranges.emplace_back(bounds[v], bounds[v + 1]);
  }
  TRIDENT_ASSIGN_OR_RETURN(auto part, CreateModelLayers(config, 1, ranges));
  TRIDENT_ASSIGN_OR_RETURN(auto schedule, MakeSchedule(schedule_name, chunks));
  auto tokens = torch::randint(config.vocab_size, {2 * kMicroBatches, config.block_size}, torch::kLong);
  std::vector<Batch> batches;
  for (const at::Tensor& micro : tokens.chunk(kMicroBatches)) batches.push_back({micro, micro});
  TRIDENT_RETURN_IF_ERROR(ForwardThroughStages(*part, runner_options.chunks, &pipeline, batches[0]).status());
  PipelineStageRunner runner(*part, &pipeline, *schedule, runner_options);
  for (int step = 0; step < kSteps; ++step) {
    for (auto& p : part->parameters()) p.mutable_grad() = at::Tensor();
    memory.ResetPeak();
    const int64_t before = memory.live_bytes();
    TRIDENT_RETURN_IF_ERROR(runner.RunStep(batches, {}).status());
    if (step == 0) continue;
    double end = 0, forward = 0, backward = 0, weight = 0;
    std::string computed;
    int computes = 0;
    for (const TimelineEvent& e : runner.timeline()) {
      end = std::max(end, e.end);
      if (e.op == Op::kForward) forward += e.end - e.start;
      if (e.op == Op::kBackward || e.op == Op::kBackwardInput) backward += e.end - e.start;
      if (e.op == Op::kBackwardWeight) weight += e.end - e.start;
      if (e.op == Op::kForward || e.op == Op::kBackward || e.op == Op::kBackwardInput || e.op == Op::kBackwardWeight) {
        absl::StrAppend(&computed, " ", static_cast<int>(e.op), " ", e.micro_batch, " ", e.chunk, " ", e.end - e.start);
        ++computes;
      }
    }
    absl::StrAppend(result, end, " ", forward / kMicroBatches, " ", (backward + weight) / kMicroBatches, " ",
                    forward + backward + weight, " ", weight / kMicroBatches, " ", memory.peak_bytes() - before, " ",
                    computes, computed, "\n");
  }
  return absl::OkStatus();
}

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

void BM_PipelineStep(benchmark::State& state, const char* schedule, bool dealloc = false) {
  const int stages = static_cast<int>(state.range(0));
  const auto schedule_object = *MakeSchedule(schedule, Chunks(schedule));
  std::vector<double> steps, bubbles, ratios, replay_ratios, first_stage_peaks;
  for (auto _ : state) {
    auto results = testing::RunRankWorkers(stages, {schedule, dealloc ? "dealloc" : "keep"});
    if (!results.ok()) {
      state.SkipWithError(std::string(results.status().message()).c_str());
      return;
    }
    std::vector<std::istringstream> ranks;
    for (int s = 0; s < stages; ++s) ranks.emplace_back((*results)[s]);
    for (int timed = 1; timed < kSteps; ++timed) {
      double step = 0, compute = 0;
      // The simulator's stage times are per rank: for C chunks, summed over them.
      SimulationOptions simulated, replayed;
      simulated.num_stages = stages;
      simulated.num_micro_batches = kMicroBatches;
      simulated.forward_seconds.clear();
      simulated.backward_seconds.clear();
      simulated.weight_grad_fraction = 0;
      for (int s = 0; s < stages; ++s) {
        double end, forward, backward, busy, weight, peak;
        int computes;
        ranks[s] >> end >> forward >> backward >> busy >> weight >> peak >> computes;
        for (int i = 0; i < computes; ++i) {
          int op;
          TimelineEvent e;
          ranks[s] >> op >> e.micro_batch >> e.chunk >> e.end;
          e.stage = s;
          e.op = static_cast<Op>(op);
          replayed.replay.push_back(e);
        }
        if (s == 0) first_stage_peaks.push_back(peak);
        step = std::max(step, end);
        compute += busy;
        simulated.weight_grad_fraction += weight / backward / stages;
        simulated.forward_seconds.push_back(forward);
        simulated.backward_seconds.push_back(backward);
      }
      replayed.num_stages = stages;
      replayed.num_micro_batches = kMicroBatches;
      auto prediction = Simulate(*schedule_object, simulated);
      auto replay = Simulate(*schedule_object, replayed);
      if (!prediction.ok() || !replay.ok()) {
        state.SkipWithError(std::string((prediction.ok() ? replay.status() : prediction.status()).message()).c_str());
        return;
      }
      steps.push_back(step);
      bubbles.push_back(1.0 - compute / (stages * step));
      ratios.push_back(step / prediction->makespan);
      replay_ratios.push_back(step / replay->makespan);
    }
    state.SetIterationTime(Median(steps));
  }
  state.counters["step_ms"] = 1000 * Median(steps);
  state.counters["bubble"] = Median(bubbles);
  state.counters["peak_mb"] = Median(first_stage_peaks) / 1e6;
  state.counters["vs_simulated"] = Median(ratios);
  state.counters["vs_replayed"] = Median(replay_ratios);
}
BENCHMARK_CAPTURE(BM_PipelineStep, gpipe, "gpipe")
    ->Arg(2)
    ->Arg(4)
    ->ArgName("pp")
    ->UseManualTime()
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_PipelineStep, gpipe_dealloc, "gpipe", true)
    ->Arg(2)
    ->Arg(4)
    ->ArgName("pp")
    ->UseManualTime()
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_PipelineStep, one_f_one_b_dealloc, "1f1b", true)
    ->Arg(2)
    ->ArgName("pp")
    ->UseManualTime()
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_PipelineStep, one_f_one_b, "1f1b")
    ->Arg(2)
    ->Arg(4)
    ->ArgName("pp")
    ->UseManualTime()
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_PipelineStep, zb_h1, "zb_h1")
    ->Arg(2)
    ->Arg(4)
    ->ArgName("pp")
    ->UseManualTime()
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_PipelineStep, interleaved_1f1b, "interleaved_1f1b")
    ->Arg(2)
    ->ArgName("pp")
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
