// The fully automatic mode: profile, rank every candidate with the memory and
// time models, dry-run the best few, keep the fastest measured.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <set>
#include <thread>
#include <tuple>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/logging.h"
#include "base/memory_counter.h"
#include "base/rng.h"
#include "base/status.h"
#include "strategy/internal/cost_model.h"
#include "strategy/internal/profile.h"
#include "strategy/strategy.h"

namespace trident {
namespace {

// Memory figures are in MiB, printed "MB" as the trainer prints them (and as
// memory_limit_mb counts them).
constexpr double kMiB = 1 << 20;

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

std::vector<int64_t> Divisors(int64_t n) {
  std::vector<int64_t> divisors;
  for (int64_t d = 1; d <= n; ++d) {
    if (n % d == 0) divisors.push_back(d);
  }
  return divisors;
}

int64_t MemTotalBytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  int64_t kb = 0;
  while (meminfo >> key >> kb) {
    if (key == "MemTotal:") return kb * 1024;
    meminfo.ignore(256, '\n');
  }
  return 0;
}

std::string DefaultCacheDir() {
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg != nullptr && *xdg != '\0') {
    return absl::StrCat(xdg, "/trident/profiles");
  }
  if (const char* home = std::getenv("HOME"); home != nullptr && *home != '\0') {
    return absl::StrCat(home, "/.cache/trident/profiles");
  }
  return "/tmp/trident-profiles";
}

bool Uses(const AutoAccelerateOptions& options, const std::string& method) {
  return std::find(options.excluded.begin(), options.excluded.end(), method) == options.excluded.end();
}

// Every (a, b) with a from `as` and b from `bs`.
template <typename A, typename B>
std::vector<std::pair<A, B>> Pairs(const std::vector<A>& as, const std::vector<B>& bs) {
  std::vector<std::pair<A, B>> pairs;
  for (const A& a : as) {
    for (const B& b : bs) pairs.emplace_back(a, b);
  }
  return pairs;
}

// Every plan the search weighs: dp x tp x pp over the world (tp among the
// profiled degrees), ZeRO, recomputation, micro-batch sizes, schedules and
// precision, each valid on its own. `around`: only its layout (finetuning).
std::vector<ParallelPlan> Candidates(const ModelProfile& profile, int world, int64_t global_batch,
                                     const AutoAccelerateOptions& options, const ParallelPlan* around) {
  std::vector<ParallelPlan> plans;
  const int64_t layers = profile.layers_size();
  std::vector<std::string> precisions = {"fp32"};
  if (options.allow_precision_change && profile.has_bf16() && Uses(options, "amp_native")) precisions.push_back("bf16");
  for (int tp : profile.tensor_parallel_degrees()) {
    if (tp > 1 && !Uses(options, "tensor_parallel")) continue;
    std::vector<bool> sequence_parallel = {false};
    const auto& sp_degrees = profile.sequence_parallel_degrees();
    if (std::find(sp_degrees.begin(), sp_degrees.end(), tp) != sp_degrees.end()) sequence_parallel.push_back(true);
    for (int64_t pp : Divisors(world / tp)) {
      const int dp = world / tp / static_cast<int>(pp);
      if ((pp > 1 && !Uses(options, "pipeline_parallel")) || (dp > 1 && !Uses(options, "data")) || pp > layers ||
          global_batch % dp != 0) {
        continue;
      }
      if (around != nullptr && (around->dp() != dp || around->tp() != tp || around->pp() != pp)) continue;
      std::vector<int> zero_stages = {0};
      if (dp > 1) {
        if (Uses(options, "zero1")) zero_stages.push_back(1);
        if (Uses(options, "zero2")) zero_stages.push_back(2);
        if (Uses(options, "fsdp")) zero_stages.push_back(3);
      }
      std::vector<RecomputeSpec::Method> recomputation = {RecomputeSpec::none};
      if (Uses(options, "checkpoint")) {
        recomputation.push_back(RecomputeSpec::full);
        if (pp > 1) recomputation.push_back(RecomputeSpec::stage_aware);
      }
      std::vector<std::pair<std::string, int>> schedules = {{"1f1b", 1}};
      if (pp > 1) {
        schedules.push_back({"zb_h1", 1});
        for (int v = 2; v <= 4; ++v) {
          if (layers >= pp * v) schedules.push_back({"interleaved_1f1b", v});
        }
        schedules.push_back({"shifted_critical_path", 1});
      }
      for (int64_t b : Divisors(global_batch / dp)) {
        for (const auto& [schedule, v] : schedules) {
          for (int zero : zero_stages) {
            for (RecomputeSpec::Method recompute : recomputation) {
              if (schedule == "shifted_critical_path" && recompute == RecomputeSpec::none) continue;
              for (const auto& [precision, sp] : Pairs(precisions, sequence_parallel)) {
                ParallelPlan plan = options.base;
                plan.set_dp(dp);
                plan.set_tp(tp);
                plan.set_pp(static_cast<int>(pp));
                plan.clear_axis_order();  // the search's layouts use the default mesh
                plan.clear_rank_order();
                plan.mutable_tensor_parallel()->set_sequence_parallel(sp);
                plan.set_micro_batch_size(b);
                plan.set_num_micro_batches(global_batch / dp / b);
                plan.mutable_pipeline()->set_schedule(schedule);
                plan.set_virtual_stages(v);
                plan.mutable_zero()->set_stage(zero);
                plan.mutable_recompute()->set_method(recompute);
                plan.mutable_recompute()->clear_layers();
                plan.mutable_precision()->set_mode(precision);
                if (pp > 1) plan.mutable_pipeline()->set_partition_method("cost");
                if (ValidatePlan(plan).ok()) plans.push_back(plan);
              }
            }
          }
        }
      }
    }
  }
  return plans;
}

