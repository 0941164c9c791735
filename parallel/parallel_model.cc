#include <algorithm>
#include <cmath>
#include <numeric>
#include <set>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/cuda.h>
#include <torch/nn/module.h>
#include <torch/utils.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/logging.h"
#include "base/rng.h"
#include "base/status.h"
#include "parallel/internal/model_part.h"
#include "parallel/internal/parallel_model_impl.h"
#include "parallel/internal/transfer.h"
#include "parallel/parallel.h"
#include "parallel/parameter_update.h"
#include "pipeline/stage_runner.h"

namespace trident {
namespace {

// The topology's group for `axis` when the plan has `size` ranks there
// (nullptr when the axis is absent and size is 1).
absl::StatusOr<const ProcessGroup*> AxisGroup(const Topology& topology, const char* axis, int size) {
  auto group = topology.Group(axis);
  if (!group.ok()) {
    if (size == 1) return nullptr;
    return absl::InvalidArgumentError(absl::StrCat("the plan asks for ", size, " ranks on axis '", axis,
                                                   "' but the topology has no such axis; ",
                                                   "create it in TopologyOptions::mesh_axes"));
  }
  if ((*group)->size() != size) {
    return absl::InvalidArgumentError(
        absl::StrCat("the topology's '", axis, "' group has ", (*group)->size(), " ranks but the plan says ", size));
  }
  return *group;
}

absl::StatusOr<at::Device> PlanDevice(const ParallelPlan& plan, const Topology& topology) {
  if (plan.device() == ParallelPlan::cpu) return at::Device(at::kCPU);
  if (!torch::cuda::is_available()) {
    return absl::FailedPreconditionError(
        "device=cuda but this LibTorch sees no CUDA GPU (a CPU-only build, or no GPU visible); use "
        "device=cpu");
  }
  const int local = topology.env().local_rank;
  if (local >= static_cast<int>(torch::cuda::device_count())) {
    return absl::FailedPreconditionError(
        absl::StrCat("local rank ", local, " has no GPU: this node has ", torch::cuda::device_count()));
  }
  at::Device device(at::kCUDA, static_cast<c10::DeviceIndex>(local));
  c10::impl::getDeviceGuardImpl(at::kCUDA)->setDevice(device);
  return device;
}

// A plan that sets its axis or rank order must find the ranks laid out so:
// every rank at the same data, tensor and pipeline place as on its mesh.
absl::Status CheckMeshOrder(const ParallelPlan& plan, const Topology& topology) {
  if (plan.axis_order().empty() && plan.rank_order().empty()) return absl::OkStatus();
  TRIDENT_ASSIGN_OR_RETURN(DeviceMesh planned,
                           DeviceMesh::Create(PlanMeshAxes(plan), topology.world_size(), ToVector(plan.rank_order())));
  for (int rank = 0; rank < topology.world_size(); ++rank) {
    for (const char* axis : {"tensor", "pipeline", "data"}) {
      if (planned.AxisIndex(axis, rank) != topology.mesh().AxisIndex(axis, rank)) {
        return absl::InvalidArgumentError(
            absl::StrCat("the plan lays the ranks out as ", planned.ToString(), " but the topology as ",
                         topology.mesh().ToString(), " (rank ", rank, " differs on axis '", axis,
                         "'); create the topology with PlanMeshAxes(plan) and plan.rank_order()"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<ParallelModel>> Parallelize(ModelSource source, ParallelPlan plan, Topology* topology,
                                                           const Batch& example, OptimizerFactory make_optimizer) {
  TRIDENT_RETURN_IF_ERROR(ValidatePlan(plan));
  if (plan.dp() * plan.tp() * plan.pp() != topology->world_size()) {
    return absl::InvalidArgumentError(absl::StrCat("dp*tp*pp = ", plan.dp() * plan.tp() * plan.pp(),
                                                   " but the job has ", topology->world_size(), " ranks"));
  }
  TRIDENT_RETURN_IF_ERROR(CheckSource(source, plan));
  TRIDENT_RETURN_IF_ERROR(CheckMeshOrder(plan, *topology));
  auto impl = std::make_unique<ParallelModel::Impl>();
  ParallelModel::Impl& m = *impl;
  m.plan = std::move(plan);
  m.topology = topology;
  m.source = std::move(source);
  TRIDENT_ASSIGN_OR_RETURN(m.dp, AxisGroup(*topology, "data", m.plan.dp()));
  TRIDENT_ASSIGN_OR_RETURN(m.tp, AxisGroup(*topology, "tensor", m.plan.tp()));
  TRIDENT_ASSIGN_OR_RETURN(m.pp, AxisGroup(*topology, "pipeline", m.plan.pp()));
  TRIDENT_ASSIGN_OR_RETURN(const int shard_group_size, ZeroShardGroupSize(m.plan.zero(), m.plan.dp()));
  if (m.plan.zero().stage() > 0 && shard_group_size < m.plan.dp()) {
    TRIDENT_ASSIGN_OR_RETURN(Topology::SplitGroups split, topology->SplitAxis("data", shard_group_size));
    m.zero_shards = split.block;
    m.zero_replicas = split.across;
  }
  if (m.plan.tp() == 1) m.tp = nullptr;
  if (m.plan.pp() == 1) m.pp = nullptr;
  m.stage = m.pp != nullptr ? m.pp->rank() : 0;
  if (m.tp != nullptr && m.pp != nullptr) {
    TRIDENT_ASSIGN_OR_RETURN(m.norm, topology->GroupSpanning({"tensor", "pipeline"}));
  } else {
    m.norm = m.tp != nullptr ? m.tp : m.pp;
  }
  TRIDENT_ASSIGN_OR_RETURN(m.device, PlanDevice(m.plan, *topology));
  TRIDENT_ASSIGN_OR_RETURN(m.precision, MakePrecisionPolicy(m.plan.precision().mode(), m.plan.precision().table()));
  TRIDENT_RETURN_IF_ERROR(m.Setup(std::move(make_optimizer), example));
  return std::unique_ptr<ParallelModel>(new ParallelModel(std::move(impl)));
}

absl::Status ParallelModel::Impl::Setup(OptimizerFactory make_optimizer, const Batch& example) {
  // Built locally first; one rank's failure reaches all before any messages.
  absl::StatusOr<internal::ModelPart> built =
      internal::BuildModelPart(source, plan, stage, tp != nullptr ? tp->rank() : 0, device, example);
  TRIDENT_RETURN_IF_ERROR(AgreeOnFailure(topology->world(), built.status(), "building the model"));
  part = *std::move(built);
  TRIDENT_RETURN_IF_ERROR(CheckModulePatterns());
  if (auto* module = dynamic_cast<torch::nn::Module*>(part.layers.get())) {
    ApplyPrecision(*module, precision);
  } else {
    c10::NoGradGuard no_grad;
    for (const StageChunk& c : part.chunks) {
      for (int64_t i = c.first_layer; i < c.end_layer; ++i) {
        for (auto& [name, p] : part.layers->LayerParameters(i)) {
          if (p.is_floating_point() && p.scalar_type() != precision.param) p.set_data(p.to(precision.param));
        }
      }
    }
  }
  TRIDENT_ASSIGN_OR_RETURN(schedule,
                           MakeSchedule(stages() > 1 ? plan.pipeline().schedule() : "1f1b", plan.virtual_stages()));
  PlanRecomputation();
  TRIDENT_RETURN_IF_ERROR(ClassifyParameters(example));
  ParameterUpdateOptions options;
  options.parameters = trainable;
  options.counted = counted;
  for (const auto& [name, p] : tied) options.keep_full_gradient.push_back(p);
  options.data_parallel = dp;
  options.zero_shards = zero_shards;
  options.zero_replicas = zero_replicas;
  options.tensor_parallel = tp;
  options.norm_group = norm;
  options.world = &topology->world();
  options.make_optimizer = std::move(make_optimizer);
  options.zero = plan.zero();
  options.layers = part.layers.get();
  for (const StageChunk& chunk : part.chunks) {
    for (int64_t i = chunk.first_layer; i < chunk.end_layer; ++i) options.layer_indices.push_back(i);
  }
  auto made = MakeParameterUpdate(std::move(options));
  TRIDENT_RETURN_IF_ERROR(AgreeOnFailure(topology->world(), made.status(), "building the optimizer"));
  update = *std::move(made);
  // Values ZeRO-3 did not draw as it sharded (frozen parameters); then the
  // first forward, which may read them all.
  absl::Status drawn = CatchExceptions("drawing the parameters' values", [&] {
    for (const StageChunk& chunk : part.chunks) {
      for (int64_t i = chunk.first_layer; i < chunk.end_layer; ++i) part.layers->MaterializeLayer(i);
    }
  });
  TRIDENT_RETURN_IF_ERROR(AgreeOnFailure(topology->world(), drawn, "building the model"));
  TRIDENT_RETURN_IF_ERROR(FindBoundaries(example));
  if (precision.loss_scaling || plan.precision().loss_scaling()) scaler.emplace(plan.precision().loss_scaler());
  StageRunnerOptions runner_options;
  runner_options.chunks = part.chunks;
  runner_options.loss = Loss();
  runner_options.checkpoint_num_layers = plan.recompute().num_layers();
  runner_options.dealloc_sent_outputs = plan.pipeline().dealloc_pipeoutput();
  runner_options.loss_scale = [this] { return scaler ? scaler->scale() : 1.0; };
  // Reductions overlap the last backward without pipelining only: with stages,
  // tied gradients are summed between stages before the data-parallel sum.
  runner_options.before_backward = [this](bool last) { update->PrepareForBackward(last && stages() == 1); };
  runner_options.reduce_tied_grads = [this] {
    return pp != nullptr ? ReduceTiedGradients(tied, tied_holders, *pp) : absl::OkStatus();
  };
  runner_options.reduce_data_parallel_grads = [this] { return update->FinishBackward(); };
  runner = std::make_unique<PipelineStageRunner>(*part.layers, pp, *schedule, std::move(runner_options));
  // Dropout streams: one per data-parallel rank. With sequence parallelism
  // every dropout acts on this rank's own shard or heads, so tensor-parallel
  // ranks draw their own masks too; without it, dropout after a row-parallel
  // layer sees the replicated activation and tp ranks must draw the same mask.
  const uint64_t tp_stream = plan.tensor_parallel().sequence_parallel() && tp != nullptr ? tp->rank() : 0;
  const uint64_t dp_rank = dp != nullptr ? dp->rank() : 0;
  at::manual_seed(plan.seed() + dp_rank + 1000003 * tp_stream);
  return absl::OkStatus();
}

void ParallelModel::Impl::PlanRecomputation() {
  // Checkpointing per chunk, by its virtual stage v of V = pp * virtual_stages.
  const int V = stages() * static_cast<int>(part.chunks.size());
  for (size_t c = 0; c < part.chunks.size(); ++c) {
    StageChunk& chunk = part.chunks[c];
    std::vector<std::string> names;
    for (int64_t i = chunk.first_layer; i < chunk.end_layer; ++i) names.push_back(part.layers->LayerName(i));
    chunk.checkpointed_layers = 0;
    chunk.recomputed = RecomputedLayers(plan.recompute(), static_cast<int>(c) * stages() + stage, V, names,
                                        schedule->RecomputesOnLastStage());
  }
}

// One forward of the example through every stage (gradients on, so each
// boundary tensor says whether a gradient flows back; autocast as in
// training, so dtypes match; the RNG left as it was) fixes the boundaries.
absl::Status ParallelModel::Impl::FindBoundaries(const Batch& example) {
  const at::Tensor rng = CpuRngState();
  Batch on_device = OnDevice({example})[0];
  absl::StatusOr<StagePass> pass;
  {
    c10::AutoGradMode grad(true);
    AutocastScope autocast(precision, device.type());
    pass = ForwardThroughStages(*part.layers, part.chunks, pp, on_device);
    if (pass.ok() && HoldsLastStage()) {
      // The loss must exist and be a scalar before any step runs.
      absl::Status checked = CatchExceptions("computing the loss", [&] {
        StageLoss loss = Loss();
        at::Tensor value = loss ? loss(pass->outputs, on_device) : part.layers->Loss(pass->outputs, on_device);
        TORCH_CHECK(value.defined() && value.numel() == 1 && at::isFloatingType(value.scalar_type()),
                    "the loss must be a floating-point scalar; it has shape ", value.sizes(), " and dtype ",
                    value.scalar_type());
      });
      if (!checked.ok()) pass = checked;
    }
  }
  SetCpuRngState(rng);
  return AgreeOnFailure(topology->world(), pass.status(), "running the first forward");
}

// A module pattern (a LoRA target, a module to recompute) that matches no
// module on any pipeline stage is a mistake.
absl::Status ParallelModel::Impl::CheckModulePatterns() {
  auto check = [&](const auto& patterns, const std::vector<int>& local_hits, const std::string& what,
                   const std::string& matches_none) -> absl::Status {
    if (patterns.empty()) return absl::OkStatus();
    at::Tensor hits = at::zeros({static_cast<int64_t>(patterns.size())}, at::kLong);
    for (size_t i = 0; i < local_hits.size(); ++i) hits[i] = local_hits[i];
    if (pp != nullptr) TRIDENT_RETURN_IF_ERROR(pp->AllReduce(hits));
    for (int i = 0; i < static_cast<int>(patterns.size()); ++i) {
      if (hits[i].item<int64_t>() == 0) {
        return absl::InvalidArgumentError(absl::StrCat(what, " entry '", patterns[i], "' ", matches_none));
      }
    }
    return absl::OkStatus();
  };
  const std::string no_module = "matches no module of the model";
  if (plan.has_lora()) {
    TRIDENT_RETURN_IF_ERROR(
        check(plan.lora().target_modules(), part.lora_target_hits, "lora_config: target_modules", no_module));
  }
  TRIDENT_RETURN_IF_ERROR(check(part.replace_report.pairs, part.replace_report.hits, "module_replace:", no_module));
  TRIDENT_RETURN_IF_ERROR(check(plan.recompute().modules(), part.recompute_hits, "checkpoint_modules:", no_module));
  if (plan.recompute().method() != RecomputeSpec::selected) return absl::OkStatus();
  // Selected layers by name or prefix, on whichever stage holds them.
  std::vector<int> layer_hits(plan.recompute().layers().size());
  for (const StageChunk& chunk : part.chunks) {
    for (int64_t layer = chunk.first_layer; layer < chunk.end_layer; ++layer) {
      const std::string name = part.layers->LayerName(layer);
      for (int i = 0; i < plan.recompute().layers().size(); ++i) {
        layer_hits[i] += absl::StartsWith(name, plan.recompute().layers()[i]) ? 1 : 0;
      }
    }
  }
  return check(plan.recompute().layers(), layer_hits, "checkpoint_layers:",
               absl::StrCat("matches no layer of the model (layer names are like '",
                            part.layers->LayerName(
                                std::min(part.chunks.front().first_layer + 1, part.chunks.front().end_layer - 1)),
                            "')"));
}

absl::Status ParallelModel::Impl::ClassifyParameters(const Batch& example) {
  std::set<const c10::TensorImpl*> seen;
  std::vector<std::string> names;
  for (const StageChunk& c : part.chunks) {
    for (int64_t i = c.first_layer; i < c.end_layer; ++i) {
      for (const auto& [name, p] : part.layers->LayerParameters(i)) {
        if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
        parameters.emplace_back(name, p);
        names.push_back(name);
      }
    }
    reads_data |= c.first_layer == 0;
    for (int64_t i = c.first_layer; i < c.end_layer; ++i) reads_data |= !part.layers->BatchFields(i).empty();
  }
  reads_data |= HoldsLastStage();
  std::map<std::string, ShardSpec> specs = part.shards;  // traced shards and adapters
  if (source.shards) {
    for (const auto& [name, spec] : source.shards(*part.layers)) specs.emplace(name, spec);
  }
  for (const auto& [name, spec] : specs) {
    if (std::find(names.begin(), names.end(), name) != names.end()) shards[name] = spec;
  }
  for (const auto& [name, p] : parameters) {
    if (p.requires_grad()) trainable.emplace_back(name, p);
  }
  // A parameter several stages hold (by name) is tied: its gradients are summed.
  std::vector<std::vector<std::string>> by_stage = {names};
  if (pp != nullptr) {
    TRIDENT_ASSIGN_OR_RETURN(by_stage, AllGatherStrings(*pp, names));
  }
  std::map<std::string, std::vector<int>> holders;
  for (int s = 0; s < static_cast<int>(by_stage.size()); ++s) {
    for (const std::string& name : by_stage[s]) holders[name].push_back(s);
  }
  for (const auto& [name, stages_holding] : holders) {  // by name: the same order on every holder
    if (stages_holding.size() < 2 || !std::count(names.begin(), names.end(), name)) continue;
    for (const auto& [n, p] : trainable) {  // frozen copies stay equal by themselves
      if (n != name) continue;
      tied.emplace_back(n, p);
      tied_holders.push_back(stages_holding);
    }
  }
  int64_t local_count = 0, local_frozen = 0;
  for (const auto& [name, p] : parameters) {
    const bool copy = holders[name].front() != stage;  // a tied copy a lower stage counts
    const bool replicated_here = !shards.count(name);
    if (replicated_here && p.requires_grad()) replicated.push_back(p);
    if (!copy && (!replicated_here || tp == nullptr || tp->rank() == 0) && p.requires_grad()) counted.push_back(p);
    const int64_t count = copy ? 0 : p.numel() * (replicated_here || tp == nullptr ? 1 : tp->size());
    local_count += count;
    if (!p.requires_grad()) local_frozen += count;
  }
  at::Tensor total = at::tensor({local_count, local_frozen}, at::kLong);
  if (pp != nullptr) TRIDENT_RETURN_IF_ERROR(pp->AllReduce(total));
  num_parameters = total[0].item<int64_t>();
  const int64_t frozen = total[1].item<int64_t>();
  const at::Tensor& first = example.at(0);
  const double tokens_per_sample = first.dim() > 1 ? first.numel() / first.size(0) : 1;
  if (source.flops_per_sample) {
    flops_per_sample = source.flops_per_sample(num_parameters);
  } else if (part.traced) {
    flops_per_sample = part.flops_per_sample;
  } else {
    flops_per_sample = 6.0 * num_parameters * tokens_per_sample;
  }
  // Frozen parameters need no weight gradients: 2 of their 6 FLOPs per token are not spent.
  flops_per_sample -= 2.0 * frozen * tokens_per_sample;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<double>> ParallelModel::Impl::LossWeights(const std::vector<Batch>& batches) const {
  const size_t M = batches.size();
  if (plan.reduction().gradients() == ReductionSpec::mean) return std::vector<double>(M, 1.0 / M);
  // The reducer averages over data parallelism: a sum is the average times dp.
  const double dp_size = DataParallelSize();
  if (plan.reduction().gradients() == ReductionSpec::sum) return std::vector<double>(M, dp_size);
  std::vector<double> tokens(M, 0.0);
  if (HoldsLastStage()) {
    for (size_t m = 0; m < M; ++m) {
      const at::Tensor& targets = batches[m].at(batches[m].size() - 1);
      tokens[m] = at::isFloatingType(targets.scalar_type()) ? targets.numel() : (targets >= 0).sum().item<double>();
    }
  }
  at::Tensor total = at::full({1}, std::accumulate(tokens.begin(), tokens.end(), 0.0), at::kDouble);
  if (dp != nullptr) TRIDENT_RETURN_IF_ERROR(dp->AllReduce(total));
  const double global = std::max(1.0, total.item<double>());
  std::vector<double> weights;
  for (double t : tokens) weights.push_back(t * dp_size / global);
  return weights;
}

ParallelModel::ParallelModel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ParallelModel::~ParallelModel() = default;

absl::StatusOr<double> ParallelModel::ForwardBackward(const std::vector<Batch>& micro_batches) {
  TRIDENT_ASSIGN_OR_RETURN(PendingScalar loss, ForwardBackwardWithoutWaiting(micro_batches));
  return loss.Get();
}

absl::StatusOr<PendingScalar> ParallelModel::ForwardBackwardWithoutWaiting(const std::vector<Batch>& micro_batches) {
  Impl& m = *impl_;
  if (static_cast<int64_t>(micro_batches.size()) != m.plan.num_micro_batches()) {
    return absl::InvalidArgumentError(absl::StrCat("ForwardBackward got ", micro_batches.size(),
                                                   " micro-batches; the plan has ", m.plan.num_micro_batches()));
  }
  // Counted where the batches are given (the host's, usually): counting the
  // device's copies would wait for the GPU.
  TRIDENT_ASSIGN_OR_RETURN(std::vector<double> weights, m.LossWeights(micro_batches));
  const std::vector<Batch> batches = m.OnDevice(micro_batches);
  std::vector<double> losses;
  {
    AutocastScope autocast(m.precision, m.device.type());
    TRIDENT_ASSIGN_OR_RETURN(losses, m.runner->RunStep(batches, weights));
  }
  if (m.plan.tensor_parallel().sequence_parallel())
    TRIDENT_RETURN_IF_ERROR(m.update->SumOverTensorParallel(m.replicated));
  const double sum = std::accumulate(losses.begin(), losses.end(), 0.0);
  if (m.plan.reduction().loss() == ReductionSpec::sum) return m.Share(sum, ReduceOp::kSum);
  return m.Share(sum / std::max<size_t>(1, losses.size()), ReduceOp::kAvg);
}

void ParallelModel::ZeroGrad() { impl_->update->ZeroGrad(); }

absl::StatusOr<bool> ParallelModel::UnscaleGradients() {
  Impl& m = *impl_;
  if (!m.scaler) return false;
  at::Tensor flag = at::full({1}, m.update->LocalGradientsNonFinite() ? 1.0 : 0.0, at::kFloat);
  TRIDENT_RETURN_IF_ERROR(m.topology->world().AllReduce(flag, ReduceOp::kMax));
  if (flag.item<float>() > 0) {
    m.scaler->Update(true);
    return true;
  }
  if (m.scaler->scale() != 1.0) m.update->ScaleGradients(1.0 / m.scaler->scale());
  m.scaler->Update(false);
  return false;
}

absl::StatusOr<double> ParallelModel::ClipGradNorm(double max_norm) {
  TRIDENT_ASSIGN_OR_RETURN(PendingScalar norm, ClipGradNormWithoutWaiting(max_norm));
  return norm.Get();
}

absl::StatusOr<PendingScalar> ParallelModel::ClipGradNormWithoutWaiting(double max_norm) {
  return impl_->update->ClipGradNorm(max_norm);
}

absl::Status ParallelModel::Step(double lr) { return impl_->update->Step(lr); }

absl::StatusOr<double> ParallelModel::EvaluateLoss(const std::vector<Batch>& micro_batches) {
  Impl& m = *impl_;
  AutocastScope autocast(m.precision, m.device.type());
  TRIDENT_ASSIGN_OR_RETURN(std::vector<double> losses, m.runner->RunForward(m.OnDevice(micro_batches)));
  const double sum = std::accumulate(losses.begin(), losses.end(), 0.0);
  TRIDENT_ASSIGN_OR_RETURN(PendingScalar loss, m.Share(sum / std::max<size_t>(1, losses.size()), ReduceOp::kAvg));
  return loss.Get();
}

absl::StatusOr<Values> ParallelModel::Forward(const Batch& batch) {
  Impl& m = *impl_;
  c10::NoGradGuard no_grad;
  AutocastScope autocast(m.precision, m.device.type());
  std::vector<StageChunk> chunks = m.part.chunks;  // the training specs stay as they are
  TRIDENT_ASSIGN_OR_RETURN(StagePass pass, ForwardThroughStages(*m.part.layers, chunks, m.pp, m.OnDevice({batch})[0]));
  return pass.outputs;
}

void ParallelModel::SetTraining(bool training) { impl_->part.layers->SetTraining(training); }

bool ParallelModel::ReadsData() const { return impl_->reads_data; }
const NamedTensors& ParallelModel::parameters() const {
  // ZeRO 1 and 2: the values of the last Step (a failure also fails the next step).
  (void)impl_->update->WaitForUpdatedParameters();
  return impl_->parameters;
}
const std::map<std::string, ShardSpec>& ParallelModel::shard_specs() const { return impl_->shards; }
absl::Status ParallelModel::GatherFullParameters() { return impl_->update->GatherFullParameters(); }
absl::Status ParallelModel::ReleaseFullParameters(bool keep_changes) {
  return impl_->update->ReleaseFullParameters(keep_changes);
}

const ParallelPlan& ParallelModel::plan() const { return impl_->plan; }
const ModelSource& ParallelModel::source() const { return impl_->source; }
Topology& ParallelModel::topology() const { return *impl_->topology; }
int ParallelModel::stage() const { return impl_->stage; }
int ParallelModel::stages() const { return impl_->stages(); }
const ProcessGroup* ParallelModel::data_parallel_group() const { return impl_->dp; }
const ProcessGroup* ParallelModel::tensor_parallel_group() const { return impl_->tp; }
const ProcessGroup* ParallelModel::pipeline_group() const { return impl_->pp; }
LayerSequence& ParallelModel::layers() { return *impl_->part.layers; }
int64_t ParallelModel::num_parameters() const { return impl_->num_parameters; }
double ParallelModel::flops_per_sample() const { return impl_->flops_per_sample; }
MemoryReport ParallelModel::Memory() const {
  MemoryReport report = impl_->update->Memory();
  for (const auto& [name, p] : impl_->parameters) {  // frozen: held, never updated
    if (!p.requires_grad()) report.parameter_bytes += p.numel() * static_cast<int64_t>(p.element_size());
  }
  return report;
}
std::optional<double> ParallelModel::loss_scale() const {
  return impl_->scaler ? std::optional<double>(impl_->scaler->scale()) : std::nullopt;
}
const std::vector<TimelineEvent>& ParallelModel::timeline() const { return impl_->runner->timeline(); }

std::string ParallelModel::Describe() const {
  const Impl& m = *impl_;
  const Plan& plan = m.part.stage_plan;
  std::string text;
  for (const StagePlan& s : plan.stages()) {
    const bool named = s.layer_names_size() > 0;
    absl::StrAppend(
        &text, absl::StrFormat("  virtual stage %d: %s %d-%d (%s .. %s)\n", s.stage(),
                               m.part.traced ? "shards" : "layers", s.first_layer(), s.end_layer() - 1,
                               named ? s.layer_names(0) : "", named ? s.layer_names(s.layer_names_size() - 1) : ""));
  }
  if (!m.part.tensor_parallel_report.empty()) {
    absl::StrAppend(&text, "  automatic tensor parallelism:\n", m.part.tensor_parallel_report);
  }
  if (m.plan.trace().no_tie_modules() && m.part.traced) {
    absl::StrAppend(&text, "  no_tie_modules: ",
                    m.part.untied.empty() ? "the model ties no parameters" : absl::StrJoin(m.part.untied, ", "), "\n");
  }
  if (!m.plan.module_replace().empty()) absl::StrAppend(&text, "  ", m.part.replace_report.Summary(), " (this rank)\n");
  if (!m.plan.recompute().modules().empty()) {
    std::vector<std::string> hits;
    for (int i = 0; i < m.plan.recompute().modules().size(); ++i) {
      hits.push_back(absl::StrCat(m.plan.recompute().modules()[i], " ", m.part.recompute_hits.at(i)));
    }
    absl::StrAppend(&text, "  checkpoint_modules: ", absl::StrJoin(hits, ", "),
                    m.part.traced ? " (modules whose operators recompute in backward)\n"
                                  : " (modules recomputing in backward on this rank)\n");
  }
  if (m.plan.has_lora()) {
    int64_t trainable = 0, all = 0;
    for (const auto& [name, p] : m.parameters) {
      all += p.numel();
      if (p.requires_grad()) trainable += p.numel();
    }
    absl::StrAppend(&text, absl::StrFormat("  LoRA adapter '%s' (r %d, scale %g): %d of this rank's %d parameters "
                                           "train (%.2f%%), the rest are frozen\n",
                                           m.plan.lora().adapter_name(), m.plan.lora().r(), LoraScale(m.plan.lora()),
                                           trainable, all, 100.0 * trainable / std::max<int64_t>(1, all)));
  }
  auto tensors = [](size_t n) { return absl::StrCat(n, n == 1 ? " tensor" : " tensors"); };
  for (size_t c = 0; c < m.part.chunks.size(); ++c) {
    const StageChunk& chunk = m.part.chunks[c];
    absl::StrAppend(&text, "  here, virtual stage ", c * m.stages() + m.stage, " receives ",
                    tensors(chunk.received.size()), " and sends ", tensors(chunk.sent.size()), "\n");
  }
  return text;
}

}  // namespace trident
