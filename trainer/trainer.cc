#include "trainer/trainer.h"

#include <malloc.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <thread>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/logging.h"
#include "base/status.h"
#include "checkpoint/checkpoint.h"
#include "data/data.h"
#include "partition/partition.h"
#include "pipeline/pipeline.h"
#include "pipeline/stage_runner.h"
#include "trainer/internal/metrics.h"
#include "trainer/internal/optimizer.h"
#include "trainer/internal/parameter_update.h"
#include "amp/amp.h"

namespace trident {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

double PeakResidentMb() {
  struct rusage usage;
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss / 1024.0;
}

// Dense matrix-product throughput of this process's threads, in FLOP/s.
double MeasurePeakFlops() {
  at::NoGradGuard no_grad;
  const int64_t n = 512;
  // Constant inputs: drawing random ones would advance the training RNG.
  auto a = at::full({n, n}, 0.5), b = at::full({n, n}, 0.25), c = at::empty({n, n});
  at::mm_out(c, a, b);  // warm up
  int64_t products = 0;
  const auto start = Clock::now();
  while (Seconds(Clock::now() - start) < 0.25) {
    at::mm_out(c, a, b);
    ++products;
  }
  return 2.0 * n * n * n * products / Seconds(Clock::now() - start);
}

std::string HumanCount(double value) {
  if (value >= 1e9) return absl::StrFormat("%.2fG", value / 1e9);
  if (value >= 1e6) return absl::StrFormat("%.2fM", value / 1e6);
  if (value >= 1e3) return absl::StrFormat("%.1fk", value / 1e3);
  return absl::StrFormat("%.0f", value);
}

std::string DefaultDataDirectory() {
  const char* home = std::getenv("HOME");
  return absl::StrCat(home != nullptr ? home : "/tmp", "/.cache/trident/data/fortunes-byte");
}

}  // namespace

class Trainer::Impl {
 public:
  TrainerConfig config;
  Topology* topology = nullptr;
  ProcessGroup* dp_group = nullptr;
  int dp_rank = 0;
  bool is_rank0 = false;
  // The stage runner, used with pp > 1 or recomputation: this rank is pipeline
  // stage `stage` of `stages` and holds the model chunks `chunks` (one, or
  // virtual_stages for interleaved schedules).
  ProcessGroup* pp_group = nullptr;
  int stage = 0, stages = 1;
  std::vector<StageChunk> chunks;
  std::unique_ptr<PipelineSchedule> schedule;
  std::unique_ptr<PipelineStageRunner> runner;
  NamedTensors tied;                       // parameters the first and last stage both hold
  // Tensor parallelism: the group, and the parameters every tp rank holds whole
  // (with sequence parallelism their gradients are partial until summed).
  ProcessGroup* tp_group = nullptr;
  std::vector<at::Tensor> replicated_parameters;
  // The gradient norm: each stored value counted once (tied copies and tp
  // replicas excluded), summed over `norm_group` (tensor x pipeline ranks).
  std::vector<at::Tensor> counted_parameters;
  ProcessGroup* norm_group = nullptr;
  ModelConfig model_config;
  std::shared_ptr<LanguageModel> model;
  NamedTensors parameters;  // stored parameters, tied ones once
  std::unique_ptr<internal::ParameterUpdate> update;  // data-parallel reduction and optimizer
  PrecisionPolicy precision;
  std::optional<LossScaler> scaler;  // with loss scaling
  std::unique_ptr<TokenFile> train_data, val_data;
  std::unique_ptr<Tokenizer> tokenizer;
  std::unique_ptr<BatchSampler> sampler;
  std::vector<std::shared_ptr<TrainerHooks>> hooks;
  std::unique_ptr<internal::JsonLinesWriter> metrics;
  std::unique_ptr<internal::TensorBoardWriter> tensorboard;
  std::optional<double> last_val_loss;
  int64_t step = 0;
  double peak_flops = 0;
  double flops_per_token = 0;
  int64_t num_parameters = 0;  // this rank's, tied ones once
  bool progress_bar = false;

  TrainerState State() { return TrainerState{config, *model, *topology, step}; }

  template <typename Fn>
  void ForHooks(Fn&& fn) {
    for (auto& h : hooks) fn(*h);
  }

  void Print(const std::string& line) {
    if (!is_rank0) return;
    std::printf("%s\n", line.c_str());
    std::fflush(stdout);
  }

  absl::Status OpenData();
  absl::Status BuildStage();
  // Tied parameters, tensor-parallel replicas and what the gradient norm counts.
  void ClassifyParameters();
  void StartRunner();
  void MicroBatches(const TokenFile& file, const BatchSampler& batches, int64_t step,
                    std::vector<at::Tensor>* inputs, std::vector<at::Tensor>* targets);
  absl::StatusOr<double> PipelineLoss(double last_stage_loss);
  absl::Status WriteTrace();
  absl::Status LoadInitialWeights(const std::string& path);
  absl::Status SaveCheckpoint();
  absl::Status LoadCheckpoint();
  absl::StatusOr<double> TrainStep();
  // The logits of `tokens` [1, T] through every stage without gradients (this
  // rank's vocabulary slice with tensor parallelism): defined on the last
  // pipeline stage, undefined elsewhere. Throws on communication errors.
  at::Tensor PipelinedLogits(const at::Tensor& tokens);
  // Whether any rank's gradients hold inf or NaN (every rank gets the same answer).
  absl::StatusOr<bool> GradientsOverflowed();
  absl::StatusOr<double> Evaluate();
  void Report(const StepMetrics& m, int64_t max_steps);
};