// Rank 0's decision on every rank.
absl::StatusOr<bool> Agree(const ProcessGroup& world, bool decision) {
  at::Tensor flag = at::full({1}, decision ? 1 : 0, at::kLong);
  TRIDENT_RETURN_IF_ERROR(world.Broadcast(flag, 0));
  return flag.item<int64_t>() == 1;
}

absl::StatusOr<ModelSource> SourceFor(const SourceFactory& make_source, const ParallelPlan& plan, Topology* topology) {
  ModelContext context;
  context.seed = plan.seed();
  if (plan.tp() > 1) {
    TRIDENT_ASSIGN_OR_RETURN(ProcessGroup * tp, topology->Group("tensor"));
    context.tp = {plan.tp(), tp->rank(), "tp", plan.tensor_parallel().sequence_parallel()};
  }
  return make_source(context);
}

// This rank's micro-batches of `global` under `plan` (the rows of its data-parallel share).
std::vector<Batch> MicroBatchesOf(const Batch& global, const ParallelPlan& plan, const ParallelModel& model) {
  std::vector<Batch> micro(plan.num_micro_batches());
  if (!model.ReadsData()) return micro;
  const ProcessGroup* dp = model.data_parallel_group();
  const int64_t first = (dp ? dp->rank() : 0) * plan.num_micro_batches() * plan.micro_batch_size();
  for (int64_t m = 0; m < plan.num_micro_batches(); ++m) {
    micro[m] = internal::BatchRows(global, first + m * plan.micro_batch_size(), plan.micro_batch_size());
  }
  return micro;
}

struct Measurement {
  double step_seconds = 0;          // the median step of the slowest rank
  int64_t peak_resident_bytes = 0;  // of the fullest rank (0: unknown)
};

// Builds `plan` on the ranks and measures `steps` training steps (after one
// warm-up).
absl::StatusOr<Measurement> DryRun(const SourceFactory& make_source, const Batch& global,
                                   const OptimizerFactory& make_optimizer, Topology* topology, const ParallelPlan& plan,
                                   int steps) {
  const bool peak_known = StartResidentSection();
  TRIDENT_RETURN_IF_ERROR(topology->Reshape(PlanMeshAxes(plan), ToVector(plan.rank_order())));
  absl::StatusOr<ModelSource> source = SourceFor(make_source, plan, topology);
  TRIDENT_RETURN_IF_ERROR(AgreeOnFailure(topology->world(), source.status(), "building the model source"));
  TRIDENT_ASSIGN_OR_RETURN(std::unique_ptr<ParallelModel> model,
                           Parallelize(*std::move(source), plan, topology,
                                       internal::BatchRows(global, 0, plan.micro_batch_size()), make_optimizer));
  const std::vector<Batch> micro = MicroBatchesOf(global, plan, *model);
  std::vector<double> seconds;
  for (int s = 0; s <= steps; ++s) {
    TRIDENT_RETURN_IF_ERROR(topology->world().Barrier());
    const auto start = Clock::now();
    model->ZeroGrad();
    TRIDENT_RETURN_IF_ERROR(model->ForwardBackward(micro).status());
    TRIDENT_RETURN_IF_ERROR(model->ClipGradNorm(1.0).status());
    TRIDENT_RETURN_IF_ERROR(model->Step(/*lr=*/0.0));
    if (s > 0) seconds.push_back(Since(start));
  }
  std::sort(seconds.begin(), seconds.end());
  at::Tensor worst = at::tensor(
      {seconds[seconds.size() / 2], peak_known ? static_cast<double>(SectionPeakResidentBytes()) : 0.0}, at::kDouble);
  TRIDENT_RETURN_IF_ERROR(topology->world().AllReduce(worst, ReduceOp::kMax));
  return Measurement{worst[0].item<double>(), static_cast<int64_t>(worst[1].item<double>())};
}

