// How well the automatic strategy search's models predict: for hand-picked
// layouts of a zoo model (dp, tp, sequence parallelism, pp with 1f1b, zb_h1 and interleaving, ZeRO
// 1-3, recomputation, micro-batch sizes) the predicted per-rank state bytes,
// peak tensor memory and step time against what training them measures on
// the same ranks (each layout measured in 3 rounds over all layouts, the
// median kept, so a slow spell of the machine does not land on one layout);
// and the Spearman correlation of predicted and measured
// step times (how well the model ranks layouts).
//
//   bazel run -c opt //benchmarks:strategy_models_benchmark -- gpt gpt-tiny 2
//   bazel run -c opt //benchmarks:strategy_models_benchmark -- llama llama-tiny 4
//
// The ranks run as processes of this binary (testing/rank_workers.h), one
// thread each, on random tokens (global batch 16, 128 tokens). Each layout
// trains 1 warm-up and 5 measured steps per round; memory is the peak of the bytes
// LibTorch's CPU tensors hold during those steps (base/memory_counter.h),
// the largest over ranks. STRATEGY_MODELS_DETAIL=FILE appends each layout's
// predicted breakdown (pipeline, compute, message, reduction, optimizer) to FILE.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <sstream>
#include <string>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "base/memory_counter.h"
#include "base/status.h"
#include "strategy/internal/cost_model.h"
#include "strategy/internal/profile.h"
#include "strategy/strategy.h"
#include "testing/rank_workers.h"
#include "topology/topology.h"

