// trainer: the thin loop over a ParallelModel, a Dataset and an optimizer
// schedule. It reads the data with the shared batch rule (every layout sees
// the batches one process sees), steps the model with the learning-rate
// schedule and clipping, evaluates, samples text from language models, writes
// metrics (console, JSON lines, TensorBoard) and checkpoints, and resumes
// bit-exactly.
//
// From a config (the `train` binary: models, datasets, losses and optimizers
// by registered name):
//   TRIDENT_ASSIGN_OR_RETURN(auto topology, Topology::CreateFromEnvironment({}));
//   TrainerConfig config;  // or LoadTrainerConfig("trainer/configs/default.pbtxt")
//   TRIDENT_ASSIGN_OR_RETURN(auto trainer, Trainer::Create(config, topology.get()));
//   TRIDENT_ASSIGN_OR_RETURN(TrainResult result, trainer->Train());
//
// From your own parts (Parallelize any model, any Dataset):
//   TRIDENT_ASSIGN_OR_RETURN(auto model, Parallelize(source, plan, topology.get(), example, adamw));
//   TRIDENT_ASSIGN_OR_RETURN(auto trainer, Trainer::Create(config, {std::move(model), std::move(train)}));
//   trainer->AddHooks(std::make_shared<MyHooks>());
//   TRIDENT_ASSIGN_OR_RETURN(TrainResult result, trainer->Train());
#ifndef TRIDENT_TRAINER_TRAINER_H_
#define TRIDENT_TRAINER_TRAINER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "data/data.h"
#include "parallel/parallel.h"
#include "topology/topology.h"
#include "trainer/config.h"
#include "trainer/config.pb.h"

namespace trident {

// What one optimizer step did (losses over the global batch, on every rank).
struct StepMetrics {
  int64_t step = 0;  // steps completed, counting this one
  double loss = 0;
  double lr = 0;
  double grad_norm = 0;     // before clipping
  double loss_scale = 1;    // with loss scaling: the scale this step's backward used
  bool skipped = false;     // gradients held inf or NaN on some rank: no update
  double tokens_per_s = 0;  // all ranks together (samples per second for non-token data)
  double step_time_ms = 0;
  double elapsed_s = 0;  // since Train began, pauses between steps (saves, evaluation) included
  double mfu = 0;        // model FLOPs per second over the job's measured peak
  // With wall_clock_breakdown: this rank's step in milliseconds by part
  // ("data", "forward", "backward", "pipeline_p2p", each collective kind,
  // "optimizer"); collectives inside forward and backward count there too.
  std::vector<std::pair<std::string, double>> wall_clock_ms;
};

// Read-only view of the trainer handed to hooks.
struct TrainerState {
  const TrainerConfig& config;
  ParallelModel& model;
  const Topology& topology;
  int64_t step;   // optimizer steps completed
  int64_t epoch;  // of the next sample
};

// Callbacks at the points of the reference design's trainer hooks (nnScaler's
// names in comments). Override what you need; all run on every rank.
class TrainerHooks {
 public:
  virtual ~TrainerHooks() = default;
  virtual void OnTrainStart(const TrainerState&) {}
  virtual void OnTrainEnd(const TrainerState&) {}
  virtual void OnEpochStart(const TrainerState&) {}  // on_epoch_start
  virtual void OnEpochEnd(const TrainerState&) {}    // on_epoch_end
  virtual void OnStepStart(const TrainerState&) {}
  virtual void OnStepEnd(const TrainerState&, const StepMetrics&) {}
  virtual void BeforeZeroGrad(const TrainerState&) {}  // before_zero_grad
  virtual void AfterZeroGrad(const TrainerState&) {}   // after_zero_grad
  // After the step's backward and gradient reduction, before the inf/NaN check,
  // clipping and the update (gradients may be read or changed here).
  virtual void AfterBackward(const TrainerState&) {}
  // after_aggregate_train_step_outputs: the step's loss, reduced over ranks.
  virtual void AfterAggregateTrainStepOutputs(const TrainerState&, double /*loss*/) {}
  virtual void BeforeGnormClip(const TrainerState&) {}                       // before_gnorm_clip
  virtual void AfterGnormClip(const TrainerState&, double /*grad_norm*/) {}  // after_gnorm_clip
  virtual void BeforeOptimizerStep(const TrainerState&) {}
  virtual void AfterOptimizerStep(const TrainerState&) {}
  // before_log_train_metrics: the metrics may be changed before they are written.
  virtual void BeforeLogTrainMetrics(const TrainerState&, StepMetrics&) {}
  virtual void OnValStart(const TrainerState&) {}                     // on_val_start
  virtual void OnValEnd(const TrainerState&, double /*val_loss*/) {}  // on_val_end
  virtual void OnSaveCheckpoint(const TrainerState&, const std::string& /*path*/) {}
  virtual void OnLoadCheckpoint(const TrainerState&, const std::string& /*path*/) {}
};

struct TrainResult {
  std::vector<double> losses;      // per step trained in this run
  int64_t first_step = 0;          // step the run started from (after a resume)
  std::optional<double> val_loss;  // at the end
  double unigram_entropy = 0;      // of token training data, in nats
  std::string sample;              // generated text on rank 0, when sample_tokens > 0
  bool preempted = false;          // stopped early by SIGTERM (StopOnSigterm)
};

// What the loop runs when built from your own parts.
struct TrainerInputs {
  std::unique_ptr<ParallelModel> model;
  std::unique_ptr<Dataset> train_data;
  std::unique_ptr<Dataset> val_data;     // optional
  std::unique_ptr<Tokenizer> tokenizer;  // optional: sampling decodes with it
};

class Trainer {
 public:
  // Builds everything `config` names (model, data, loss, optimizer by
  // registered name), parallelizes the model over `topology`, and loads
  // init_from / resume_from. Every error comes before any training. The
  // layout is ResolveConfig's plan, or with strategy=auto ChooseStrategy's.
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(TrainerConfig config, Topology* topology);
  // The same laid out as `plan` (what ResolveConfig or ChooseStrategy gave
  // for `config`; `train` resolves once and lays the topology out from it).
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(TrainerConfig config, ParallelPlan plan, Topology* topology);
  // The loop over parts you built. The model's plan decides the layout and
  // micro-batching (the config's layout fields are not read); the config
  // gives the rest (steps, learning rate, evaluation, checkpoints, ...).
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(TrainerConfig config, TrainerInputs inputs);
  ~Trainer();