std::string BatchShapes(const Batch& global) {
  std::vector<std::string> shapes;
  for (const at::Tensor& t : global) {
    shapes.push_back(absl::StrCat(absl::StrJoin(t.sizes().vec(), "x"), ":", at::toString(t.scalar_type())));
  }
  return absl::StrJoin(shapes, ",");
}

// The profile's cache key: the model, the ranks and the machine.
std::string ProfileKey(const AutoAccelerateOptions& options, int world, const Batch& global) {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  return absl::StrCat("model=", options.model_fingerprint, ";world=", world, ";batch=", BatchShapes(global),
                      ";host=", host, ";cores=", std::thread::hardware_concurrency(),
                      ";device=", options.base.device());
}

}  // namespace

std::string StrategyFingerprint(const AutoAccelerateOptions& options, int world_size, const Batch& global_batch) {
  return absl::StrCat("model=", options.model_fingerprint, ";world=", world_size, ";batch=", BatchShapes(global_batch),
                      ";memory_limit=", options.memory_limit_bytes,
                      ";precision_change=", options.allow_precision_change,
                      ";excluded=", absl::StrJoin(options.excluded, ","));
}

SourceFactory FixedSource(ModelSource source) {
  return [source](const ModelContext& context) -> absl::StatusOr<ModelSource> {
    if (context.tp.size > 1) {
      return absl::InvalidArgumentError("this model source has no tensor-parallel shards");
    }
    return source;
  };
}

std::string SearchResult::Table(int rows) const {
  std::string table = absl::StrFormat("%-3s %-48s %12s %13s %12s %12s\n", "#", "strategy", "memory MB", "predicted ms",
                                      "measured MB", "measured ms");
  for (int i = 0; i < static_cast<int>(ranked.size()); ++i) {
    const CandidateReport& c = ranked[i];
    if (i >= rows && c.measured_step_s < 0 && c.dry_run_error.empty()) continue;  // beyond the rows, only dry runs
    const std::string measured = c.measured_step_s >= 0     ? absl::StrFormat("%.1f", 1000 * c.measured_step_s)
                                 : !c.dry_run_error.empty() ? "failed"
                                                            : "-";
    const bool chosen =
        DescribePlan(c.plan) == DescribePlan(plan) && c.plan.micro_batch_size() == plan.micro_batch_size();
    const std::string memory =
        c.measured_resident_bytes > 0 ? absl::StrFormat("%.1f", c.measured_resident_bytes / kMiB) : "-";
    absl::StrAppend(&table, absl::StrFormat("%-3d %-48s %12.1f %13.1f %12s %12s%s\n", i + 1, DescribePlan(c.plan),
                                            c.predicted_resident_bytes / kMiB, 1000 * c.predicted_step_s, memory,
                                            measured, chosen ? "  <- chosen" : ""));
  }
  absl::StrAppend(&table,
                  absl::StrFormat("%d candidates modelled, %d over the memory limit (%.0f MB per rank); search %.1f s "
                                  "(profile %.1f s%s)\n",
                                  considered, over_memory_limit, memory_limit_bytes / kMiB, search_s, profile_s,
                                  profile_cached ? ", cached" : ""));
  return table;
}