absl::Status Trainer::Impl::OpenData() {
  std::string dir = config.data();
  if (dir.empty()) {
    dir = DefaultDataDirectory();
    if (is_rank0 && !fs::exists(dir + "/train.bin")) {
      Print(absl::StrCat("preparing the default corpus (Debian's fortunes, byte tokens) in ", dir));
      // Written aside and renamed, so a concurrent run never reads half a file.
      PrepareOptions options;
      options.output_dir = absl::StrCat(dir, ".tmp-", getpid());
      TRIDENT_RETURN_IF_ERROR(PrepareTextCorpus(options).status());
      std::error_code error;
      fs::rename(options.output_dir, dir, error);
      if (error) fs::remove_all(options.output_dir, error);  // another run got there first
    }
    TRIDENT_RETURN_IF_ERROR(topology->world().Barrier());
  }
  int vocab = 256;
  if (fs::exists(dir + "/tokenizer.txt")) {
    TRIDENT_ASSIGN_OR_RETURN(tokenizer, LoadTokenizer(dir + "/tokenizer.txt"));
    vocab = tokenizer->vocab_size();
  }
  TRIDENT_ASSIGN_OR_RETURN(model_config, ResolveModelConfig(config, vocab));
  TRIDENT_ASSIGN_OR_RETURN(train_data, TokenFile::Open(dir + "/train.bin", model_config.vocab_size,
                                                       model_config.block_size));
  if (fs::exists(dir + "/val.bin")) {
    TRIDENT_ASSIGN_OR_RETURN(val_data, TokenFile::Open(dir + "/val.bin", model_config.vocab_size,
                                                       model_config.block_size));
  }
  sampler = std::make_unique<BatchSampler>(train_data->num_samples(), config.global_batch_size(),
                                           config.seed(), config.shuffle());
  return absl::OkStatus();
}

absl::Status Trainer::Impl::LoadInitialWeights(const std::string& path) {
  TRIDENT_ASSIGN_OR_RETURN(SafetensorsContents contents, ReadSafetensors(path));
  at::NoGradGuard no_grad;
  std::vector<std::string> missing;
  const auto shards = model->ParameterShards();
  for (auto& [name, parameter] : parameters) {
    auto saved = contents.Get(name);
    if (!saved.ok()) {
      missing.push_back(name);
      continue;
    }
    auto shard = shards.find(name);
    if (shard != shards.end()) {  // the file holds the whole tensor; keep this rank's slice
      auto shape = shard->second.ShardShape(saved->sizes().vec());
      if (shape.ok() && at::IntArrayRef(*shape).equals(parameter.sizes())) {
        saved = shard->second.Slice(*saved);
      }
    }
    if (!saved->sizes().equals(parameter.sizes())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "init_from ", path, ": tensor '", name, "' has shape ", c10::str(saved->sizes()),
          " but the model's parameter is ", c10::str(parameter.sizes()),
          "; the file is for another model size"));
    }
    parameter.copy_(*saved);
  }
  if (!missing.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("init_from ", path, " lacks ", missing.size(),
                                                   " parameter(s) of the model: ",
                                                   absl::StrJoin(missing, ", ")));
  }
  return absl::OkStatus();
}

absl::Status Trainer::Impl::SaveCheckpoint() {
  CheckpointDirectory directory(config.save_dir());
  TRIDENT_ASSIGN_OR_RETURN(const std::string staging, directory.StagingPath(step));
  NamedTensors tensors;
  TRIDENT_RETURN_IF_ERROR(update->GatherFullParameters());
  for (const auto& [name, p] : parameters) tensors.emplace_back("model/" + name, p);
  for (auto& [name, t] : update->State()) tensors.emplace_back("optimizer/" + name, t);
  if (scaler) {
    for (auto& item : scaler->State()) tensors.push_back(item);
  }
  {
    at::Generator generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    tensors.emplace_back("rng/cpu", generator.get_state());
  }
  TRIDENT_RETURN_IF_ERROR(WriteSafetensors(
      absl::StrCat(staging, "/rank_", topology->rank(), ".safetensors"), tensors,
      {{"step", absl::StrCat(step)}, {"rank", absl::StrCat(topology->rank())}}));
  TRIDENT_RETURN_IF_ERROR(update->ReleaseFullParameters(/*keep_changes=*/false));
  if (is_rank0) {
    std::ofstream(staging + "/config.pbtxt") << ConfigToText(config);
  }
  TRIDENT_RETURN_IF_ERROR(topology->world().Barrier());
  if (is_rank0) {
    TRIDENT_RETURN_IF_ERROR(
        directory.Commit(step, topology->world_size(), last_val_loss, config.keep_last_n()));
  }
  TRIDENT_RETURN_IF_ERROR(topology->world().Barrier());
  const std::string path = absl::StrCat(config.save_dir(), "/step_", step);
  Print(absl::StrCat("saved checkpoint ", path));
  ForHooks([&](TrainerHooks& h) { h.OnSaveCheckpoint(State(), path); });
  return absl::OkStatus();
}

absl::Status Trainer::Impl::LoadCheckpoint() {
  CheckpointDirectory directory(config.save_dir());
  auto resolved = directory.Resolve(config.resume_from());
  if (!resolved.ok()) {
    const bool nothing_saved_yet = config.resume_from() == "last" &&
                                   absl::IsNotFound(resolved.status()) &&
                                   !fs::exists(config.save_dir() + "/last");
    if (!nothing_saved_yet) return resolved.status();
    Print(absl::StrCat("no checkpoint in ", config.save_dir(), " yet; starting from step 0"));
    return absl::OkStatus();
  }
  for (const std::string& reason : resolved->skipped) {
    Print(absl::StrCat("resume_from=last: skipping an invalid checkpoint: ", reason));
  }
  if (resolved->manifest.world_size() != topology->world_size()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint ", resolved->path, " was written by ", resolved->manifest.world_size(),
        " ranks but this run has ", topology->world_size(),
        "; resume with the same layout (resharding across layouts is not available yet)"));
  }
  const std::string file = absl::StrCat(resolved->path, "/rank_", topology->rank(), ".safetensors");
  TRIDENT_ASSIGN_OR_RETURN(SafetensorsContents contents, ReadSafetensors(file));
  TRIDENT_RETURN_IF_ERROR(update->GatherFullParameters());
  {
    at::NoGradGuard no_grad;
    for (auto& [name, parameter] : parameters) {
      TRIDENT_ASSIGN_OR_RETURN(at::Tensor saved, contents.Get("model/" + name));
      if (!saved.sizes().equals(parameter.sizes())) {
        return absl::InvalidArgumentError(absl::StrCat("checkpoint ", file, ": '", name,
                                                       "' has shape ", c10::str(saved.sizes()),
                                                       ", the model needs ",
                                                       c10::str(parameter.sizes())));
      }
      parameter.copy_(saved);
    }
  }
  TRIDENT_RETURN_IF_ERROR(update->ReleaseFullParameters(/*keep_changes=*/true));
  SafetensorsContents optimizer_state;
  optimizer_state.path = file;
  for (const auto& [name, t] : contents.tensors) {
    if (name.rfind("optimizer/", 0) == 0) optimizer_state.tensors.emplace_back(name.substr(10), t);
  }
  TRIDENT_RETURN_IF_ERROR(update->LoadState(optimizer_state));
  if (scaler) TRIDENT_RETURN_IF_ERROR(scaler->LoadState(contents.tensors));
  TRIDENT_ASSIGN_OR_RETURN(at::Tensor rng, contents.Get("rng/cpu"));
  {
    at::Generator generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(rng);
  }
  step = resolved->manifest.step();
  if (resolved->manifest.has_val_loss()) last_val_loss = resolved->manifest.val_loss();
  Print(absl::StrCat("resumed from ", resolved->path, " at step ", step));
  ForHooks([&](TrainerHooks& h) { h.OnLoadCheckpoint(State(), resolved->path); });
  return absl::OkStatus();
}

