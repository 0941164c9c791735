#include "trainer/trainer.h"

#include <malloc.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/cpu_block_cache.h"
#include "base/host_copy.h"
#include "base/memory_counter.h"
#include "base/rng.h"
#include "base/status.h"
#include "trainer/internal/components.h"
#include "trainer/internal/peak_flops.h"
#include "trainer/internal/trainer_impl.h"

namespace trident {
namespace {

namespace fs = std::filesystem;

// Where a run writes its whole resolved configuration: beside its checkpoints
// (save_dir/config.pbtxt) and its metrics (metrics.jsonl: metrics.config.pbtxt).
std::vector<std::string> ResolvedConfigPaths(const TrainerConfig& config) {
  std::vector<std::string> paths;
  if (!config.checkpoint().save_dir().empty()) paths.push_back(config.checkpoint().save_dir() + "/config.pbtxt");
  if (!config.output().metrics_file().empty()) {
    paths.push_back(fs::path(config.output().metrics_file()).replace_extension(".config.pbtxt").string());
  }
  return paths;
}

absl::Status WriteResolvedConfig(const TrainerConfig& config) {
  for (const std::string& path : ResolvedConfigPaths(config)) {
    std::error_code error;
    if (fs::path(path).has_parent_path()) fs::create_directories(fs::path(path).parent_path(), error);
    std::ofstream out(path);
    out << ConfigToText(config);
    out.close();
    if (!out) return absl::InternalError(absl::StrCat("cannot write the run's configuration to ", path));
  }
  return absl::OkStatus();
}

using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// The process's, sections of a strategy search included.
double PeakResidentMb() { return PeakResidentBytes() / 1048576.0; }

// The largest PeakResidentMb of any rank of `world` (every rank calls it).
absl::StatusOr<double> LargestPeakResidentMb(const ProcessGroup& world) {
  at::Tensor peak = at::full({1}, PeakResidentMb(), at::kDouble);
  TRIDENT_RETURN_IF_ERROR(world.AllReduce(peak, ReduceOp::kMax));
  return peak.item<double>();
}

std::string HumanCount(double value) {
  if (value >= 1e9) return absl::StrFormat("%.2fG", value / 1e9);
  if (value >= 1e6) return absl::StrFormat("%.2fM", value / 1e6);
  if (value >= 1e3) return absl::StrFormat("%.1fk", value / 1e3);
  return absl::StrFormat("%.0f", value);
}

}  // namespace

absl::StatusOr<std::vector<Batch>> Trainer::Impl::MicroBatches(const Dataset& data, const BatchSampler& batches,
                                                               int64_t at_step) const {
  const ParallelPlan& plan = model->plan();
  std::vector<Batch> micro(plan.num_micro_batches());
  if (!model->ReadsData()) return micro;
  const ProcessGroup* dp = model->data_parallel_group();
  for (int64_t m = 0; m < plan.num_micro_batches(); ++m) {
    TRIDENT_ASSIGN_OR_RETURN(
        micro[m], data.Get(batches.MicroBatch(at_step, plan.dp(), dp ? dp->rank() : 0, plan.micro_batch_size(), m)));
  }
  return micro;
}

absl::Status Trainer::Preflight(TrainerConfig config, int world_size) {
  TRIDENT_ASSIGN_OR_RETURN(const ParallelPlan plan, ResolveConfig(&config, world_size));
  ModelContext context;
  context.tp = {plan.tp(),
                0,
                "tp",
                plan.tensor_parallel().sequence_parallel(),
                plan.tensor_parallel().parallel_vocab(),
                plan.tensor_parallel().overlapping_level()};
  context.seed = plan.seed();
  TRIDENT_ASSIGN_OR_RETURN(internal::TrainingParts parts, internal::BuildParts(config, context, false));
  TRIDENT_RETURN_IF_ERROR(CheckSource(parts.model, plan));
  for (const std::string& path : {config.checkpoint().init_from(), config.checkpoint().resume_from()}) {
    if (!path.empty() && path != "last" && path != "best" && !fs::exists(path)) {
      return absl::NotFoundError(absl::StrCat(path, " does not exist (init_from / resume_from)"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(TrainerConfig config, Topology* topology) {
  TRIDENT_ASSIGN_OR_RETURN(ParallelPlan plan, ResolveConfig(&config, topology->world_size()));
  if (!config.strategy().search().empty()) {
    TRIDENT_ASSIGN_OR_RETURN(plan, ChooseStrategy(config, std::move(plan), topology));
  }
  return Create(std::move(config), std::move(plan), topology);
}

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(TrainerConfig config, ParallelPlan plan, Topology* topology) {
  TRIDENT_RETURN_IF_ERROR(internal::PrepareDefaultCorpus(config, *topology));
  ModelContext context;
  context.seed = plan.seed();
  if (plan.tp() > 1) {
    TRIDENT_ASSIGN_OR_RETURN(ProcessGroup * tp, topology->Group("tensor"));
    context.tp = {plan.tp(),
                  tp->rank(),
                  tp->name(),
                  plan.tensor_parallel().sequence_parallel(),
                  plan.tensor_parallel().parallel_vocab(),
                  plan.tensor_parallel().overlapping_level()};
  }
  TRIDENT_ASSIGN_OR_RETURN(internal::TrainingParts parts, internal::BuildParts(config, context, true));
  SetStrings(plan.mutable_trace()->mutable_batch_fields(), parts.train_data->field_names());
  std::vector<int64_t> first(plan.micro_batch_size());
  for (int64_t i = 0; i < plan.micro_batch_size(); ++i) first[i] = i % parts.train_data->size();
  TRIDENT_ASSIGN_OR_RETURN(Batch example, parts.train_data->Get(first));
  TRIDENT_ASSIGN_OR_RETURN(std::unique_ptr<ParallelModel> model,
                           Parallelize(std::move(parts.model), plan, topology, example, parts.optimizer));
  // What building freed (ZeRO-3's unsharded copies) goes back to the system
  // rather than staying with the allocator (gpt2-124m, ZeRO-3 at dp2: peak
  // 2,320 -> 2,155 MB per rank).
  ReleaseFreedMemory();
  const std::string name = ModelComponent(config).first;
  TRIDENT_ASSIGN_OR_RETURN(
      auto trainer, Create(std::move(config), TrainerInputs{std::move(model), std::move(parts.train_data),
                                                            std::move(parts.val_data), std::move(parts.tokenizer)}));
  trainer->impl_->model_name = name;
  return trainer;
}

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(TrainerConfig config, TrainerInputs inputs) {
  if (inputs.model == nullptr || inputs.train_data == nullptr) {
    return absl::InvalidArgumentError("Trainer::Create needs a model and training data");
  }
  TRIDENT_RETURN_IF_ERROR(CheckConfigFields(&config));
  auto impl = std::make_unique<Impl>();
  Impl& t = *impl;
  // The model's plan decides the layout and the micro-batching; the config the rest.
  const ParallelPlan& plan = inputs.model->plan();
  t.config = std::move(config);
  t.model = std::move(inputs.model);
  t.train_data = std::move(inputs.train_data);
  t.val_data = std::move(inputs.val_data);
  t.tokenizer = std::move(inputs.tokenizer);
  t.sampler = std::make_unique<BatchSampler>(t.train_data->size(), t.global_batch_size(), t.config.plan().seed(),
                                             t.config.dataset().shuffle());
  if (!t.config.checkpoint().init_from().empty())
    TRIDENT_RETURN_IF_ERROR(t.LoadInitialWeights(t.config.checkpoint().init_from()));
  if (!t.config.checkpoint().resume_from().empty()) TRIDENT_RETURN_IF_ERROR(t.LoadCheckpoint());
  if (t.is_rank0() && !t.config.output().metrics_file().empty()) {
    TRIDENT_ASSIGN_OR_RETURN(t.metrics, internal::JsonLinesWriter::Open(t.config.output().metrics_file(), t.step));
  }
  if (t.is_rank0()) TRIDENT_RETURN_IF_ERROR(WriteResolvedConfig(t.config));
  if (t.is_rank0() && !t.config.output().tensorboard_dir().empty()) {
    TRIDENT_ASSIGN_OR_RETURN(t.tensorboard, internal::TensorBoardWriter::Open(t.config.output().tensorboard_dir()));
  }
  const char* terminal = std::getenv("TRIDENT_STDOUT_IS_TTY");
  t.progress_bar = t.is_rank0() && t.config.output().enable_progress_bar() &&
                   (isatty(STDOUT_FILENO) || (terminal != nullptr && std::string(terminal) == "1"));
  TRIDENT_ASSIGN_OR_RETURN(t.peak_flops, internal::JobPeakFlops(t.topology(), ParallelPlan::Device_Name(plan.device()),
                                                                plan.precision().mode()));
  if (t.is_rank0()) {
    const std::string warning =
        internal::SlowBf16Warning(ParallelPlan::Device_Name(plan.device()), plan.precision().mode());
    if (!warning.empty()) t.Print(warning);
  }
  // Under strategy=auto the search saved its choice (with the run's
  // fingerprint) and dry-ran it.
  const bool searched = !t.config.strategy().search().empty();
  if (t.is_rank0() && !searched && !t.config.strategy().save().empty()) {
    TRIDENT_RETURN_IF_ERROR(SaveStrategy(StrategyFromPlan(plan), t.config.strategy().save()));
  }
  if (!searched && !t.config.strategy().load().empty() && !t.config.strategy().ignore_dryrun_on_load()) {
    TRIDENT_ASSIGN_OR_RETURN(const double ms, t.DryRun(3));
    t.Print(absl::StrFormat("dry run of the loaded strategy (%s): %.0f ms/step", DescribePlan(plan), ms));
  }
  return std::unique_ptr<Trainer>(new Trainer(std::move(impl)));
}

Trainer::Trainer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Trainer::~Trainer() = default;
void Trainer::AddHooks(std::shared_ptr<TrainerHooks> hooks) { impl_->hooks.push_back(std::move(hooks)); }
ParallelModel& Trainer::model() { return *impl_->model; }
const TrainerConfig& Trainer::config() const { return impl_->config; }
int64_t Trainer::step() const { return impl_->step; }
absl::StatusOr<double> Trainer::Evaluate() { return impl_->Evaluate(); }
absl::Status Trainer::ExportSafetensors(const std::string& path) { return impl_->ExportSafetensors(path); }

absl::StatusOr<double> Trainer::Impl::DryRun(int steps) {
  const at::Tensor rng = CpuRngState();
  double seconds = 0;
  for (int s = 0; s <= steps; ++s) {  // the first one warms up
    TRIDENT_ASSIGN_OR_RETURN(std::vector<Batch> batches, MicroBatches(*train_data, *sampler, step + s));
    const auto start = Clock::now();
    model->ZeroGrad();
    TRIDENT_RETURN_IF_ERROR(model->ForwardBackward(batches).status());
    if (s > 0) seconds += Seconds(Clock::now() - start);
  }
  model->ZeroGrad();
  SetCpuRngState(rng);
  return 1000 * seconds / steps;
}

absl::StatusOr<double> Trainer::Impl::Evaluate() {
  if (val_data == nullptr) return absl::NotFoundError("no validation data (val.bin in the data directory)");
  ForHooks([&](TrainerHooks& h) { h.OnValStart(State()); });
  BatchSampler val_sampler(val_data->size(), global_batch_size(), config.plan().seed(), /*shuffle=*/false);
  const int64_t steps = config.loop().max_val_steps() > 0 ? config.loop().max_val_steps() : config.loop().eval_steps();
  double total = 0;
  model->SetTraining(false);
  for (int64_t s = 0; s < steps; ++s) {
    auto batches = MicroBatches(*val_data, val_sampler, s);
    auto loss = batches.ok() ? model->EvaluateLoss(*batches) : batches.status();
    if (!loss.ok()) {
      model->SetTraining(true);
      return loss.status();
    }
    total += *loss;
  }
  model->SetTraining(true);
  last_val_loss = total / steps;
  ForHooks([&](TrainerHooks& h) { h.OnValEnd(State(), *last_val_loss); });
  return *last_val_loss;
}

namespace {

std::atomic<bool> sigterm_watched{false};
volatile std::sig_atomic_t sigterm_received = 0;

void OnSigterm(int) { sigterm_received = 1; }

}  // namespace

void StopOnSigterm() {
  struct sigaction action = {};
  action.sa_handler = OnSigterm;
  sigemptyset(&action.sa_mask);
  sigaction(SIGTERM, &action, nullptr);
  sigterm_watched = true;
}

absl::StatusOr<bool> Trainer::Impl::Preempted() {
  if (!sigterm_watched || !config.runtime().preempt_save()) return false;
  const ProcessGroup& world = topology().world();
  at::Tensor flag = at::full({1}, static_cast<int64_t>(sigterm_received), at::kLong);
  if (world.size() == 1 || world.device().is_cpu()) {
    TRIDENT_RETURN_IF_ERROR(world.AllReduce(flag, ReduceOp::kMax));
    return flag.item<int64_t>() > 0;
  }
  const PendingScalar earlier = std::move(preempted_flags);
  flag = ToDeviceWithoutWaiting(flag, world.device());
  TRIDENT_RETURN_IF_ERROR(world.AllReduce(flag, ReduceOp::kMax));
  preempted_flags = PendingScalar(flag);
  return earlier.defined() && earlier.Get() > 0;
}

absl::StatusOr<TrainResult> Trainer::Train() {
  Impl& t = *impl_;
  const TrainerConfig& c = t.config;
  int64_t max_steps = c.loop().max_steps();
  const ParallelPlan& plan = t.model->plan();
  const int64_t global_batch_size = GlobalBatchSize(plan);
  const int64_t steps_per_epoch = (t.train_data->size() + global_batch_size - 1) / global_batch_size;
  if (c.loop().max_epochs() > 0) max_steps = std::min(max_steps, steps_per_epoch * c.loop().max_epochs());
  TrainResult result;
  result.first_step = t.step;
  if (auto* tokens = dynamic_cast<const TokenDataset*>(t.train_data.get())) {
    result.unigram_entropy = UnigramEntropy(tokens->file());
  }
  const int64_t tokens_per_sample = t.train_data->tokens_per_sample();
  t.Print(absl::StrCat("config (what differs from the defaults; the whole of it in ",
                       ResolvedConfigPaths(c).empty()
                           ? "the checkpoints and metrics when save_dir or metrics_file is set"
                           : absl::StrJoin(ResolvedConfigPaths(c), " and "),
                       "): ", ConfigChangesToText(c)));
  t.Print(absl::StrCat("layout: ", DescribePlan(plan)));
  t.Print(absl::StrCat("per rank: ", t.model->Memory().ToString()));
  t.Print(absl::StrCat("stages:\n", t.model->Describe()));
  if (c.output().tp_plan_report()) return result;
  TRIDENT_ASSIGN_OR_RETURN(const double setup_peak_mb, LargestPeakResidentMb(t.topology().world()));
  t.Print(absl::StrFormat(
      "model%s: %s parameters | data: %d samples%s | %d rank(s), global batch %d (micro %d x "
      "accumulation %d x dp %d) | %d thread(s) per rank, job peak %.1f GFLOP/s | setup's peak RSS %.0f MB (the "
      "largest of any rank)",
      t.model_name.empty() ? "" : " " + t.model_name, HumanCount(t.model->num_parameters()), t.train_data->size(),
      tokens_per_sample > 0 ? absl::StrCat(" of ", tokens_per_sample, " tokens") : "", t.topology().world_size(),
      global_batch_size, plan.micro_batch_size(), plan.num_micro_batches(), plan.dp(), at::get_num_threads(),
      t.peak_flops / 1e9, setup_peak_mb));
  // ZeRO-3 on the CPU gathers and frees the same large tensors layer after
  // layer: from the first step on they come from the block cache. Not during
  // setup: a deferred build allocates the model untouched and draws it layer
  // by layer, and the cache would keep every drawn layer's freed blocks.
  if (plan.zero().stage() == 3 && t.topology().world().device().is_cpu()) InstallCpuBlockCache();
  t.ForHooks([&](TrainerHooks& h) { h.OnTrainStart(t.State()); });
  const auto start = Clock::now();
  int64_t offload_written = 0, offload_read = 0;  // by the training steps (not evaluation)
  const double samples_per_step = static_cast<double>(global_batch_size);
  while (t.step < max_steps) {
    const int64_t epoch = t.epoch();
    if (t.step == result.first_step || t.sampler->Epoch(t.step - 1) != epoch) {
      t.ForHooks([&](TrainerHooks& h) { h.OnEpochStart(t.State()); });
    }
    t.ForHooks([&](TrainerHooks& h) { h.OnStepStart(t.State()); });
    const auto step_start = Clock::now();
    const MemoryReport step_memory = t.model->Memory();
    const bool breakdown = c.output().wall_clock_breakdown();
    const auto communication = breakdown ? CommunicationTimes() : std::map<std::string, CommunicationTime>();
    TRIDENT_ASSIGN_OR_RETURN(std::vector<Batch> batches, t.MicroBatches(*t.train_data, *t.sampler, t.step));
    const double data_s = Seconds(Clock::now() - step_start);
    const bool profiled = t.step + 1 == c.output().profile_step();
    if (profiled) {  // every rank starts the profiled step together
      TRIDENT_RETURN_IF_ERROR(t.topology().world().Barrier());
      TRIDENT_RETURN_IF_ERROR(internal::StartOperatorRecording(t.model->plan().device() == ParallelPlan::cuda));
    }
    t.ForHooks([&](TrainerHooks& h) { h.BeforeZeroGrad(t.State()); });
    t.model->ZeroGrad();
    t.ForHooks([&](TrainerHooks& h) { h.AfterZeroGrad(t.State()); });
    StepMetrics m;
    PendingScalar loss;
    {
      RECORD_USER_SCOPE(internal::kForwardBackwardScope);
      TRIDENT_ASSIGN_OR_RETURN(loss, t.model->ForwardBackwardWithoutWaiting(batches));
    }
    if (!c.output().trace_file().empty() && t.step + 1 == c.output().trace_step() && !profiled)
      TRIDENT_RETURN_IF_ERROR(t.WriteTrace());
    const auto read_loss = [&]() -> absl::Status {
      m.loss = loss.Get();
      if (std::isfinite(m.loss)) return absl::OkStatus();
      return absl::InternalError(
          absl::StrCat("the loss became ", m.loss, " at step ", t.step + 1, "; lower lr or raise warmup_steps"));
    };
    // On a GPU the loss is read once the update is queued (reading it waits
    // for the backward), unless hooks want it before; the CPU's is ready, and
    // a non-finite loss then stops training before the update.
    const bool read_loss_late = t.hooks.empty() && t.model->plan().device() == ParallelPlan::cuda;
    if (!read_loss_late) TRIDENT_RETURN_IF_ERROR(read_loss());
    t.ForHooks([&](TrainerHooks& h) { h.AfterBackward(t.State()); });
    t.ForHooks([&](TrainerHooks& h) { h.AfterAggregateTrainStepOutputs(t.State(), m.loss); });
    const int64_t decay_steps = c.loop().lr_decay_steps() > 0 ? c.loop().lr_decay_steps() : max_steps;
    TRIDENT_ASSIGN_OR_RETURN(m.lr, LearningRate(c.loop().lr_scheduler(), c.loop().lr(), c.loop().min_lr(),
                                                c.loop().warmup_steps(), decay_steps, t.step));
    m.loss_scale = t.model->loss_scale().value_or(1.0);
    const auto optimizer_start = Clock::now();
    TRIDENT_ASSIGN_OR_RETURN(m.skipped, t.model->UnscaleGradients());
    if (m.skipped) {  // every rank skips: weights and optimizer state stay as they were
      m.grad_norm = std::numeric_limits<double>::quiet_NaN();
      t.Print(
          absl::StrFormat("step %d: inf or NaN gradients on some rank; skipped the update, "
                          "loss scale %g -> %g",
                          t.step + 1, m.loss_scale, t.model->loss_scale().value_or(1.0)));
    } else {
      t.ForHooks([&](TrainerHooks& h) { h.BeforeGnormClip(t.State()); });
      TRIDENT_ASSIGN_OR_RETURN(PendingScalar grad_norm,
                               t.model->ClipGradNormWithoutWaiting(c.optimizer().clip_gnorm()));
      // Read once the update is queued (on a GPU reading it waits for the
      // backward), unless hooks want it before.
      if (!t.hooks.empty()) m.grad_norm = grad_norm.Get();
      t.ForHooks([&](TrainerHooks& h) { h.AfterGnormClip(t.State(), m.grad_norm); });
      t.ForHooks([&](TrainerHooks& h) { h.BeforeOptimizerStep(t.State()); });
      TRIDENT_RETURN_IF_ERROR(t.model->Step(m.lr));
      m.grad_norm = grad_norm.Get();
    }
    if (read_loss_late) TRIDENT_RETURN_IF_ERROR(read_loss());
    const double optimizer_s = Seconds(Clock::now() - optimizer_start);
    if (profiled) {
      TRIDENT_ASSIGN_OR_RETURN(std::vector<internal::OperatorEvent> operators,
                               internal::StopOperatorRecording(internal::kForwardBackwardScope));
      TRIDENT_RETURN_IF_ERROR(t.WriteTrace(&operators));
      t.Print(
          absl::StrCat("operators of step ", t.step + 1, " on rank 0:\n", internal::OperatorBreakdown(operators, 15)));
    }
    ++t.step;
    t.ForHooks([&](TrainerHooks& h) { h.AfterOptimizerStep(t.State()); });
    const double seconds = Seconds(Clock::now() - step_start);
    const MemoryReport stepped = t.model->Memory();
    offload_written += stepped.offload_bytes_written - step_memory.offload_bytes_written;
    offload_read += stepped.offload_bytes_read - step_memory.offload_bytes_read;
    m.step = t.step;
    m.step_time_ms = 1000 * seconds;
    if (breakdown) {
      m.wall_clock_ms =
          WallClockBreakdown(data_s, t.model->timeline(), communication, CommunicationTimes(), optimizer_s, seconds);
    }
    m.elapsed_s = Seconds(Clock::now() - start);
    const double samples_per_s = samples_per_step / seconds;
    m.tokens_per_s = samples_per_s * std::max<int64_t>(1, tokens_per_sample);
    m.mfu = t.peak_flops > 0 ? t.model->flops_per_sample() * samples_per_s / t.peak_flops : 0;
    result.losses.push_back(m.loss);
    t.ForHooks([&](TrainerHooks& h) { h.OnStepEnd(t.State(), m); });
    t.ForHooks([&](TrainerHooks& h) { h.BeforeLogTrainMetrics(t.State(), m); });
    t.Report(m, max_steps);
    const bool last = t.step == max_steps;
    const bool epoch_done = t.step == max_steps || t.epoch() != epoch;
    if (epoch_done) t.ForHooks([&](TrainerHooks& h) { h.OnEpochEnd(t.State()); });
    const bool validate =
        (c.loop().eval_every() > 0 && t.step % c.loop().eval_every() == 0) ||
        (epoch_done && c.loop().val_every_n_epochs() > 0 && (epoch + 1) % c.loop().val_every_n_epochs() == 0);
    if (validate && !last && t.val_data) {
      TRIDENT_ASSIGN_OR_RETURN(const double val_loss, t.Evaluate());
      t.Print(absl::StrFormat("step %d | val_loss %.4f", t.step, val_loss));
    }
    if (!c.checkpoint().save_dir().empty() &&
        ((c.checkpoint().save_every() > 0 && t.step % c.checkpoint().save_every() == 0) || last)) {
      if (last && t.val_data) {
        TRIDENT_ASSIGN_OR_RETURN(result.val_loss, t.Evaluate());
      }
      TRIDENT_RETURN_IF_ERROR(t.SaveCheckpoint());
    }
    if (!c.checkpoint().export_safetensors().empty() && c.checkpoint().export_every() > 0 &&
        t.step % c.checkpoint().export_every() == 0) {
      TRIDENT_RETURN_IF_ERROR(t.ExportSafetensors(c.checkpoint().export_safetensors()));
    }
    TRIDENT_ASSIGN_OR_RETURN(result.preempted, t.Preempted());
    if (result.preempted && !last) {
      const bool saved_now = !c.checkpoint().save_dir().empty() && c.checkpoint().save_every() > 0 &&
                             t.step % c.checkpoint().save_every() == 0;
      if (!c.checkpoint().save_dir().empty() && !saved_now) TRIDENT_RETURN_IF_ERROR(t.SaveCheckpoint());
      TRIDENT_RETURN_IF_ERROR(t.FinishPendingSave());
      t.Print(absl::StrCat("preempted (SIGTERM) after step ", t.step,
                           c.checkpoint().save_dir().empty() ? "; no save_dir, nothing saved" : "; checkpoint saved",
                           "; exiting"));
      return result;
    }
  }
  TRIDENT_RETURN_IF_ERROR(t.FinishPendingSave());
  if (!result.val_loss && t.val_data) {
    TRIDENT_ASSIGN_OR_RETURN(result.val_loss, t.Evaluate());
  }
  if (result.val_loss) {
    t.Print(
        absl::StrFormat("validation loss %.4f%s", *result.val_loss,
                        result.unigram_entropy > 0
                            ? absl::StrFormat(" nats/token (unigram entropy of the data %.4f)", result.unigram_entropy)
                            : ""));
  }
  const int64_t sample_tokens =
      c.generation().text_generation() ? c.generation().out_seq_length() : c.generation().sample_tokens();
  if (sample_tokens > 0 && t.model->source().returns_logits) {
    const auto sampling_start = Clock::now();
    TRIDENT_ASSIGN_OR_RETURN(result.sample, Sample(c.generation().prompt(), sample_tokens));
    t.Print(absl::StrFormat(
        "sample (temperature %g, top_k %d, %d tokens in %.2f s%s):\n%s", c.generation().temperature(),
        c.generation().top_k(), sample_tokens, Seconds(Clock::now() - sampling_start),
        c.generation().kv_cache() && t.model->layers().SupportsDecoding() ? ", key/value cache" : "", result.sample));
  } else if (sample_tokens > 0) {
    t.Print("sample: skipped (sampling needs a model whose outputs are next-token logits, such as the zoo's)");
  }
  if (!c.checkpoint().export_safetensors().empty())
    TRIDENT_RETURN_IF_ERROR(t.ExportSafetensors(c.checkpoint().export_safetensors()));
  TRIDENT_ASSIGN_OR_RETURN(const double peak_mb, LargestPeakResidentMb(t.topology().world()));
  const int64_t steps = t.step - result.first_step;
  std::string memory_details;
  if (offload_written > 0 && steps > 0) {
    memory_details = absl::StrFormat(" | offload files: %.1f MB written, %.1f MB read per step on rank %d",
                                     offload_written / 1e6 / steps, offload_read / 1e6 / steps, t.topology().rank());
  }
  // ZeRO's working set beside its state: this rank's peak, taken apart (the
  // working set at its largest need not coincide with the peak, so the rest
  // is at least what is left).
  const MemoryReport memory = t.model->Memory();
  if (memory.peak_gathered_bytes + memory.peak_gradients_in_flight_bytes > 0) {
    constexpr double kMiB = 1048576.0;
    const double mine = PeakResidentMb(), state = (memory.total() - memory.gradient_scratch_bytes) / kMiB;
    const double gathered = memory.peak_gathered_bytes / kMiB, in_flight = memory.peak_gradients_in_flight_bytes / kMiB;
    memory_details += absl::StrFormat(
        " | rank %d's peak %.0f MiB: state %.0f, working set at its largest %.0f (gathered parameters %.0f, "
        "gradients in flight %.0f), the rest (activations, allocator, process) at least %.0f",
        t.topology().rank(), mine, state, gathered + in_flight, gathered, in_flight,
        mine - state - gathered - in_flight);
  }
  t.Print(absl::StrFormat("done: %d steps in %s | peak RSS %.0f MB (the largest of any rank)%s", steps,
                          internal::FormatDuration(Seconds(Clock::now() - start)), peak_mb, memory_details));
  t.ForHooks([&](TrainerHooks& h) { h.OnTrainEnd(t.State()); });
  return result;
}

void TuneAllocatorForTraining(bool sharded_parameters) {
  mallopt(M_MMAP_THRESHOLD, sharded_parameters ? 1 << 20 : 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
}

}  // namespace trident