absl::StatusOr<SearchResult> SearchStrategy(const SourceFactory& make_source, const Batch& global_batch,
                                            const OptimizerFactory& make_optimizer, Topology* topology,
                                            const AutoAccelerateOptions& options) {
  const auto start = Clock::now();
  const at::Tensor rng = CpuRngState();
  const int world = topology->world_size();
  if (global_batch.empty() || global_batch[0].dim() == 0) {
    return absl::InvalidArgumentError("the search needs a global batch with samples along dimension 0");
  }
  const int64_t G = global_batch[0].size(0);
  SearchResult result;
  std::optional<ParallelPlan> loaded;
  if (!options.load_strategy.empty()) {
    TRIDENT_ASSIGN_OR_RETURN(Strategy strategy, LoadStrategy(options.load_strategy));
    ParallelPlan plan = options.base;
    TRIDENT_RETURN_IF_ERROR(ApplyStrategy(strategy, world, &plan));
    if (G % (plan.dp() * plan.num_micro_batches()) != 0) {
      return absl::InvalidArgumentError(absl::StrCat("strategy ", options.load_strategy, ": the global batch of ", G,
                                                     " does not divide into dp*micro_batches = ", plan.dp(), "*",
                                                     plan.num_micro_batches()));
    }
    plan.set_micro_batch_size(G / (plan.dp() * plan.num_micro_batches()));
    loaded = plan;
    if (!options.finetune_strategy) {
      result.strategy = strategy;
      result.plan = plan;
      CandidateReport report;
      report.plan = plan;
      if (!options.ignore_dryrun_on_load_strategy) {
        TRIDENT_ASSIGN_OR_RETURN(Measurement measured, DryRun(make_source, global_batch, make_optimizer, topology, plan,
                                                              options.dry_run_steps));
        report.measured_step_s = measured.step_seconds;
        report.measured_resident_bytes = measured.peak_resident_bytes;
      }
      result.ranked.push_back(report);
      TRIDENT_RETURN_IF_ERROR(topology->Reshape(PlanMeshAxes(plan), ToVector(plan.rank_order())));
      SetCpuRngState(rng);
      result.search_s = Since(start);
      return result;
    }
  }
  int local_ranks = std::max(1, topology->env().local_world_size);
  result.memory_limit_bytes =
      options.memory_limit_bytes > 0 ? options.memory_limit_bytes : MemTotalBytes() / local_ranks;

  // Profile: micro-batch sizes spanning the candidates', tensor-parallel degrees dividing the world.
  internal::ProfileRequest request;
  request.make_source = make_source;
  request.plan = options.base;
  request.batch = global_batch;
  request.make_optimizer = make_optimizer;
  const int64_t largest = loaded ? loaded->micro_batch_size() : G;
  const int64_t low = std::max<int64_t>(1, largest / 8), high = std::max<int64_t>(low, largest / 2);
  request.micro_batch_sizes = low == high ? std::vector<int64_t>{low} : std::vector<int64_t>{low, high};
  if (Uses(options, "tensor_parallel")) {
    for (int64_t tp : Divisors(world)) {
      if (tp > 1 && (!loaded || loaded->tp() == tp)) request.tp_degrees.push_back(static_cast<int>(tp));
    }
  }
  request.bf16 = options.allow_precision_change && Uses(options, "amp_native");
  // "v3": profiles since sequence parallelism is measured (older caches lack it).
  const ParallelPlan& base = options.base;
  request.fingerprint = absl::StrCat(
      "v3;", ProfileKey(options, world, global_batch), ";bf16=", request.bf16,
      ";sizes=", absl::StrJoin(request.micro_batch_sizes, ","), ";tp=", absl::StrJoin(request.tp_degrees, ","),
      ";trace=", TraceSpec::Method_Name(base.trace().method()), ",", base.trace().split_method(), ",",
      base.trace().shard_count(), ",", absl::StrJoin(base.trace().leaf_modules(), "+"), ",",
      absl::StrJoin(base.trace().input_names(), "+"));
  const std::string cache_dir = options.profile_cache_dir.empty() ? DefaultCacheDir() : options.profile_cache_dir;
  const auto profile_start = Clock::now();
  TRIDENT_ASSIGN_OR_RETURN(ModelProfile profile,
                           internal::CachedProfile(request, cache_dir, topology, &result.profile_cached));
  result.profile_s = Since(profile_start);
  ReleaseFreedMemory();

  // Rank everything the models say fits; when nothing does, the ZeRO
  // candidates again with their optimizer state offloaded to disk (their
  // time predicted as without: it leaves out the disk's transfers).
  std::vector<ParallelPlan> plans = Candidates(profile, world, G, options, loaded ? &*loaded : nullptr);
  std::optional<CandidateReport> smallest;
  auto consider = [&](const ParallelPlan& plan) {
    absl::StatusOr<internal::MemoryPrediction> memory = internal::PredictMemory(profile, plan);
    if (!memory.ok()) return;  // a schedule that cannot run these counts, a degree not profiled
    ++result.considered;
    CandidateReport report;
    report.plan = plan;
    report.predicted_resident_bytes = memory->max_resident;
    for (const MemoryReport& state : memory->state) {
      if (state.total() > report.predicted_state.total()) report.predicted_state = state;
    }
    if (memory->max_resident > result.memory_limit_bytes) {
      ++result.over_memory_limit;
      if (!smallest || report.predicted_resident_bytes < smallest->predicted_resident_bytes) smallest = report;
      return;
    }
    absl::StatusOr<internal::TimePrediction> time = internal::PredictStepTime(profile, plan);
    if (!time.ok()) return;
    report.predicted_step_s = time->step_seconds;
    result.ranked.push_back(report);
  };
  for (const ParallelPlan& plan : plans) consider(plan);
  // Nothing fits: the ZeRO candidates with their optimizer state on disk,
  // then ZeRO-3's with their parameter chunks there too.
  for (bool params_too : {false, true}) {
    if (!result.ranked.empty() || loaded) break;
    for (ParallelPlan plan : plans) {
      if (plan.zero().stage() == 0 || plan.zero().offload_optimizer() != ZeroSpec::none) continue;
      if (params_too && plan.zero().stage() != 3) continue;
      plan.mutable_zero()->set_offload_optimizer(ZeroSpec::disk);
      if (params_too) plan.mutable_zero()->set_offload_params(ZeroSpec::disk);
      consider(plan);
    }
  }
  if (result.ranked.empty()) {
    if (!smallest) return absl::InvalidArgumentError("the search found no strategy for this model and world size");
    return absl::ResourceExhaustedError(absl::StrFormat(
        "no strategy fits the memory limit of %.0f MB per rank: the smallest found (%s) needs %.0f MB; raise "
        "memory_limit_mb, add ranks, or shorten the sequences or the global batch",
        result.memory_limit_bytes / kMiB, DescribePlan(smallest->plan), smallest->predicted_resident_bytes / kMiB));
  }
  std::stable_sort(result.ranked.begin(), result.ranked.end(), [](const CandidateReport& a, const CandidateReport& b) {
    return a.predicted_step_s < b.predicted_step_s;
  });

  // Dry-run the best few while time is left (rank 0's clock decides): the
  // best predicted of each of the first layouts (dp x tp x pp), so that the
  // measurements decide between layouts, where the model errs most, rather
  // than between variants of one (finetuning keeps one layout: its best variants).
  std::vector<int> dry_run;
  std::set<std::tuple<int, int, int>> layouts;
  for (int i = 0; i < static_cast<int>(result.ranked.size()) && static_cast<int>(dry_run.size()) < options.dry_runs;
       ++i) {
    const ParallelPlan& plan = result.ranked[i].plan;
    if (layouts.insert({plan.dp(), plan.tp(), plan.pp()}).second || loaded) dry_run.push_back(i);
  }
  for (int i : dry_run) {
    CandidateReport& candidate = result.ranked[i];
    const double expected = Since(start) + 2 + (options.dry_run_steps + 1) * 2 * candidate.predicted_step_s;
    TRIDENT_ASSIGN_OR_RETURN(bool go, Agree(topology->world(), expected < options.time_limit_s));
    if (!go) break;
    absl::StatusOr<Measurement> measured =
        DryRun(make_source, global_batch, make_optimizer, topology, candidate.plan, options.dry_run_steps);
    ReleaseFreedMemory();  // the dry run's model and optimizer stop counting as resident
    if (measured.ok() && measured->peak_resident_bytes > result.memory_limit_bytes) {
      candidate.measured_resident_bytes = measured->peak_resident_bytes;
      measured = absl::ResourceExhaustedError(
          absl::StrFormat("it peaked at %.0f MB resident, over the limit of %.0f MB",
                          measured->peak_resident_bytes / kMiB, result.memory_limit_bytes / kMiB));
    }
    if (measured.ok()) {
      candidate.measured_step_s = measured->step_seconds;
      candidate.measured_resident_bytes = measured->peak_resident_bytes;
    } else {
      candidate.dry_run_error = std::string(measured.status().message());
      if (topology->rank() == 0)
        LOG(WARNING) << "dry run of " << DescribePlan(candidate.plan) << " failed: " << measured.status();
    }
  }
  // The fastest measured; without a measurement, the best predicted that did not fail.
  int best = -1;
  for (int i = 0; i < static_cast<int>(result.ranked.size()); ++i) {
    const CandidateReport& candidate = result.ranked[i];
    if (!candidate.dry_run_error.empty()) continue;
    const double chosen = best < 0 ? -1 : result.ranked[best].measured_step_s;
    if (best < 0 || (candidate.measured_step_s >= 0 && (chosen < 0 || candidate.measured_step_s < chosen))) best = i;
  }
  if (best < 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "every candidate strategy failed its dry run (the first: ", result.ranked.front().dry_run_error,
        "); exclude the failing methods with --strategy_excluded or give a strategy with --load_strategy"));
  }
  result.plan = result.ranked[best].plan;
  result.strategy = StrategyFromPlan(result.plan);
  result.strategy.set_fingerprint(StrategyFingerprint(options, world, global_batch));
  TRIDENT_RETURN_IF_ERROR(topology->Reshape(PlanMeshAxes(result.plan), ToVector(result.plan.rank_order())));
  SetCpuRngState(rng);
  result.search_s = Since(start);
  if (topology->rank() == 0) {
    if (!options.save_strategy_to_file.empty()) {
      TRIDENT_RETURN_IF_ERROR(SaveStrategy(result.strategy, options.save_strategy_to_file));
    }
    if (options.verbose) std::cout << result.Table(std::max(10, options.dry_runs)) << std::flush;
  }
  return result;
}