absl::Status Trainer::Impl::BuildStage() {
  pp_group = *topology->Group("pp");
  stage = pp_group->rank();
  stages = pp_group->size();
  const int64_t layers = model_config.n_layer + 2;
  PartitionOptions options;
  options.num_stages = stages * config.virtual_stages();
  options.partition_method = config.partition_method();
  if (!config.custom_split_points().empty()) {
    options.custom_split_points = absl::StrSplit(config.custom_split_points(), ',');
  }
  std::vector<LayerProfile> profile;
  if (options.partition_method == "uniform" || options.partition_method == "uniform_floor" ||
      !options.custom_split_points.empty()) {
    // Only the layer names are needed: any one-layer part knows them all.
    const int64_t probe = std::min<int64_t>(1, layers - 1);  // a block: smaller than the embedding
    TRIDENT_ASSIGN_OR_RETURN(auto namer,
                             CreateModelLayers(model_config, config.seed(), probe, probe + 1));
    for (int64_t i = 0; i < layers; ++i) profile.push_back({namer->LayerName(i)});
  } else {
    // Memory-light: one layer at a time, on one sample.
    at::Tensor sample = at::zeros({1, model_config.block_size}, at::kLong);
    TRIDENT_ASSIGN_OR_RETURN(
        profile, ProfileLayersOneByOne(
                     layers,
                     [&](int64_t i) -> absl::StatusOr<std::shared_ptr<LayerSequence>> {
                       TRIDENT_ASSIGN_OR_RETURN(auto part,
                                                CreateModelLayers(model_config, config.seed(), i, i + 1));
                       return std::shared_ptr<LayerSequence>(part);
                     },
                     sample));
  }
  TRIDENT_ASSIGN_OR_RETURN(Plan plan, PlanStages(profile, options));
  LayerRanges ranges;
  for (int c = 0; c < config.virtual_stages(); ++c) {  // chunk c is virtual stage c * pp + stage
    const auto& planned = plan.stages(c * stages + stage);
    chunks.push_back({planned.first_layer(), planned.end_layer()});
    ranges.emplace_back(planned.first_layer(), planned.end_layer());
  }
  TRIDENT_ASSIGN_OR_RETURN(model, CreateModelLayers(model_config, config.seed(), ranges));
  TRIDENT_ASSIGN_OR_RETURN(schedule, MakeSchedule(config.schedule(), config.virtual_stages()));
  return absl::OkStatus();
}

void Trainer::Impl::ClassifyParameters() {
  for (const auto& [alias, owner] : model->TiedParameters()) {
    for (const auto& [name, p] : parameters) {
      if (name == owner && stages > 1 && (stage == 0 || stage == stages - 1)) tied.emplace_back(name, p);
    }
  }
  const auto shards = model->ParameterShards();
  for (const auto& [name, p] : parameters) {
    const bool duplicate = stage == stages - 1 && stages > 1 &&
                           std::any_of(tied.begin(), tied.end(),
                                       [&](const auto& t) { return t.first == name; });
    const bool replicated = !shards.count(name);
    if (replicated) replicated_parameters.push_back(p);
    if (!duplicate && (!replicated || tp_group == nullptr || tp_group->rank() == 0)) {
      counted_parameters.push_back(p);
    }
  }
}

void Trainer::Impl::StartRunner() {
  if (stages == 1 && config.activation_checkpointing() == "none") return;
  StageRunnerOptions options;
  options.checkpoint_num_layers = config.checkpoint_num_layers();
  // Checkpointing per chunk, by its virtual stage v of V = pp * virtual_stages.
  const int V = stages * static_cast<int>(chunks.size());
  for (size_t c = 0; c < chunks.size(); ++c) {
    StageChunk& chunk = chunks[c];
    const int v = static_cast<int>(c) * stages + stage;
    const int64_t layers = chunk.end_layer - chunk.first_layer;
    if (config.activation_checkpointing() == "full") {
      chunk.checkpointed_layers = layers;
    } else if (config.activation_checkpointing() == "stage_aware" && v < V - 1) {
      const double r0 = config.activation_checkpoint_ratio();
      const int s = v + 1;  // 1-based, as the formula is written
      const double fraction = 1.0 - (1.0 - r0) * (V - 1) / (V - s);
      chunk.checkpointed_layers = std::clamp<int64_t>(std::llround(fraction * layers), 0, layers);
    }
    if (v == V - 1 && !schedule->RecomputesOnLastStage()) chunk.checkpointed_layers = 0;
  }
  options.chunks = chunks;
  // With sequence parallelism stages exchange sequence shards.
  const int64_t sequence = model_config.block_size / (config.sequence_parallel() ? config.tp() : 1);
  options.boundary_shape = {config.micro_batch_size(), sequence, model_config.n_embd};
  options.reduce_tied_grads = [this] { return ReduceTiedGradients(tied, *pp_group); };
  options.reduce_data_parallel_grads = [this] { return update->FinishBackward(); };
  options.loss_scale = [this] { return scaler ? scaler->scale() : 1.0; };
  runner = std::make_unique<PipelineStageRunner>(*model, *pp_group, *schedule, options);
}

