// The Trainer's state, shared by the loop (trainer.cc), checkpoints
// (checkpoints.cc) and sampling (sampling.cc). Private to //trainer.
#ifndef TRIDENT_TRAINER_INTERNAL_TRAINER_IMPL_H_
#define TRIDENT_TRAINER_INTERNAL_TRAINER_IMPL_H_

#include <atomic>
#include <cstdio>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "base/host_copy.h"
#include "data/data.h"
#include "parallel/parallel.h"
#include "trainer/internal/metrics.h"
#include "trainer/internal/operator_trace.h"
#include "trainer/trainer.h"

namespace trident {

// A checkpoint whose files are being written and committed by a background
// thread (async_save); destroying it cancels the wait for other ranks and
// joins the thread.
struct PendingSave {
  int64_t step = 0;
  std::string path;  // save_dir/step_N once committed
  std::atomic<bool> cancelled{false};
  std::future<absl::Status> verdict;  // the same on every rank
  double pause_s = 0;                 // training stopped for the snapshot
  double write_s = 0;                 // writing and committing (set before `verdict`)
  ~PendingSave() {
    cancelled = true;
    if (verdict.valid()) verdict.wait();
  }
};

// wall_clock_breakdown: a step of `step_s` seconds by part, from its data
// time, its pipeline timeline, the communication times before and after it
// and its optimizer time (report.cc).
std::vector<std::pair<std::string, double>> WallClockBreakdown(double data_s,
                                                               const std::vector<TimelineEvent>& timeline,
                                                               const std::map<std::string, CommunicationTime>& before,
                                                               const std::map<std::string, CommunicationTime>& after,
                                                               double optimizer_s, double step_s);

class Trainer::Impl {
 public:
  TrainerConfig config;  // as given (the layout is the model's plan)
  std::unique_ptr<ParallelModel> model;
  std::unique_ptr<Dataset> train_data, val_data;
  std::unique_ptr<Tokenizer> tokenizer;
  std::unique_ptr<BatchSampler> sampler;
  std::vector<std::shared_ptr<TrainerHooks>> hooks;
  std::unique_ptr<internal::JsonLinesWriter> metrics;
  std::unique_ptr<internal::TensorBoardWriter> tensorboard;
  std::optional<double> last_val_loss;
  std::string model_name;  // the registered type, when built from a config
  int64_t step = 0;
  double peak_flops = 0;  // the job's, in FLOP/s (0: unknown)
  bool progress_bar = false;

  Topology& topology() const { return model->topology(); }
  bool is_rank0() const { return topology().rank() == 0; }
  int64_t global_batch_size() const { return GlobalBatchSize(model->plan()); }
  int64_t epoch() const { return sampler->Epoch(step); }
  TrainerState State() { return TrainerState{config, *model, topology(), step, epoch()}; }
  template <typename Fn>
  void ForHooks(Fn&& fn) {
    for (auto& h : hooks) fn(*h);
  }
  void Print(const std::string& line) const {
    if (!is_rank0()) return;
    std::printf("%s\n", line.c_str());
    std::fflush(stdout);
  }

  // This rank's micro-batches of `step` (empty batches where the model reads no data).
  absl::StatusOr<std::vector<Batch>> MicroBatches(const Dataset& data, const BatchSampler& batches, int64_t step) const;
  absl::StatusOr<double> Evaluate();
  // Mean milliseconds of `steps` forward-backward passes after a warm-up one,
  // updating nothing (the RNG is restored).
  absl::StatusOr<double> DryRun(int steps);
  // Metrics to the JSON lines, TensorBoard and the console (report.cc).
  void Report(const StepMetrics& m, int64_t max_steps);
  // Checkpoints (checkpoints.cc).
  absl::Status LoadInitialWeights(const std::string& path);
  // Copies this rank's state (with async_save to host memory) at the step
  // boundary and writes it, in the background with async_save; every rank
  // calls it. The save before it is finished first (FinishPendingSave).
  absl::Status SaveCheckpoint();
  // Waits for the save in flight, if any: prints it, or applies save_failure
  // (fail: the error; warn: a warning) when some rank could not write it.
  absl::Status FinishPendingSave();
  std::unique_ptr<StoreClient> save_store;  // the background writer's (outlives pending_save)
  std::unique_ptr<PendingSave> pending_save;
  int64_t saves_started = 0;
  std::vector<at::Tensor> snapshot_buffers;  // async_save's host copies, reused by every save
  // Whether some rank received SIGTERM since StopOnSigterm (agreed by all).
  // Called once a step. Between GPUs the flags are reduced behind the step's
  // queued work and read at the next call, so that no step waits for its
  // update to finish: a preemption there ends one step later.
  absl::StatusOr<bool> Preempted();
  PendingScalar preempted_flags;  // the last call's reduction, between GPUs
  absl::Status LoadCheckpoint();
  absl::Status ExportSafetensors(const std::string& path);
  // Every rank's pipeline timeline of this step as Chrome trace JSON and SVG.
  // The pipeline timeline of this step, and `operators` (when given) of every rank, into trace_file.
  absl::Status WriteTrace(const std::vector<internal::OperatorEvent>* operators = nullptr);
};

}  // namespace trident

#endif  // TRIDENT_TRAINER_INTERNAL_TRAINER_IMPL_H_