  // The checks Create makes before touching a rank, runnable before ranks are
  // spawned: the config against `world_size`, the components it names, and
  // the data directory's files. Reads no data beyond the tokenizer.
  static absl::Status Preflight(TrainerConfig config, int world_size);

  // The fully automatic mode (config.strategy "auto"): chooses the strategy
  // on `topology`'s ranks (strategy/strategy.h), or reuses the one saved for
  // this run (strategy_reuse), and returns `base` (ResolveConfig's plan for
  // `config`) with it applied, the global batch kept. Leaves `topology` laid
  // out for it. Every rank calls it.
  static absl::StatusOr<ParallelPlan> ChooseStrategy(const TrainerConfig& config, ParallelPlan base,
                                                     Topology* topology);

  void AddHooks(std::shared_ptr<TrainerHooks> hooks);
  // Trains until max_steps (or max_epochs), then evaluates, samples and exports.
  absl::StatusOr<TrainResult> Train();
  // Mean validation loss over eval_steps (max_val_steps) global batches.
  absl::StatusOr<double> Evaluate();
  // `tokens` new tokens after `prompt`, decoded, on rank 0 (other ranks get "");
  // every rank calls it. Needs a model whose outputs are next-token logits.
  absl::StatusOr<std::string> Sample(const std::string& prompt, int64_t tokens);
  // Writes the full model in safetensors format (rank 0 writes; all ranks call).
  absl::Status ExportSafetensors(const std::string& path);

  ParallelModel& model();
  const TrainerConfig& config() const;
  int64_t step() const;

  class Impl;

 private:
  explicit Trainer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Preemption: after this call, SIGTERM makes Train() finish the current
// step on every rank (they agree through the process group), save a
// checkpoint when save_dir is set, and return normally. Process-wide; the
// `train` binary calls it (preempt_save).
void StopOnSigterm();

// Makes glibc's malloc keep freed memory for reuse instead of unmapping it:
// every allocation under 32 MiB comes from the heap and the heap is not trimmed
// below 1 GiB of free space. A training step allocates and frees the same
// activations every step; returning them to the kernel costs page faults each
// time (measured: 376 -> 314 ms per gpt-tiny step on one CPU rank). With
// `sharded_parameters` (ZeRO-3) allocations from 1 MiB are mapped instead:
// the layers gathered and released each step would leave the heap larger than
// the step's peak (1,606 against 1,007 MB for gpt2-124m's ZeRO-3 ranks at
// dp=4). Its steps then take LibTorch's tensors of 1 MiB and more from the CPU
// block cache (Train installs it), since mapped afresh each time their pages
// fault in again (gpt2-124m at dp=2: 7,156 ms a step against 5,984 from the
// cache, at 1,348 and 1,388 MB). Process-wide; call once at the start of a
// training process.
void TuneAllocatorForTraining(bool sharded_parameters = false);

}  // namespace trident

#endif  // TRIDENT_TRAINER_TRAINER_H_