// The micro-batches of this data-parallel rank at `step` of `file` (empty on
// middle pipeline stages, which read no data).
void Trainer::Impl::MicroBatches(const TokenFile& file, const BatchSampler& batches, int64_t step,
                                 std::vector<at::Tensor>* inputs, std::vector<at::Tensor>* targets) {
  inputs->clear();
  targets->clear();
  if (stages > 1 && stage != 0 && stage != stages - 1) return;
  for (int64_t micro = 0; micro < config.grad_accumulation_steps(); ++micro) {
    at::Tensor x, y;
    file.Fill(batches.MicroBatch(step, config.dp(), dp_rank, config.micro_batch_size(), micro), &x, &y);
    inputs->push_back(x);
    targets->push_back(y);
  }
}

// Every rank writes its timeline beside trace_file; rank 0 merges them into the
// Chrome trace and the SVG picture, one row per rank.
absl::Status Trainer::Impl::WriteTrace() {
  const std::string part = absl::StrCat(config.trace_file(), ".rank", topology->rank());
  std::error_code error;
  const fs::path parent = fs::path(config.trace_file()).parent_path();
  if (!parent.empty()) fs::create_directories(parent, error);
  {
    std::ofstream out(part);
    out.precision(9);
    for (const TimelineEvent& e : runner->timeline()) {
      out << static_cast<int>(e.op) << " " << e.micro_batch << " " << e.chunk << " " << e.start
          << " " << e.end << "\n";
    }
  }
  TRIDENT_RETURN_IF_ERROR(topology->world().Barrier());
  if (is_rank0) {
    std::vector<TimelineEvent> events;
    for (int rank = 0; rank < topology->world_size(); ++rank) {
      const std::string path = absl::StrCat(config.trace_file(), ".rank", rank);
      std::ifstream in(path);
      TimelineEvent e;
      int op;
      while (in >> op >> e.micro_batch >> e.chunk >> e.start >> e.end) {
        e.stage = rank;
        e.op = static_cast<Op>(op);
        events.push_back(e);
      }
      fs::remove(path, error);
    }
    std::ofstream(config.trace_file()) << ChromeTraceJson(events);
    std::ofstream(fs::path(config.trace_file()).replace_extension(".svg"))
        << TimelineSvg(events, absl::StrCat(config.schedule(), ", step ", config.trace_step(), ", ",
                                            topology->world_size(), " ranks (row = rank)"));
    Print(absl::StrCat("wrote the timeline of step ", config.trace_step(), " to ",
                       config.trace_file()));
  }
  return topology->world().Barrier();
}

// The last stage's loss on every rank of the pipeline, averaged over data parallelism.
absl::StatusOr<double> Trainer::Impl::PipelineLoss(double last_stage_loss) {
  at::Tensor loss = at::full({1}, stage == stages - 1 ? last_stage_loss : 0.0, at::kDouble);
  TRIDENT_RETURN_IF_ERROR(pp_group->Broadcast(loss, stages - 1));
  TRIDENT_RETURN_IF_ERROR(dp_group->AllReduce(loss, ReduceOp::kAvg));
  return loss.item<double>();
}

absl::StatusOr<double> Trainer::Impl::TrainStep() {
  const int64_t accumulation = config.grad_accumulation_steps();
  std::vector<at::Tensor> inputs, targets;
  MicroBatches(*train_data, *sampler, step, &inputs, &targets);
  update->ZeroGrad();
  if (runner) {
    if (inputs.empty()) inputs.assign(accumulation, at::Tensor());
    update->PrepareForBackward(/*last_micro_batch=*/false);
    AutocastScope autocast(precision, c10::DeviceType::CPU);
    TRIDENT_ASSIGN_OR_RETURN(const double loss, runner->RunStep(inputs, targets));
    if (!config.trace_file().empty() && step + 1 == config.trace_step()) {
      TRIDENT_RETURN_IF_ERROR(WriteTrace());
    }
    return PipelineLoss(loss);
  }
  double local_loss = 0;
  for (int64_t micro = 0; micro < accumulation; ++micro) {
    update->PrepareForBackward(micro == accumulation - 1);
    TRIDENT_RETURN_IF_ERROR(CatchExceptions(absl::StrCat("step ", step + 1), [&] {
      at::Tensor loss;
      {
        AutocastScope autocast(precision, c10::DeviceType::CPU);
        loss = model->Loss(inputs[micro], targets[micro]).div(static_cast<double>(accumulation));
      }
      (scaler ? loss * scaler->scale() : loss).backward();
      local_loss += loss.item<double>();
    }));
  }
  TRIDENT_RETURN_IF_ERROR(update->FinishBackward());
  at::Tensor loss = at::full({1}, local_loss, at::kDouble);
  TRIDENT_RETURN_IF_ERROR(dp_group->AllReduce(loss, ReduceOp::kAvg));
  return loss.item<double>();
}

at::Tensor Trainer::Impl::PipelinedLogits(const at::Tensor& tokens) {
  if (stages == 1) return model->Logits(tokens);
  // Virtual stage v is chunk v / stages of pipeline rank v % stages.
  const int virtual_stages = stages * static_cast<int>(chunks.size());
  const int64_t sequence = tokens.size(1) / (config.sequence_parallel() ? config.tp() : 1);
  at::Tensor x;
  for (int v = 0; v < virtual_stages; ++v) {
    if (v % stages != stage) continue;
    if (v == 0) {
      x = tokens;
    } else {
      x = at::empty({1, sequence, model_config.n_embd}, at::TensorOptions().dtype(precision.param));
      absl::Status received = pp_group->Recv(x, (stage + stages - 1) % stages, v);
      TORCH_CHECK(received.ok(), std::string(received.message()));
    }
    const StageChunk& chunk = chunks[v / stages];
    for (int64_t i = chunk.first_layer; i < chunk.end_layer; ++i) x = model->RunLayer(i, x);
    if (v + 1 < virtual_stages) {
      absl::Status sent = pp_group->Send(x.contiguous(), (stage + 1) % stages, v + 1);
      TORCH_CHECK(sent.ok(), std::string(sent.message()));
    }
  }
  return stage == stages - 1 ? x : at::Tensor();
}

absl::StatusOr<bool> Trainer::Impl::GradientsOverflowed() {
  at::Tensor flag = at::full({1}, update->LocalGradientsNonFinite() ? 1.0 : 0.0, at::kFloat);
  TRIDENT_RETURN_IF_ERROR(topology->world().AllReduce(flag, ReduceOp::kMax));
  return flag.item<float>() > 0;
}