namespace trident {
namespace {

constexpr int64_t kGlobalBatch = 16;
constexpr int kMeasuredSteps = 5;
constexpr int kRounds = 3;

struct Layout {
  int dp = 1, tp = 1, pp = 1, zero = 0, virtual_stages = 1;
  bool sp = false;
  int64_t micro_batches = 1;
  std::string schedule = "1f1b";
  RecomputeSpec::Method recompute = RecomputeSpec::none;
};

std::vector<Layout> Layouts(int world) {
  if (world == 2) {
    return {{.dp = 2},
            {.dp = 2, .micro_batches = 4},
            {.dp = 2, .zero = 1},
            {.dp = 2, .zero = 2, .micro_batches = 2},
            {.dp = 2, .zero = 3},
            {.dp = 2, .recompute = RecomputeSpec::full},
            {.tp = 2},
            {.tp = 2, .micro_batches = 4},
            {.tp = 2, .sp = true},
            {.pp = 2, .micro_batches = 4},
            {.pp = 2, .micro_batches = 8, .schedule = "zb_h1"},
            {.pp = 2, .virtual_stages = 2, .micro_batches = 4, .schedule = "interleaved_1f1b"},
            {.pp = 2, .micro_batches = 4, .recompute = RecomputeSpec::full}};
  }
  return {{.dp = 4},
          {.dp = 4, .zero = 1},
          {.dp = 4, .zero = 3},
          {.dp = 2, .tp = 2},
          {.dp = 2, .tp = 2, .zero = 2},
          {.dp = 2, .tp = 2, .sp = true},
          {.dp = 2, .pp = 2, .micro_batches = 4},
          {.dp = 2, .pp = 2, .micro_batches = 4, .schedule = "zb_h1"},
          {.tp = 2, .pp = 2, .micro_batches = 4},
          {.tp = 2, .pp = 2, .micro_batches = 8, .recompute = RecomputeSpec::full},
          {.pp = 4, .micro_batches = 8},
          {.pp = 4, .micro_batches = 8, .schedule = "zb_h1"},
          {.dp = 4, .micro_batches = 2, .recompute = RecomputeSpec::full}};
}

ParallelPlan PlanOf(const Layout& l) {
  ParallelPlan plan;
  plan.set_dp(l.dp);
  plan.set_tp(l.tp);
  plan.set_pp(l.pp);
  plan.mutable_tensor_parallel()->set_sequence_parallel(l.sp);
  plan.mutable_zero()->set_stage(l.zero);
  plan.set_virtual_stages(l.virtual_stages);
  plan.set_num_micro_batches(l.micro_batches);
  plan.set_micro_batch_size(kGlobalBatch / l.dp / l.micro_batches);
  plan.mutable_pipeline()->set_schedule(l.schedule);
  plan.mutable_recompute()->set_method(l.recompute);
  SetStrings(plan.mutable_trace()->mutable_batch_fields(), {"tokens", "targets"});
  return plan;
}

// Trains `plan` for a warm-up and kMeasuredSteps steps: {the slowest rank's
// median step seconds, the fullest rank's peak tensor bytes}; `state` gets
// the ParallelModel's report of the first pipeline stage (on rank 0).
absl::StatusOr<std::vector<double>> MeasureLayout(const internal::ProfileRequest& request, const Batch& global,
                                                  const ParallelPlan& plan, Topology* topology, int64_t* state) {
  MemoryCounter& counter = MemoryCounter::Install();  // profiling takes it out when done
  TRIDENT_RETURN_IF_ERROR(topology->Reshape({{"tensor", plan.tp()}, {"pipeline", plan.pp()}, {"data", plan.dp()}}));
  ModelContext context;
  if (plan.tp() > 1)
    context.tp = {plan.tp(), (*topology->Group("tensor"))->rank(), "tp", plan.tensor_parallel().sequence_parallel()};
  TRIDENT_ASSIGN_OR_RETURN(ModelSource source, request.make_source(context));
  const int64_t before = counter.live_bytes();
  counter.ResetPeak();
  double seconds = 0;
  {
    TRIDENT_ASSIGN_OR_RETURN(
        auto model, Parallelize(source, plan, topology, internal::BatchRows(global, 0, plan.micro_batch_size()),
                                request.make_optimizer));
    if (topology->rank() == 0) *state = model->Memory().total();
    std::vector<Batch> micro(plan.num_micro_batches());
    if (model->ReadsData()) {
      const int dp_rank = model->data_parallel_group() ? model->data_parallel_group()->rank() : 0;
      for (int64_t m = 0; m < plan.num_micro_batches(); ++m) {
        micro[m] = internal::BatchRows(global, (dp_rank * plan.num_micro_batches() + m) * plan.micro_batch_size(),
                                       plan.micro_batch_size());
      }
    }
    std::vector<double> steps;
    for (int s = 0; s <= kMeasuredSteps; ++s) {
      TRIDENT_RETURN_IF_ERROR(topology->world().Barrier());
      const auto start = std::chrono::steady_clock::now();
      model->ZeroGrad();
      TRIDENT_RETURN_IF_ERROR(model->ForwardBackward(micro).status());
      TRIDENT_RETURN_IF_ERROR(model->ClipGradNorm(1.0).status());
      TRIDENT_RETURN_IF_ERROR(model->Step(1e-4));
      if (s > 0) steps.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    std::sort(steps.begin(), steps.end());
    seconds = steps[steps.size() / 2];
  }
  at::Tensor measured = at::tensor({seconds, static_cast<double>(counter.peak_bytes() - before)}, at::kDouble);
  TRIDENT_RETURN_IF_ERROR(topology->world().AllReduce(measured, ReduceOp::kMax));
  return std::vector<double>{measured[0].item<double>(), measured[1].item<double>()};
}

// args: {model type, preset}. Rank 0 reports one line per layout:
// "description|state bytes predicted|reported|peak predicted|measured|step predicted|measured".
absl::Status Worker(const std::vector<std::string>& args, std::string* result) {
  at::set_num_threads(1);
  TRIDENT_ASSIGN_OR_RETURN(auto topology, Topology::CreateFromEnvironment({}));
  const std::string type = args.at(0), preset = args.at(1);
  internal::ProfileRequest request;
  request.make_source = [&](const ModelContext& context) -> absl::StatusOr<ModelSource> {
    TRIDENT_ASSIGN_OR_RETURN(ModelFactory factory, ModelRegistry().Find(type));
    return factory(ComponentArgs(absl::StrCat("model '", type, "'"), {{"preset", preset}}), context);
  };
  at::manual_seed(5);
  const at::Tensor tokens = at::randint(256, {kGlobalBatch, 129}, at::kLong);
  const Batch global = {tokens.narrow(1, 0, 128).contiguous(), tokens.narrow(1, 1, 128).contiguous()};
  request.batch = global;
  TRIDENT_ASSIGN_OR_RETURN(request.make_optimizer, MakeOptimizerFactory("adamw", ComponentArgs("optimizer", {})));
  request.micro_batch_sizes = {1, 8};  // as the search profiles a global batch of 16
  for (int tp = 2; tp <= topology->world_size(); tp *= 2) request.tp_degrees.push_back(tp);
  request.fingerprint = preset;
  TRIDENT_ASSIGN_OR_RETURN(ModelProfile profile, internal::ProfileModel(request, topology.get()));
  const std::vector<Layout> layouts = Layouts(topology->world_size());
  std::vector<std::vector<double>> seconds(layouts.size());
  std::vector<double> peak(layouts.size(), 0);
  std::vector<int64_t> state(layouts.size(), 0);
  for (int round = 0; round < kRounds; ++round) {
    for (size_t l = 0; l < layouts.size(); ++l) {
      TRIDENT_ASSIGN_OR_RETURN(std::vector<double> measured,
                               MeasureLayout(request, global, PlanOf(layouts[l]), topology.get(), &state[l]));
      seconds[l].push_back(measured[0]);
      peak[l] = std::max(peak[l], measured[1]);
    }
  }
  for (size_t l = 0; l < layouts.size(); ++l) {
    const ParallelPlan plan = PlanOf(layouts[l]);
    TRIDENT_ASSIGN_OR_RETURN(internal::MemoryPrediction memory, internal::PredictMemory(profile, plan));
    TRIDENT_ASSIGN_OR_RETURN(internal::TimePrediction time, internal::PredictStepTime(profile, plan));
    std::sort(seconds[l].begin(), seconds[l].end());
    if (const char* detail = std::getenv("STRATEGY_MODELS_DETAIL"); detail != nullptr && topology->rank() == 0) {
      std::FILE* out = std::fopen(detail, "a");
      if (out != nullptr)
        std::fprintf(out, "%s: pipeline %.1f ms (compute %.1f, message %.2f), reduction %.1f, optimizer %.1f\n",
                     DescribePlan(plan).c_str(), 1e3 * time.pipeline_seconds, 1e3 * time.compute_seconds,
                     1e3 * time.message_seconds, 1e3 * time.reduction_seconds, 1e3 * time.optimizer_seconds);
      if (out != nullptr) std::fclose(out);
    }
    if (topology->rank() == 0) {
      absl::StrAppend(result, absl::StrFormat("%s|%d|%d|%d|%.0f|%.6f|%.6f\n", DescribePlan(plan),
                                              memory.state[0].total(), state[l], memory.max_tensor_peak, peak[l],
                                              time.step_seconds, seconds[l][seconds[l].size() / 2]));
    }
  }
  return absl::OkStatus();
}

std::vector<double> Ranks(const std::vector<double>& values) {
  std::vector<int> order(values.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int a, int b) { return values[a] < values[b]; });
  std::vector<double> ranks(values.size());
  for (size_t i = 0; i < order.size(); ++i) ranks[order[i]] = static_cast<double>(i);
  return ranks;
}

double Spearman(const std::vector<double>& a, const std::vector<double>& b) {
  const std::vector<double> ra = Ranks(a), rb = Ranks(b);
  double d2 = 0;
  for (size_t i = 0; i < ra.size(); ++i) d2 += (ra[i] - rb[i]) * (ra[i] - rb[i]);
  const double n = static_cast<double>(ra.size());
  return 1 - 6 * d2 / (n * (n * n - 1));
}

int Main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: strategy_models_benchmark MODEL PRESET WORLD_SIZE (gpt gpt-tiny 2)\n");
    return 2;
  }
  const int world = std::atoi(argv[3]);
  auto results = testing::RunRankWorkers(world, {argv[1], argv[2]});
  if (!results.ok()) {
    std::fprintf(stderr, "%s\n", std::string(results.status().message()).c_str());
    return 1;
  }
  std::printf("%s at world size %d, global batch %lld:\n%-34s %14s %14s %11s %11s %6s %10s %10s %6s\n", argv[2], world,
              static_cast<long long>(kGlobalBatch), "layout", "state pred", "state report", "peak pred", "peak meas",
              "err", "step pred", "step meas", "err");
  std::vector<double> predicted, measured;
  double worst_memory = 0, worst_time = 0;
  int exact = 0, rows = 0;
  for (absl::string_view line : absl::StrSplit((*results)[0], '\n', absl::SkipEmpty())) {
    std::vector<std::string> f = absl::StrSplit(line, '|');
    const double peak_pred = std::stod(f[3]), peak_meas = std::stod(f[4]);
    const double step_pred = std::stod(f[5]), step_meas = std::stod(f[6]);
    const double memory_error = (peak_pred - peak_meas) / peak_meas, time_error = (step_pred - step_meas) / step_meas;
    worst_memory = std::max(worst_memory, std::abs(memory_error));
    worst_time = std::max(worst_time, std::abs(time_error));
    exact += f[1] == f[2];
    ++rows;
    predicted.push_back(step_pred);
    measured.push_back(step_meas);
    std::printf("%-34s %14s %14s %9.1fMB %9.1fMB %+5.0f%% %8.1fms %8.1fms %+5.0f%%\n", f[0].c_str(), f[1].c_str(),
                f[2].c_str(), peak_pred / 1e6, peak_meas / 1e6, 100 * memory_error, 1000 * step_pred, 1000 * step_meas,
                100 * time_error);
  }
  std::printf(
      "state bytes exact in %d of %d layouts; largest peak-memory error %.0f%%, largest step-time error "
      "%.0f%%; Spearman rank correlation of step times %.3f\n",
      exact, rows, 100 * worst_memory, 100 * worst_time, Spearman(predicted, measured));
  return 0;
}

}  // namespace
}  // namespace trident

int main(int argc, char** argv) {
  if (auto code = trident::testing::RunIfRankWorker(argc, argv, trident::Worker)) return *code;
  return trident::Main(argc, argv);
}
