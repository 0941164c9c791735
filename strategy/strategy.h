// strategy: the reference design's auto_accelerate in C++. A Strategy is an
// ordered list of optimization methods (strategy.proto); applied to a
// ParallelPlan it sets the layout, precision, ZeRO stage, recomputation and
// pipeline schedule. Loaded from a file it is the semi-automatic mode; chosen
// by SearchStrategy it is the fully automatic one.
//
//   TRIDENT_ASSIGN_OR_RETURN(Strategy strategy, LoadStrategy("zero2_bf16.pbtxt"));
//   ParallelPlan plan;
//   TRIDENT_RETURN_IF_ERROR(ApplyStrategy(strategy, /*world_size=*/4, &plan));
//   TRIDENT_RETURN_IF_ERROR(SaveStrategy(StrategyFromPlan(plan), "in_use.pbtxt"));
//
// The fully automatic mode profiles the model on the job's ranks (cached on
// disk), ranks every layout, schedule, ZeRO stage, recomputation and
// micro-batch size with a memory model and a time model built on the
// profile, drops what does not fit the memory limit, and dry-runs the best
// few on the real ranks, keeping the fastest measured:
//
//   AutoAccelerateOptions options;
//   options.memory_limit_bytes = 8ll << 30;
//   TRIDENT_ASSIGN_OR_RETURN(AcceleratedModel run,
//       AutoAccelerate(make_source, dataset, /*global_batch_size=*/32, adamw, topology.get(), options));
//   for (int64_t step = 0; step < steps; ++step) {
//     TRIDENT_ASSIGN_OR_RETURN(std::vector<Batch> micro, run.micro_batches(step));
//     ...run.model->ForwardBackward(micro), ClipGradNorm, Step...
//   }
#ifndef TRIDENT_STRATEGY_STRATEGY_H_
#define TRIDENT_STRATEGY_STRATEGY_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "data/data.h"
#include "parallel/parallel.h"
#include "strategy/strategy.pb.h"
#include "topology/topology.h"