absl::StatusOr<double> Trainer::Impl::Evaluate() {
  if (val_data == nullptr) return absl::NotFoundError("no val.bin in the data directory");
  model->eval();
  at::NoGradGuard no_grad;
  BatchSampler val_sampler(val_data->num_samples(), config.global_batch_size(), config.seed(),
                           /*shuffle=*/false);
  const int64_t accumulation = config.grad_accumulation_steps();
  double total = 0;  // sum of micro-batch mean losses (on the last stage with a runner)
  AutocastScope autocast(precision, c10::DeviceType::CPU);
  for (int64_t s = 0; s < config.eval_steps(); ++s) {
    std::vector<at::Tensor> inputs, targets;
    MicroBatches(*val_data, val_sampler, s, &inputs, &targets);
    if (runner) {
      if (inputs.empty()) inputs.assign(accumulation, at::Tensor());
      TRIDENT_ASSIGN_OR_RETURN(const double loss, runner->RunForward(inputs, targets));
      if (stage == stages - 1) total += loss * accumulation;
    } else {
      TRIDENT_RETURN_IF_ERROR(CatchExceptions("evaluation", [&] {
        for (int64_t micro = 0; micro < accumulation; ++micro) {
          total += model->Loss(inputs[micro], targets[micro]).item<double>();
        }
      }));
    }
  }
  model->train();
  const double local_mean = total / (config.eval_steps() * accumulation);
  if (runner) {
    TRIDENT_ASSIGN_OR_RETURN(last_val_loss, PipelineLoss(local_mean));
  } else {
    at::Tensor mean = at::full({1}, local_mean, at::kDouble);
    TRIDENT_RETURN_IF_ERROR(dp_group->AllReduce(mean, ReduceOp::kAvg));
    last_val_loss = mean.item<double>();
  }
  ForHooks([&](TrainerHooks& h) { h.OnEvalEnd(State(), *last_val_loss); });
  return *last_val_loss;
}

void Trainer::Impl::Report(const StepMetrics& m, int64_t max_steps) {
  std::vector<std::pair<std::string, double>> values = {
      {"loss", m.loss},
      {"lr", m.lr},
      {"grad_norm", m.grad_norm},
      {"tokens_per_s", m.tokens_per_s},
      {"step_time_ms", m.step_time_ms},
      {"mfu", m.mfu}};
  if (scaler) {
    values.emplace_back("loss_scale", m.loss_scale);
    values.emplace_back("skipped", m.skipped ? 1 : 0);
  }
  if (metrics) metrics->Write(m.step, values);
  if (tensorboard) tensorboard->Write(m.step, values);
  if (!is_rank0) return;
  const double eta = m.step_time_ms / 1000.0 * (max_steps - m.step);
  if (progress_bar) {
    const int width = 24, filled = static_cast<int>(width * m.step / max_steps);
    std::printf("\rstep %lld/%lld [%s%s] loss %.4f | %s tok/s | ETA %s   ",
                static_cast<long long>(m.step), static_cast<long long>(max_steps),
                std::string(filled, '=').c_str(), std::string(width - filled, ' ').c_str(), m.loss,
                HumanCount(m.tokens_per_s).c_str(), internal::FormatDuration(eta).c_str());
    if (m.step == max_steps) std::printf("\n");
    std::fflush(stdout);
  } else if (m.step % config.log_every() == 0 || m.step == max_steps) {
    Print(absl::StrFormat(
        "step %d/%d | loss %.4f | lr %.2e | grad_norm %.3f | %s tok/s | %.0f ms/step | mfu %.1f%% "
        "| ETA %s",
        m.step, max_steps, m.loss, m.lr, m.grad_norm, HumanCount(m.tokens_per_s), m.step_time_ms,
        100 * m.mfu, internal::FormatDuration(eta)));
  }
}

void TuneAllocatorForTraining() {
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
}

absl::Status Trainer::Preflight(TrainerConfig config, int world_size) {
  TRIDENT_RETURN_IF_ERROR(ResolveConfig(&config, world_size));
  int vocab = 256;
  if (!config.data().empty()) {
    if (!fs::exists(config.data() + "/train.bin")) {
      return absl::NotFoundError(absl::StrCat("data directory ", config.data(),
                                              " has no train.bin; prepare it with tools/prepare_data"));
    }
    if (fs::exists(config.data() + "/tokenizer.txt")) {
      TRIDENT_ASSIGN_OR_RETURN(auto tokenizer, LoadTokenizer(config.data() + "/tokenizer.txt"));
      vocab = tokenizer->vocab_size();
    }
  }
  TRIDENT_RETURN_IF_ERROR(ResolveModelConfig(config, vocab).status());
  for (const std::string& path : {config.init_from(), config.resume_from()}) {
    if (!path.empty() && path != "last" && path != "best" && !fs::exists(path)) {
      return absl::NotFoundError(absl::StrCat(path, " does not exist (init_from / resume_from)"));
    }
  }
  return absl::OkStatus();
}

