// trainer: the thin composition a user touches. A Trainer builds the model from
// the zoo, reads the data with the shared batch rule, averages gradients over
// the data-parallel group (bucketed, overlapping backward), steps AdamW with
// the configured schedule and clipping, evaluates, samples text, writes metrics
// (console, JSON lines, TensorBoard) and checkpoints, and resumes bit-exactly.
//
//   TRIDENT_ASSIGN_OR_RETURN(auto topology, Topology::CreateFromEnvironment({}));
//   TrainerConfig config;  // or LoadTrainerConfig("trainer/configs/default.pbtxt")
//   config.set_dp(topology->world_size());
//   TRIDENT_ASSIGN_OR_RETURN(auto trainer, Trainer::Create(config, topology.get()));
//   trainer->AddHooks(std::make_shared<MyHooks>());
//   TRIDENT_ASSIGN_OR_RETURN(TrainResult result, trainer->Train());
//
// The `train` binary (trainer/main.cc) is this plus flags and local spawning.
#ifndef TRIDENT_TRAINER_TRAINER_H_
#define TRIDENT_TRAINER_TRAINER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "models/models.h"
#include "topology/topology.h"
#include "trainer/config.h"
#include "trainer/config.pb.h"

namespace trident {

// What one optimizer step did (losses are global-batch means over all ranks).
struct StepMetrics {
  int64_t step = 0;         // steps completed, counting this one
  double loss = 0;
  double lr = 0;
  double grad_norm = 0;     // before clipping
  double loss_scale = 1;    // with loss scaling: the scale this step's backward used
  bool skipped = false;     // gradients held inf or NaN on some rank: no update
  double tokens_per_s = 0;  // all ranks together
  double step_time_ms = 0;
  double mfu = 0;           // model FLOPs per second over the measured peak
};

// Read-only view of the trainer handed to hooks.
struct TrainerState {
  const TrainerConfig& config;
  LanguageModel& model;
  const Topology& topology;
  int64_t step;  // optimizer steps completed
};

// Callbacks at the points of the reference design's trainer hooks. Override
// what you need; all run on every rank.
class TrainerHooks {
 public:
  virtual ~TrainerHooks() = default;
  virtual void OnTrainStart(const TrainerState&) {}
  virtual void OnTrainEnd(const TrainerState&) {}
  virtual void OnStepStart(const TrainerState&) {}
  virtual void OnStepEnd(const TrainerState&, const StepMetrics&) {}
  virtual void OnEvalEnd(const TrainerState&, double /*val_loss*/) {}
  // After the step's backward and gradient reduction, before the inf/NaN check,
  // clipping and the update (gradients may be read or changed here).
  virtual void AfterBackward(const TrainerState&) {}
  virtual void BeforeOptimizerStep(const TrainerState&) {}
  virtual void AfterOptimizerStep(const TrainerState&) {}
  virtual void OnSaveCheckpoint(const TrainerState&, const std::string& /*path*/) {}
  virtual void OnLoadCheckpoint(const TrainerState&, const std::string& /*path*/) {}
};

struct TrainResult {
  std::vector<double> losses;           // per step trained in this run
  int64_t first_step = 0;               // step the run started from (after a resume)
  std::optional<double> val_loss;       // at the end
  double unigram_entropy = 0;           // of the training data, in nats
  std::string sample;                   // generated text on rank 0, when sample_tokens > 0
};

class Trainer {
 public:
  // Validates `config` against `topology`, opens the data (preparing the default
  // corpus when config.data is empty), builds the model and optimizer, and loads
  // init_from / resume_from. Every error comes before any training.
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(TrainerConfig config,
                                                         Topology* topology);
  ~Trainer();

  // The checks Create makes before touching a rank, runnable before ranks are
  // spawned: the config against `world_size`, the model sizes, and the data
  // directory's files. Reads no data beyond the tokenizer.
  static absl::Status Preflight(TrainerConfig config, int world_size);

  void AddHooks(std::shared_ptr<TrainerHooks> hooks);
  // Trains until max_steps (or max_epochs), then evaluates, samples and exports.
  absl::StatusOr<TrainResult> Train();
  // Mean validation loss over eval_steps global batches.
  absl::StatusOr<double> Evaluate();
  // `tokens` new tokens after `prompt`, decoded, on rank 0 (other ranks get "");
  // every rank calls it (tensor parallelism and ZeRO-3 compute across ranks).
  // A generator seeded from config.seed draws the tokens; pp > 1 is declined.
  absl::StatusOr<std::string> Sample(const std::string& prompt, int64_t tokens);
  // Writes the full model in safetensors format (rank 0 writes; all ranks call).
  absl::Status ExportSafetensors(const std::string& path);

  LanguageModel& model();
  const TrainerConfig& config() const;
  int64_t step() const;

 private:
  class Impl;
  explicit Trainer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Makes glibc's malloc keep freed memory for reuse instead of unmapping it:
// every allocation under 32 MiB comes from the heap and the heap is not trimmed
// below 1 GiB of free space. A training step allocates and frees the same
// activations every step; returning them to the kernel costs page faults each
// time (measured: 376 -> 314 ms per gpt-tiny step on one CPU rank). Process-wide;
// call once at the start of a training process.
void TuneAllocatorForTraining();

}  // namespace trident

#endif  // TRIDENT_TRAINER_TRAINER_H_