absl::StatusOr<AcceleratedModel> AutoAccelerate(const SourceFactory& make_source,
                                                std::shared_ptr<const Dataset> dataset, int64_t global_batch_size,
                                                const OptimizerFactory& make_optimizer, Topology* topology,
                                                const AutoAccelerateOptions& options, LossFunction loss) {
  if (dataset == nullptr || dataset->size() == 0)
    return absl::InvalidArgumentError("AutoAccelerate needs a dataset with samples");
  SourceFactory source_with_loss = make_source;
  if (loss) {
    source_with_loss = [make_source, loss](const ModelContext& context) -> absl::StatusOr<ModelSource> {
      TRIDENT_ASSIGN_OR_RETURN(ModelSource source, make_source(context));
      source.loss = loss;
      return source;
    };
  }
  AutoAccelerateOptions with_fields = options;
  if (with_fields.base.trace().batch_fields().empty())
    SetStrings(with_fields.base.mutable_trace()->mutable_batch_fields(), dataset->field_names());
  auto sampler =
      std::make_shared<BatchSampler>(dataset->size(), global_batch_size, options.base.seed(), /*shuffle=*/true);
  std::vector<int64_t> first;
  for (int64_t j = 0; j < global_batch_size; ++j) first.push_back(sampler->SampleIndex(0, j));
  TRIDENT_ASSIGN_OR_RETURN(Batch global, dataset->Get(first));
  AcceleratedModel accelerated;
  TRIDENT_ASSIGN_OR_RETURN(accelerated.search,
                           SearchStrategy(source_with_loss, global, make_optimizer, topology, with_fields));
  accelerated.strategy = accelerated.search.strategy;
  const ParallelPlan plan = accelerated.search.plan;
  absl::StatusOr<ModelSource> source = SourceFor(source_with_loss, plan, topology);
  TRIDENT_RETURN_IF_ERROR(AgreeOnFailure(topology->world(), source.status(), "building the model source"));
  TRIDENT_ASSIGN_OR_RETURN(accelerated.model,
                           Parallelize(*std::move(source), plan, topology,
                                       internal::BatchRows(global, 0, plan.micro_batch_size()), make_optimizer));
  const bool reads = accelerated.model->ReadsData();
  const ProcessGroup* dp = accelerated.model->data_parallel_group();
  const int dp_rank = dp ? dp->rank() : 0;
  accelerated.micro_batches = [dataset, sampler, plan, reads,
                               dp_rank](int64_t step) -> absl::StatusOr<std::vector<Batch>> {
    std::vector<Batch> micro(plan.num_micro_batches());
    if (!reads) return micro;
    for (int64_t m = 0; m < plan.num_micro_batches(); ++m) {
      TRIDENT_ASSIGN_OR_RETURN(micro[m],
                               dataset->Get(sampler->MicroBatch(step, plan.dp(), dp_rank, plan.micro_batch_size(), m)));
    }
    return micro;
  };
  return accelerated;
}

}  // namespace trident