Trainer::Trainer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Trainer::~Trainer() = default;

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(TrainerConfig config, Topology* topology) {
  auto impl = std::make_unique<Impl>();
  Impl& t = *impl;
  TRIDENT_RETURN_IF_ERROR(ResolveConfig(&config, topology->world_size()));
  t.config = std::move(config);
  t.topology = topology;
  TRIDENT_ASSIGN_OR_RETURN(t.dp_group, topology->Group("dp"));
  if (t.dp_group->size() != t.config.dp()) {
    return absl::InvalidArgumentError(absl::StrCat("the topology's data-parallel group has ",
                                                   t.dp_group->size(), " ranks but dp=",
                                                   t.config.dp()));
  }
  t.dp_rank = t.dp_group->rank();
  t.is_rank0 = topology->rank() == 0;
  TRIDENT_RETURN_IF_ERROR(t.OpenData());
  if (t.config.tp() > 1) {
    TRIDENT_ASSIGN_OR_RETURN(t.tp_group, topology->Group("tp"));
    if (t.tp_group->size() != t.config.tp()) {
      return absl::InvalidArgumentError(absl::StrCat("the topology's tensor-parallel group has ",
                                                     t.tp_group->size(), " ranks but tp=",
                                                     t.config.tp()));
    }
    t.model_config.tp = {t.config.tp(), t.tp_group->rank(), "tp", t.config.sequence_parallel()};
  }
  if (t.config.tp() > 1 && t.config.pp() > 1) {
    TRIDENT_ASSIGN_OR_RETURN(t.norm_group, topology->GroupSpanning({"tensor", "pipeline"}));
  } else if (t.config.tp() > 1) {
    t.norm_group = t.tp_group;
  } else if (t.config.pp() > 1) {
    TRIDENT_ASSIGN_OR_RETURN(t.norm_group, topology->Group("pp"));
  }
  if (t.config.pp() > 1) {
    TRIDENT_RETURN_IF_ERROR(t.BuildStage());
  } else {
    TRIDENT_ASSIGN_OR_RETURN(t.model, CreateModel(t.model_config, t.config.seed()));
    t.chunks = {{0, t.model->NumLayers()}};
    if (t.config.activation_checkpointing() != "none") {
      // One stage: the runner recomputes activations (a pipeline of one).
      t.pp_group = *topology->Group("pp");
      TRIDENT_ASSIGN_OR_RETURN(t.schedule, MakeSchedule(t.config.schedule()));
    }
  }
  TRIDENT_ASSIGN_OR_RETURN(t.precision,
                           MakePrecisionPolicy(t.config.precision(), t.config.precision_table()));
  ApplyPrecision(*t.model, t.precision);
  if (t.precision.loss_scaling || t.config.has_loss_scale()) {
    LossScalerOptions scaling;
    scaling.loss_scale = t.config.loss_scale();
    scaling.initial_scale_power = t.config.initial_scale_power();
    scaling.loss_scale_window = t.config.loss_scale_window();
    scaling.hysteresis = t.config.hysteresis();
    scaling.min_loss_scale = t.config.min_loss_scale();
    t.scaler.emplace(scaling);
  }
  // Record the resolved model sizes so the printed and saved config is complete.
  t.config.set_n_layer(t.model_config.n_layer);
  t.config.set_n_head(t.model_config.n_head);
  t.config.set_n_embd(t.model_config.n_embd);
  t.config.set_block_size(t.model_config.block_size);
  t.config.set_vocab_size(t.model_config.vocab_size);
  t.config.set_dropout(t.model_config.dropout);
  for (const auto& item : t.model->named_parameters()) {
    t.parameters.emplace_back(item.key(), item.value());
  }
  if (!t.config.init_from().empty()) TRIDENT_RETURN_IF_ERROR(t.LoadInitialWeights(t.config.init_from()));
  t.ClassifyParameters();
  t.num_parameters = t.model->NumParameters();  // before ZeRO stage 3 shards them
  internal::ParameterUpdateOptions update;
  update.parameters = t.parameters;
  update.counted = t.counted_parameters;
  for (const auto& [name, p] : t.tied) update.keep_full_gradient.push_back(p);
  update.data_parallel = t.dp_group;
  update.tensor_parallel = t.tp_group;
  update.norm_group = t.norm_group;
  update.world = &topology->world();
  update.adam.beta1 = t.config.adam_beta1();
  update.adam.beta2 = t.config.adam_beta2();
  update.adam.eps = t.config.adam_eps();
  update.adam.weight_decay = t.config.weight_decay();
  update.zero_stage = t.config.zero_stage();
  update.layers = t.model.get();
  for (const StageChunk& chunk : t.chunks) {
    for (int64_t i = chunk.first_layer; i < chunk.end_layer; ++i) update.layer_indices.push_back(i);
  }
  update.zero_allow_untested_optimizer = t.config.zero_allow_untested_optimizer();
  if (t.config.prescale_gradients()) {
    update.gradient_predivide_factor = t.config.gradient_predivide_factor();
  }
  if (t.config.zero_stage() > 0) {
    update.bucket_bytes = t.config.zero_reduce_bucket_size() * 4;  // elements of fp32
    update.zero_allgather_bucket_bytes = t.config.zero_allgather_bucket_size() * 4;
  } else {
    update.bucket_bytes = static_cast<int64_t>(t.config.bucket_size_mb() * (1 << 20));
  }
  TRIDENT_ASSIGN_OR_RETURN(t.update, internal::MakeParameterUpdate(std::move(update)));
  t.StartRunner();
  // Dropout streams: one per data-parallel rank. With sequence parallelism
  // every dropout acts on this rank's own shard or heads, so tensor-parallel
  // ranks draw their own masks too; without it, dropout after a row-parallel
  // layer sees the replicated activation and tp ranks must draw the same mask.
  const uint64_t tp_stream = t.config.sequence_parallel() ? t.tp_group->rank() : 0;
  torch::manual_seed(t.config.seed() + static_cast<uint64_t>(t.dp_rank) + 1000003 * tp_stream);
  if (!t.config.resume_from().empty()) TRIDENT_RETURN_IF_ERROR(t.LoadCheckpoint());
  if (t.is_rank0 && !t.config.metrics_file().empty()) {
    TRIDENT_ASSIGN_OR_RETURN(t.metrics, internal::JsonLinesWriter::Open(t.config.metrics_file()));
  }
  if (t.is_rank0 && !t.config.tensorboard_dir().empty()) {
    TRIDENT_ASSIGN_OR_RETURN(t.tensorboard,
                             internal::TensorBoardWriter::Open(t.config.tensorboard_dir()));
  }
  const char* terminal = std::getenv("TRIDENT_STDOUT_IS_TTY");
  t.progress_bar = t.is_rank0 && t.config.enable_progress_bar() &&
                   (isatty(STDOUT_FILENO) || (terminal != nullptr && std::string(terminal) == "1"));
  const int64_t T = t.model_config.block_size;
  t.flops_per_token = 6.0 * t.num_parameters +
                      12.0 * t.model_config.n_layer * t.model_config.n_embd * T;
  t.peak_flops = MeasurePeakFlops();
  return std::unique_ptr<Trainer>(new Trainer(std::move(impl)));
}

void Trainer::AddHooks(std::shared_ptr<TrainerHooks> hooks) { impl_->hooks.push_back(std::move(hooks)); }
LanguageModel& Trainer::model() { return *impl_->model; }
const TrainerConfig& Trainer::config() const { return impl_->config; }
int64_t Trainer::step() const { return impl_->step; }
absl::StatusOr<double> Trainer::Evaluate() { return impl_->Evaluate(); }