namespace trident {

// Reads a text-format Strategy; errors name the file and the line.
absl::StatusOr<Strategy> LoadStrategy(const std::string& path);
absl::Status SaveStrategy(const Strategy& strategy, const std::string& path);
std::string StrategyToText(const Strategy& strategy);

// Applies `strategy`'s methods, in order, to `plan` for `world_size` ranks.
// Errors (before any rank starts) name the method, the field or the pair of
// methods at fault: an unknown method, a field another method owns, sizes
// that do not divide the world, amp_native with half, zero1 with fsdp, fsdp
// with zb_h1, a pipeline_parallel without pipeline ranks, ...
absl::Status ApplyStrategy(const Strategy& strategy, int world_size, ParallelPlan* plan);

// The strategy `plan` amounts to (what --save_strategy writes). Its inverse:
// ApplyStrategy of it to a default plan gives back every field of `plan` that
// a strategy decides (the layout with its axis and rank order, ZeRO,
// precision and precision table, recomputation of layers and of modules,
// module replacement, sequence parallelism and tp_overlapping_level, the
// pipeline's schedule, micro-batches, chunks, split and partition), with an
// axis order that lays the ranks out as the default one written as empty.
// Fields a strategy does not decide (device, seed, reductions, buckets,
// trace method, LoRA) stay as the plan it is applied to has them.
Strategy StrategyFromPlan(const ParallelPlan& plan);

// The ranks `strategy` lays out: the product of its parallel_mode sizes
// (data counted as given, 1 when absent), or `fallback` without parallel_mode.
int StrategyWorldSize(const Strategy& strategy, int fallback);

// A short one-line description ("dp2 x pp2 zb_h1 M4 zero2 bf16 recompute=full").
std::string DescribePlan(const ParallelPlan& plan);

// The model source for a tensor-parallel place (ModelContext::tp says which
// shard to build; the zoo's factories take it). A fixed source (FixedSource)
// builds the same model whatever it is asked, so the search leaves tensor
// parallelism out.
using SourceFactory = std::function<absl::StatusOr<ModelSource>(const ModelContext& context)>;
SourceFactory FixedSource(ModelSource source);

struct AutoAccelerateOptions {
  // Methods the search never uses: data, tensor_parallel, pipeline_parallel,
  // zero1, zero2, fsdp, checkpoint, amp_native.
  std::vector<std::string> excluded;
  double time_limit_s = 120;       // for profiling, ranking and dry runs together
  int64_t memory_limit_bytes = 0;  // per rank, resident; 0: the rank's share of physical memory
  // Semi-automatic: apply this strategy file (no search), or with
  // finetune_strategy search only the layouts of its parallel_mode.
  std::string load_strategy;
  bool finetune_strategy = false;
  bool ignore_dryrun_on_load_strategy = true;
  std::string save_strategy_to_file;  // rank 0 writes the strategy chosen
  bool verbose = false;               // rank 0 prints the table of candidates
  // Candidates measured on the ranks: the best predicted of each of the
  // first `dry_runs` layouts (dp x tp x pp) in the ranking.
  int dry_runs = 3;
  int dry_run_steps = 3;                // steps measured each, after one warm-up
  bool allow_precision_change = false;  // bf16 candidates
  // Where profiles are cached ("": $XDG_CACHE_HOME or $HOME/.cache, under trident/profiles).
  std::string profile_cache_dir;
  std::string model_fingerprint;  // names the model (type, arguments) in the cache key
  // What the search leaves as given: loss and gradient reduction, device, seed,
  // bucket sizes, trace and split methods.
  ParallelPlan base;
};

// What a strategy is chosen for: the model (options.model_fingerprint), the
// world size, the global batch's shapes, the memory limit, the methods
// excluded and whether precision may change. SearchStrategy stamps it on the
// strategy; a saved one with another fingerprint was chosen for something else.
std::string StrategyFingerprint(const AutoAccelerateOptions& options, int world_size, const Batch& global_batch);

// One candidate the search ranked.
struct CandidateReport {
  ParallelPlan plan;
  int64_t predicted_resident_bytes = 0;  // the worst rank: the process and its tensors
  MemoryReport predicted_state;          // the worst rank's parameters, gradients, optimizer
  double predicted_step_s = 0;
  double measured_step_s = -1;          // negative: not dry-run
  int64_t measured_resident_bytes = 0;  // the dry run's peak on the fullest rank (0: unknown)
  std::string dry_run_error;            // a failure, or a measured peak over the memory limit
};

struct SearchResult {
  Strategy strategy;  // the winner, its fingerprint set
  ParallelPlan plan;
  std::vector<CandidateReport> ranked;  // the candidates that fit, best predicted first
  int64_t considered = 0;               // candidates modelled
  int64_t over_memory_limit = 0;
  int64_t memory_limit_bytes = 0;
  double profile_s = 0, search_s = 0;  // search_s includes profile_s
  bool profile_cached = false;
  // The first `rows` candidates and every one dry-run: strategy, predicted
  // memory and step time, measured step time where dry-run.
  std::string Table(int rows) const;
};

// Chooses the strategy for `make_source` on `topology`'s ranks (every rank
// calls it; all get the same result) for global batches like
// `global_batch` (its first dimension is the global batch size). Leaves
// `topology` laid out for the winner (PlanMeshAxes and its rank order; the
// search's own candidates use the default axis order).
absl::StatusOr<SearchResult> SearchStrategy(const SourceFactory& make_source, const Batch& global_batch,
                                            const OptimizerFactory& make_optimizer, Topology* topology,
                                            const AutoAccelerateOptions& options);

// What AutoAccelerate hands back: the model on this rank (its optimizer
// inside), the strategy, and this rank's micro-batches of each step's global
// batch (the trainer's batch rule: every layout sees the same samples).
struct AcceleratedModel {
  std::unique_ptr<ParallelModel> model;
  Strategy strategy;
  SearchResult search;
  std::function<absl::StatusOr<std::vector<Batch>>(int64_t step)> micro_batches;
};

// The reference design's auto_accelerate: SearchStrategy (or the loaded
// strategy), then Parallelize with it. `loss`, when set, replaces the
// source's. Like Parallelize, it changes nothing process-wide (see
// UseBestCpuKernels in kernels/kernels.h).
absl::StatusOr<AcceleratedModel> AutoAccelerate(const SourceFactory& make_source,
                                                std::shared_ptr<const Dataset> dataset, int64_t global_batch_size,
                                                const OptimizerFactory& make_optimizer, Topology* topology,
                                                const AutoAccelerateOptions& options, LossFunction loss = nullptr);

}  // namespace trident

#endif  // TRIDENT_STRATEGY_STRATEGY_H_