absl::StatusOr<TrainResult> Trainer::Train() {
  Impl& t = *impl_;
  const TrainerConfig& c = t.config;
  int64_t max_steps = c.max_steps();
  if (c.max_epochs() > 0) {
    const int64_t per_epoch =
        (t.train_data->num_samples() + c.global_batch_size() - 1) / c.global_batch_size();
    max_steps = std::min(max_steps, per_epoch * c.max_epochs());
  }
  TrainResult result;
  result.first_step = t.step;
  result.unigram_entropy = UnigramEntropy(*t.train_data);
  t.Print(absl::StrCat("config:\n", ConfigToText(c)));
  t.Print(absl::StrCat("per rank: ", t.update->MemoryReport()));
  t.Print(absl::StrFormat(
      "model %s: %s parameters | data %s: %s tokens, %d samples of %d | %d rank(s), global batch "
      "%d (micro %d x accumulation %d x dp %d) | %d thread(s) per rank, peak %.1f GFLOP/s | "
      "peak RSS %.0f MB",
      c.model(), HumanCount(t.num_parameters), t.train_data->path(),
      HumanCount(t.train_data->num_tokens()), t.train_data->num_samples(),
      t.model_config.block_size, t.topology->world_size(), c.global_batch_size(),
      c.micro_batch_size(), c.grad_accumulation_steps(), c.dp(), at::get_num_threads(),
      t.peak_flops / 1e9,
      PeakResidentMb()));
  t.ForHooks([&](TrainerHooks& h) { h.OnTrainStart(t.State()); });
  const auto start = Clock::now();
  const double tokens_per_step =
      static_cast<double>(c.global_batch_size()) * t.model_config.block_size;
  while (t.step < max_steps) {
    t.ForHooks([&](TrainerHooks& h) { h.OnStepStart(t.State()); });
    const auto step_start = Clock::now();
    TRIDENT_ASSIGN_OR_RETURN(const double loss, t.TrainStep());
    if (t.config.sequence_parallel()) {
      TRIDENT_RETURN_IF_ERROR(t.update->SumOverTensorParallel(t.replicated_parameters));
    }
    if (!std::isfinite(loss)) {
      return absl::InternalError(absl::StrCat("the loss became ", loss, " at step ", t.step + 1,
                                              "; lower lr or raise warmup_steps"));
    }
    t.ForHooks([&](TrainerHooks& h) { h.AfterBackward(t.State()); });
    StepMetrics m;
    m.loss = loss;
    m.lr = internal::LearningRate(c.lr_scheduler(), c.lr(), c.min_lr(), c.warmup_steps(), max_steps,
                                  t.step);
    if (t.scaler) {
      m.loss_scale = t.scaler->scale();
      TRIDENT_ASSIGN_OR_RETURN(m.skipped, t.GradientsOverflowed());
    }
    if (m.skipped) {
      // Every rank skips: the weights and optimizer state stay as they were.
      t.scaler->Update(true);
      m.grad_norm = std::numeric_limits<double>::quiet_NaN();
      t.Print(absl::StrFormat("step %d: inf or NaN gradients on some rank; skipped the update, "
                              "loss scale %g -> %g",
                              t.step + 1, m.loss_scale, t.scaler->scale()));
    } else {
      if (t.scaler) {
        if (m.loss_scale != 1.0) t.update->ScaleGradients(1.0 / m.loss_scale);
        t.scaler->Update(false);
      }
      TRIDENT_ASSIGN_OR_RETURN(m.grad_norm, t.update->ClipGradNorm(c.grad_clip()));
      t.ForHooks([&](TrainerHooks& h) { h.BeforeOptimizerStep(t.State()); });
      TRIDENT_RETURN_IF_ERROR(t.update->Step(m.lr));
    }
    ++t.step;
    t.ForHooks([&](TrainerHooks& h) { h.AfterOptimizerStep(t.State()); });
    const double seconds = Seconds(Clock::now() - step_start);
    m.step = t.step;
    m.step_time_ms = 1000 * seconds;
    m.tokens_per_s = tokens_per_step / seconds;
    m.mfu = t.flops_per_token * m.tokens_per_s / t.topology->world_size() / t.peak_flops;
    result.losses.push_back(loss);
    t.ForHooks([&](TrainerHooks& h) { h.OnStepEnd(t.State(), m); });
    t.Report(m, max_steps);
    const bool last = t.step == max_steps;
    if (c.eval_every() > 0 && t.step % c.eval_every() == 0 && !last && t.val_data) {
      TRIDENT_ASSIGN_OR_RETURN(const double val_loss, t.Evaluate());
      t.Print(absl::StrFormat("step %d | val_loss %.4f", t.step, val_loss));
    }
    if (!c.save_dir().empty() && ((c.save_every() > 0 && t.step % c.save_every() == 0) || last)) {
      if (last && t.val_data) {
        TRIDENT_ASSIGN_OR_RETURN(result.val_loss, t.Evaluate());
      }
      TRIDENT_RETURN_IF_ERROR(t.SaveCheckpoint());
    }
    if (!c.export_safetensors().empty() && c.export_every() > 0 && t.step % c.export_every() == 0) {
      TRIDENT_RETURN_IF_ERROR(ExportSafetensors(c.export_safetensors()));
    }
  }
  if (!result.val_loss && t.val_data) {
    TRIDENT_ASSIGN_OR_RETURN(result.val_loss, t.Evaluate());
  }
  if (result.val_loss) {
    t.Print(absl::StrFormat("validation loss %.4f nats/token (unigram entropy of the data %.4f)",
                            *result.val_loss, result.unigram_entropy));
  }
  if (c.sample_tokens() > 0) {
    TRIDENT_ASSIGN_OR_RETURN(result.sample, Sample(c.prompt(), c.sample_tokens()));
    t.Print(absl::StrCat("sample (temperature ", c.temperature(), ", top_k ", c.top_k(), "):\n",
                         result.sample));
  }
  if (!c.export_safetensors().empty()) TRIDENT_RETURN_IF_ERROR(ExportSafetensors(c.export_safetensors()));
  t.Print(absl::StrFormat("done: %d steps in %s | peak RSS %.0f MB", t.step - result.first_step,
                          internal::FormatDuration(Seconds(Clock::now() - start)), PeakResidentMb()));
  t.ForHooks([&](TrainerHooks& h) { h.OnTrainEnd(t.State()); });
  return result;
}

absl::StatusOr<std::string> Trainer::Sample(const std::string& prompt, int64_t tokens) {
  Impl& t = *impl_;
  std::vector<int64_t> ids;
  if (t.tokenizer) {
    for (uint16_t id : t.tokenizer->Encode(prompt)) ids.push_back(id);
  } else {
    for (unsigned char ch : prompt) ids.push_back(ch % t.model_config.vocab_size);
  }
  if (ids.empty()) ids.push_back(0);
  const size_t prompt_length = ids.size();
  // Every rank samples alike (tensor parallelism and ZeRO-3 gather across
  // ranks, pipeline stages pass activations on); the last stage's choice is
  // broadcast so all contexts stay the same.
  auto generator = at::make_generator<at::CPUGeneratorImpl>(t.config.seed());
  const int64_t tp = t.config.tp();
  const int64_t align = t.config.sequence_parallel() ? tp : 1;  // sequence shards must divide
  t.model->eval();
  absl::Status sampled = CatchExceptions("sampling", [&] {
    at::NoGradGuard no_grad;
    for (int64_t i = 0; i < tokens; ++i) {
      const int64_t context = std::min<int64_t>(ids.size(), t.model_config.block_size / align * align);
      std::vector<int64_t> window(ids.end() - context, ids.end());
      // Padding after the context leaves its logits unchanged (causal attention).
      window.resize((context + align - 1) / align * align, 0);
      at::Tensor input = at::tensor(window, at::kLong).unsqueeze(0);
      at::Tensor next = at::zeros({1}, at::kLong);
      const bool last = t.stage == t.stages - 1;
      at::Tensor logits = t.PipelinedLogits(input);
      if (last) {
        logits = logits.select(1, context - 1).squeeze(0);
        if (t.tp_group != nullptr) {  // this rank's vocabulary slice -> all of it
          auto gathered = t.tp_group->AllGather(logits.contiguous(), 0);
          TORCH_CHECK(gathered.ok(), std::string(gathered.status().message()));
          logits = *gathered;
        }
        logits = logits / t.config.temperature();
        if (t.config.top_k() > 0 && t.config.top_k() < logits.size(0)) {
          const double threshold = std::get<0>(logits.topk(t.config.top_k()))[-1].item<double>();
          logits.masked_fill_(logits < threshold, -std::numeric_limits<float>::infinity());
        }
        next = at::multinomial(at::softmax(logits.to(at::kFloat), -1), 1, false, generator);
      }
      // Within each pipeline from its last stage; data-parallel replicas and
      // tensor-parallel ranks compute the same token.
      absl::Status shared = t.stages > 1 ? t.pp_group->Broadcast(next, t.stages - 1)
                                         : t.topology->world().Broadcast(next, 0);
      TORCH_CHECK(shared.ok(), std::string(shared.message()));
      ids.push_back(next.item<int64_t>());
    }
  });
  t.model->train();
  TRIDENT_RETURN_IF_ERROR(sampled);
  if (!t.is_rank0) return std::string();
  std::vector<int64_t> generated(ids.begin() + prompt_length, ids.end());
  if (t.tokenizer) return t.tokenizer->Decode(generated);
  return MakeByteTokenizer()->Decode(generated);
}

absl::Status Trainer::ExportSafetensors(const std::string& path) {
  Impl& t = *impl_;
  TRIDENT_RETURN_IF_ERROR(t.update->GatherFullParameters());
  NamedTensors tensors;
  for (const auto& [name, p] : t.parameters) tensors.emplace_back(name, p.detach().clone());
  TRIDENT_RETURN_IF_ERROR(t.update->ReleaseFullParameters(/*keep_changes=*/false));
  if (t.tp_group != nullptr) {  // join the shards into the single-process tensors
    const auto shards = t.model->ParameterShards();
    for (auto& [name, tensor] : tensors) {
      auto shard = shards.find(name);
      if (shard == shards.end()) continue;
      TRIDENT_ASSIGN_OR_RETURN(at::Tensor gathered, t.tp_group->AllGather(tensor.detach(), shard->second.dim));
      tensor = shard->second.Unslice(gathered.chunk(t.tp_group->size(), shard->second.dim));
    }
  }
  const auto parent = fs::path(path).parent_path();
  std::error_code error;
  if (!parent.empty() && t.is_rank0) fs::create_directories(parent, error);
  if (t.stages > 1) {
    // Every stage's first data- and tensor-parallel rank writes its tensors
    // beside `path` (a shared filesystem, as for checkpoints); rank 0 joins them.
    TRIDENT_RETURN_IF_ERROR(t.topology->world().Barrier());
    const bool writer = t.dp_rank == 0 && (t.tp_group == nullptr || t.tp_group->rank() == 0);
    if (writer) {
      TRIDENT_RETURN_IF_ERROR(WriteSafetensors(absl::StrCat(path, ".stage", t.stage), tensors, {}));
    }
    TRIDENT_RETURN_IF_ERROR(t.topology->world().Barrier());
    if (t.is_rank0) {
      tensors.clear();
      std::set<std::string> seen;
      for (int s = 0; s < t.stages; ++s) {
        const std::string part = absl::StrCat(path, ".stage", s);
        TRIDENT_ASSIGN_OR_RETURN(SafetensorsContents contents, ReadSafetensors(part));
        for (auto& [name, tensor] : contents.tensors) {
          if (seen.insert(name).second) tensors.emplace_back(name, tensor);  // tied: stage 0's
        }
        fs::remove(part, error);
      }
    }
  }
  if (t.is_rank0) {
    const size_t stored = tensors.size();
    for (const auto& [alias, owner] : t.model->TiedParameters()) {
      for (size_t i = 0; i < stored; ++i) {
        if (tensors[i].first == owner) tensors.emplace_back(alias, tensors[i].second);
      }
    }
    TRIDENT_RETURN_IF_ERROR(WriteSafetensors(path, tensors, {{"format", "pt"}}));
    t.Print(absl::StrCat("exported the model to ", path));
  }
  return t.topology->world().Barrier();
}

}  // namespace trident
