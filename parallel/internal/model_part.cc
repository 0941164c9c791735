#include "parallel/internal/model_part.h"

#include <algorithm>

#include <torch/nn/module.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "amp/amp.h"
#include "base/module_names.h"
#include "base/recompute.h"
#include "base/status.h"
#include "graph/graph_layers.h"
#include "graph/model_graph.h"
#include "partition/partition.h"
#include "tensor_parallel/tensor_parallel.h"

namespace trident {
namespace internal {
namespace {

Values Select(const Batch& batch, const std::vector<int>& fields) {
  Values selected;
  for (int f : fields) selected.push_back(batch.at(f));
  return selected;
}

// The model's forward over the selected fields, with the loss function's result
// first among the outputs when one is given.
std::function<Values(const Batch&)> ForwardWithLoss(std::function<Values(const Values&)> forward,
                                                    std::vector<int> inputs, LossFunction loss) {
  return [forward = std::move(forward), inputs = std::move(inputs), loss = std::move(loss)](const Batch& batch) {
    Values outputs = forward(Select(batch, inputs));
    if (loss) outputs.insert(outputs.begin(), loss(batch, outputs));
    return outputs;
  };
}

// A module run eagerly as one layer (trace_method "none").
class EagerModuleLayer : public LayerSequence {
 public:
  EagerModuleLayer(std::shared_ptr<torch::nn::Module> module, std::function<Values(const Batch&)> forward,
                   int num_fields)
      : module_(std::move(module)), forward_(std::move(forward)), num_fields_(num_fields) {}
  int64_t NumLayers() const override { return 1; }
  std::string LayerName(int64_t) const override { return "module"; }
  Values ForwardLayer(int64_t, const Values&, const Batch& batch) override { return forward_(batch); }
  std::vector<int> BatchFields(int64_t) const override {
    std::vector<int> fields(num_fields_);
    for (int f = 0; f < num_fields_; ++f) fields[f] = f;
    return fields;
  }
  NamedTensors LayerParameters(int64_t) override {
    NamedTensors parameters;
    for (const auto& item : module_->named_parameters()) parameters.emplace_back(item.key(), item.value());
    return parameters;
  }
  void To(const at::Device& device) override { module_->to(device); }
  void SetTraining(bool training) override { module_->train(training); }

 private:
  std::shared_ptr<torch::nn::Module> module_;
  std::function<Values(const Batch&)> forward_;
  int num_fields_;
};

Batch ToDevice(const Batch& batch, const at::Device& device) {
  Batch moved;
  for (const at::Tensor& t : batch) moved.push_back(t.to(device));
  return moved;
}

// The same shapes with the samples in another order, to check a trace against
// (nothing when a micro-batch has one sample).
Batch CheckBatch(const Batch& example) {
  for (const at::Tensor& t : example) {
    if (t.dim() == 0 || t.size(0) < 2) return {};
  }
  Batch rolled;
  for (const at::Tensor& t : example) rolled.push_back(t.roll(1, 0));
  return rolled;
}

absl::Status CheckShards(int64_t shards, const ParallelPlan& plan) {
  const int64_t stages = static_cast<int64_t>(plan.pp()) * plan.virtual_stages();
  if (shards >= stages) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("pp*virtual_stages = ", stages,
                                                 " pipeline stages but the traced model split into ", shards,
                                                 " shards; lower pp or virtual_stages or raise shard_count"));
}

PartitionOptions StagePartition(const ParallelPlan& plan) {
  PartitionOptions options;
  options.num_stages = plan.pp() * plan.virtual_stages();
  options.partition_method = plan.pipeline().partition_method();
  options.custom_split_points.assign(plan.pipeline().custom_split_points().begin(),
                                     plan.pipeline().custom_split_points().end());
  return options;
}

// Layer sources: plan the stages over the layers (profiled one at a time when
// the partition method weighs them) and build this rank's chunks only.
absl::Status BuildLayers(const ModelSource& source, const ParallelPlan& plan, const Batch& example, ModelPart* part) {
  PartitionOptions options = StagePartition(plan);
  std::vector<LayerProfile> profile;
  const bool weighed = options.custom_split_points.empty() && options.partition_method != "uniform" &&
                       options.partition_method != "uniform_floor" && options.partition_method != "custom";
  if (!weighed) {
    // Only the layer names are needed: any one-layer part knows them all.
    const int64_t probe = std::min<int64_t>(1, source.num_layers - 1);
    TRIDENT_ASSIGN_OR_RETURN(auto namer, source.build({{probe, probe + 1}}));
    for (int64_t i = 0; i < source.num_layers; ++i) profile.push_back({namer->LayerName(i)});
  } else {
    // Memory-light: one layer at a time, on one sample.
    Batch sample;
    for (const at::Tensor& t : example) sample.push_back(t.dim() > 0 ? t.narrow(0, 0, 1) : t);
    TRIDENT_ASSIGN_OR_RETURN(profile, ProfileLayersOneByOne(
                                          source.num_layers,
                                          [&](int64_t i) {
                                            return source.build({{i, i + 1}});
                                          },
                                          sample));
  }
  TRIDENT_ASSIGN_OR_RETURN(part->stage_plan, PlanStages(profile, options));
  return absl::OkStatus();
}

// The dtype the model computes in under plan.precision().mode(): the autocast dtype,
// or the parameters' without autocast (pure_bf16).
absl::StatusOr<at::ScalarType> ComputeDtype(const ParallelPlan& plan) {
  TRIDENT_ASSIGN_OR_RETURN(PrecisionPolicy precision,
                           MakePrecisionPolicy(plan.precision().mode(), plan.precision().table()));
  return precision.compute != at::kFloat ? precision.compute : precision.param;
}

// A module or TorchScript source run whole: traced into a graph cut into
// shards (trace_method "jit") or run eagerly as one layer ("none").
struct WholeModel {
  std::shared_ptr<LayerSequence> layers;  // the loss inside, first among the last layer's outputs
  std::vector<LayerProfile> shards;       // traced: what each shard reads and computes (else empty)
  double total_flops = 0;                 // traced: forward FLOPs of one micro-batch
  std::map<std::string, std::string> aliases;
  std::vector<std::string> untied;                          // traced with plan.trace().no_tie_modules()
  std::map<std::string, ShardSpec> tensor_parallel_shards;  // traced at tp > 1
  std::string tensor_parallel_report;
  std::vector<int> lora_target_hits;  // traced with plan.lora()
  std::vector<int> recompute_hits;    // traced with plan.recompute().modules()
  ReplaceReport replace_report;       // traced with plan.module_replace()
  bool values_deferred = false;       // a TorchScript file's, read by MaterializeLayer
};

// The automatic tensor-parallel pass's options: its cost model at rates of
// the plan's device (conservative: a product's CPU rate on one core, Gloo
// over loopback; a GPU's bf16 rate at half its peak, NVLink-class links).
AutoTensorParallelOptions AutoTensorParallelCosts(const ParallelPlan& plan, bool loss_only) {
  AutoTensorParallelOptions options;
  options.loss_only = loss_only;
  options.layers = plan.tensor_parallel().layer_lists();
  if (plan.tensor_parallel().split_all()) return options;
  const bool cuda = plan.device() == ParallelPlan::cuda;
  options.flops_per_second = cuda ? 200e12 : 50e9;
  options.bytes_per_second = cuda ? 100e9 : 1e9;
  options.collective_latency_s = cuda ? 20e-6 : 100e-6;
  return options;
}

// Whether a TorchScript file's parameter values are read layer by layer, by
// the ranks that keep each layer, rather than whole on load: on the CPU, where
// no pass reads them before the layers are built (tensor parallelism slices
// them, untying and module replacement copy them).
bool DefersValues(const ModelSource& source, const ParallelPlan& plan, const at::Device& device) {
  return source.kind == ModelSource::Kind::kTorchScript && device.is_cpu() && plan.tp() == 1 &&
         !plan.trace().no_tie_modules() && plan.module_replace().empty();
}

absl::StatusOr<WholeModel> TraceGraph(const ModelSource& source, const ParallelPlan& plan, int tp_rank,
                                      const at::Device& device, const Batch& example) {
  NamedTensors parameters;
  std::function<Values(const Values&)> forward;
  std::shared_ptr<void> owner;
  std::vector<std::string> arguments;                               // TorchScript: forward's argument names
  std::map<std::string, std::string> module_types;                  // for checkpoint_modules by class
  std::function<void(const std::vector<at::Tensor>&)> read_values;  // deferred values
  if (source.kind == ModelSource::Kind::kTorchScript) {
    TRIDENT_ASSIGN_OR_RETURN(TorchScriptModule module,
                             TorchScriptModule::Load(source.torchscript_path, DefersValues(source, plan, device)));
    read_values = module.read_values;
    TRIDENT_RETURN_IF_ERROR(CatchExceptions("moving the module to the device", [&] { module.to(device); }));
    parameters = module.parameters;
    forward = module.forward;
    owner = module.module;
    arguments = module.argument_names;
    module_types = module.module_types;
  } else {
    TRIDENT_RETURN_IF_ERROR(CatchExceptions("moving the module to the device", [&] { source.module->to(device); }));
    for (const auto& item : source.module->named_parameters()) parameters.emplace_back(item.key(), item.value());
    for (const auto& item : source.module->named_modules()) module_types[item.key()] = item.value()->name();
    forward = source.forward;
    owner = source.module;
  }
  TRIDENT_ASSIGN_OR_RETURN(std::vector<int> inputs,
                           SelectInputs(plan.trace().input_names(), plan.trace().batch_fields(), example.size()));
  if (!arguments.empty() && arguments.size() != inputs.size()) {
    std::vector<std::string> given;
    for (int f : inputs) {
      given.push_back(f < static_cast<int>(plan.trace().batch_fields().size()) ? plan.trace().batch_fields()[f]
                                                                               : absl::StrCat("field ", f));
    }
    return absl::InvalidArgumentError(absl::StrCat("forward of ", source.torchscript_path, " takes ", arguments.size(),
                                                   " input(s) (", absl::StrJoin(arguments, ", "), ") but is given ",
                                                   inputs.size(), " (", absl::StrJoin(given, ", "),
                                                   "); choose them with input_names"));
  }
  auto traced_forward = ForwardWithLoss(forward, inputs, source.loss);
  const Batch on_device = ToDevice(example, device);
  TRIDENT_ASSIGN_OR_RETURN(std::unique_ptr<ModelGraph> graph,
                           ModelGraph::Trace(parameters, on_device, traced_forward, CheckBatch(on_device), owner));
  WholeModel whole;
  if (plan.trace().no_tie_modules()) {  // each name of a tied parameter its own, traced again
    TRIDENT_ASSIGN_OR_RETURN(ModelGraph::Untied untied, graph->Untie());
    TRIDENT_ASSIGN_OR_RETURN(
        graph, ModelGraph::Trace(untied.parameters, on_device, untied.forward, CheckBatch(on_device), owner));
    whole.untied = std::move(untied.untied);
  }
  whole.aliases = graph->aliases();
  if (plan.tp() > 1) {  // this rank's part of every product the automatic pass splits, traced again
    TRIDENT_ASSIGN_OR_RETURN(
        TensorParallelGraph sharded,
        AutoTensorParallel(*graph,
                           TensorParallelism{plan.tp(), tp_rank, "tp", plan.tensor_parallel().sequence_parallel(),
                                             plan.tensor_parallel().parallel_vocab()},
                           AutoTensorParallelCosts(plan, !source.returns_logits)));
    // The rewritten graph holds this rank's parameters itself: a loaded
    // TorchScript module, and with it the full tensors of the split ones, is
    // released (a C++ module stays the user's).
    TRIDENT_ASSIGN_OR_RETURN(graph,
                             ModelGraph::Trace(sharded.parameters, on_device, sharded.forward, CheckBatch(on_device)));
    whole.tensor_parallel_shards = std::move(sharded.shards);
    whole.tensor_parallel_report = sharded.plan.Report();
    owner = nullptr;  // later graphs hold this rank's parameters themselves
  }
  if (plan.has_lora()) {  // every target linear product gains its adapter (sliced as it is), traced again
    TRIDENT_ASSIGN_OR_RETURN(LoraGraph adapted,
                             ApplyLoraToGraph(*graph, plan.lora(), plan.seed(), whole.tensor_parallel_shards));
    whole.lora_target_hits = std::move(adapted.layers.target_hits);
    whole.tensor_parallel_shards.insert(adapted.layers.shards.begin(), adapted.layers.shards.end());
    TRIDENT_ASSIGN_OR_RETURN(
        graph, ModelGraph::Trace(adapted.parameters, on_device, adapted.forward, CheckBatch(on_device), owner));
  }
  if (!plan.module_replace().empty()) {  // the pairs' operator patterns, on this rank's graph
    TRIDENT_ASSIGN_OR_RETURN(at::ScalarType dtype, ComputeDtype(plan));
    TRIDENT_ASSIGN_OR_RETURN(ReplacedGraph replaced, ReplaceInGraph(*graph, ToVector(plan.module_replace()), dtype));
    TRIDENT_ASSIGN_OR_RETURN(
        graph, ModelGraph::Trace(replaced.parameters, on_device, replaced.forward, CheckBatch(on_device), owner));
    whole.replace_report = std::move(replaced.report);
  }
  const std::string split = plan.trace().split_method().empty() ? "farthest_min_deps" : plan.trace().split_method();
  const int shard_count = plan.trace().shard_count() > 0 ? plan.trace().shard_count() : DefaultShardCount(*graph);
  TRIDENT_ASSIGN_OR_RETURN(std::vector<int64_t> shards,
                           SplitIntoShards(*graph, split, shard_count,
                                           {plan.trace().leaf_modules().begin(), plan.trace().leaf_modules().end()}));
  whole.shards = ShardProfiles(*graph, shards);
  whole.total_flops = graph->total_flops();
  ModuleSpans recomputed;  // ATorch's checkpoint method: found by the modules' parameters
  if (!plan.recompute().modules().empty()) {
    TRIDENT_ASSIGN_OR_RETURN(
        recomputed,
        FindModuleSpans(*graph, {plan.recompute().modules().begin(), plan.recompute().modules().end()}, module_types));
    whole.recompute_hits = std::move(recomputed.hits);
  }
  std::shared_ptr<ModelGraph> shared(std::move(graph));
  TRIDENT_ASSIGN_OR_RETURN(std::unique_ptr<GraphLayers> layers, GraphLayers::Create(shared, shards, recomputed.spans));
  whole.values_deferred = static_cast<bool>(read_values);
  if (read_values) layers->DeferValues(std::move(read_values));
  whole.layers = std::move(layers);
  return whole;
}

absl::StatusOr<WholeModel> RunWhole(const ModelSource& source, const ParallelPlan& plan, int tp_rank,
                                    const at::Device& device, const Batch& example) {
  if (plan.trace().method() == TraceSpec::jit) return TraceGraph(source, plan, tp_rank, device, example);
  if (plan.trace().method() != TraceSpec::none) {
    return absl::InternalError("trace_method=layers runs the module's LayerSequence, never the module whole");
  }
  if (source.kind != ModelSource::Kind::kModule) {
    return absl::InvalidArgumentError(
        "trace_method=none runs a C++ module; a TorchScript file is traced (trace_method=jit)");
  }
  TRIDENT_ASSIGN_OR_RETURN(std::vector<int> inputs,
                           SelectInputs(plan.trace().input_names(), plan.trace().batch_fields(), example.size()));
  WholeModel whole;
  whole.layers = std::make_shared<EagerModuleLayer>(source.module, ForwardWithLoss(source.forward, inputs, source.loss),
                                                    static_cast<int>(example.size()));
  return whole;
}

// A module with trace_method "layers" as the layer source it is.
absl::StatusOr<ModelSource> ResolveLayerModule(const ModelSource& source, const ParallelPlan& plan) {
  if (source.kind != ModelSource::Kind::kModule || plan.trace().method() != TraceSpec::layers) return source;
  auto layers = std::dynamic_pointer_cast<LayerSequence>(source.module);
  if (layers == nullptr) {
    return absl::InvalidArgumentError(
        "trace_method=layers needs a model that is a LayerSequence (graph/graph.h); this module "
        "is not one: trace it (trace_method=jit) or declare its layers");
  }
  ModelSource resolved = ModelSource::FromLayers(layers);
  resolved.loss = source.loss;
  return resolved;
}

// Adds plan.lora()'s adapters to `module` (a layer part, or a module run
// eagerly) and records them in `part`.
absl::Status AddAdapters(torch::nn::Module& module, const ParallelPlan& plan, ModelPart* part) {
  TRIDENT_ASSIGN_OR_RETURN(LoraLayers adapted, ApplyLora(module, plan.lora(), plan.seed()));
  part->lora_target_hits = std::move(adapted.target_hits);
  part->shards.insert(adapted.shards.begin(), adapted.shards.end());
  return absl::OkStatus();
}

// Turns on recomputation in the modules plan.recompute().modules() names.
// Errors name a matched module that cannot recompute itself.
absl::Status MarkRecomputedModules(torch::nn::Module& model, const ParallelPlan& plan, ModelPart* part) {
  part->recompute_hits.assign(plan.recompute().modules().size(), 0);
  for (const auto& item : model.named_modules()) {
    for (int i = 0; i < plan.recompute().modules().size(); ++i) {
      const std::string& pattern = plan.recompute().modules()[i];
      if (!ModuleNameMatches(item.key(), pattern) && !ModuleTypeMatches(item.value()->name(), pattern)) continue;
      auto* recomputable = dynamic_cast<RecomputableModule*>(item.value().get());
      if (recomputable == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(
            "checkpoint_modules: module '", item.key(), "' (", item.value()->name(),
            ") cannot recompute its forward; name the zoo's attention or MLP blocks (attn, mlp; self_attn), or "
            "make the module a RecomputableModule (base/recompute.h)"));
      }
      recomputable->set_recompute(true);
      ++part->recompute_hits[i];
    }
  }
  return absl::OkStatus();
}

// The module of a layer source's part or of an eager module source, for
// per-module options (LoRA, recomputation); nullptr for traced sources.
torch::nn::Module* ModuleOf(const ModelSource& source, const ParallelPlan& plan, const ModelPart& part) {
  if (source.kind == ModelSource::Kind::kLayers) return dynamic_cast<torch::nn::Module*>(part.layers.get());
  if (source.kind == ModelSource::Kind::kModule && plan.trace().method() == TraceSpec::none) return source.module.get();
  return nullptr;
}

// no_tie_modules unties traced graphs (TraceGraph); a part that is not traced
// and still ties parameters (the source's aliases, or one tensor under two
// names of its module) is refused.
absl::Status CheckUntied(const ModelSource& source, const ParallelPlan& plan, const ModelPart& part) {
  std::map<std::string, std::string> tied = source.aliases;
  if (torch::nn::Module* module = ModuleOf(source, plan, part)) {
    std::map<const void*, std::string> names;
    for (const auto& item : module->named_parameters()) {
      auto [it, first] = names.emplace(item.value().unsafeGetTensorImpl(), item.key());
      if (!first) tied.emplace(item.key(), it->second);
    }
  }
  if (tied.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "no_tie_modules: the model ties ", tied.begin()->first, " to ", tied.begin()->second,
      " and is not traced, so Trident cannot give each name its own tensor; untie them in the model (the zoo's "
      "gpt does with tie_word_embeddings=false) or trace it (trace_method=jit)"));
}

// LoRA on a module run eagerly: through its own linear layers (ParallelLinear).
// Traced models get theirs in the graph (TraceGraph).
absl::Status AddAdaptersToEagerModule(const ModelSource& source, const ParallelPlan& plan, ModelPart* part) {
  if (!plan.has_lora() || plan.trace().method() != TraceSpec::none || source.kind != ModelSource::Kind::kModule) {
    return absl::OkStatus();
  }
  return AddAdapters(*source.module, plan, part);
}

}  // namespace

absl::StatusOr<std::vector<int>> SelectInputs(const google::protobuf::RepeatedPtrField<std::string>& input_names,
                                              const google::protobuf::RepeatedPtrField<std::string>& field_names,
                                              size_t num_fields) {
  std::vector<int> fields;
  if (input_names.empty()) {
    for (size_t f = 0; f < num_fields; ++f) fields.push_back(static_cast<int>(f));
    return fields;
  }
  for (const std::string& name : input_names) {
    auto it = std::find(field_names.begin(), field_names.end(), name);
    if (it == field_names.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("input_names names '", name, "', which the batch does not have; its fields are ",
                       field_names.empty() ? "unnamed" : absl::StrJoin(field_names, ", ")));
    }
    fields.push_back(static_cast<int>(it - field_names.begin()));
  }
  return fields;
}

absl::StatusOr<ModelPart> BuildModelPart(const ModelSource& given, const ParallelPlan& plan, int stage, int tp_rank,
                                         const at::Device& device, const Batch& example) {
  ModelPart part;
  TRIDENT_ASSIGN_OR_RETURN(ModelSource source, ResolveLayerModule(given, plan));
  if (source.kind == ModelSource::Kind::kLayers) {
    TRIDENT_RETURN_IF_ERROR(BuildLayers(source, plan, example, &part));
  } else {
    TRIDENT_RETURN_IF_ERROR(AddAdaptersToEagerModule(source, plan, &part));
    TRIDENT_ASSIGN_OR_RETURN(WholeModel whole, RunWhole(source, plan, tp_rank, device, example));
    part.layers = std::move(whole.layers);
    part.loss_inside = true;
    part.traced = !whole.shards.empty();
    if (part.traced) {
      TRIDENT_RETURN_IF_ERROR(CheckShards(static_cast<int64_t>(whole.shards.size()), plan));
      TRIDENT_ASSIGN_OR_RETURN(part.stage_plan, PlanStages(whole.shards, StagePartition(plan)));
      part.flops_per_sample = 3.0 * whole.total_flops / std::max<int64_t>(1, plan.micro_batch_size());
      part.aliases = std::move(whole.aliases);
      part.shards.insert(whole.tensor_parallel_shards.begin(), whole.tensor_parallel_shards.end());
      part.tensor_parallel_report = std::move(whole.tensor_parallel_report);
      if (plan.has_lora()) part.lora_target_hits = std::move(whole.lora_target_hits);
      part.replace_report = std::move(whole.replace_report);
      part.recompute_hits = std::move(whole.recompute_hits);
      part.untied = std::move(whole.untied);
    } else {
      TRIDENT_ASSIGN_OR_RETURN(part.stage_plan, PlanStages({{"module"}}, StagePartition(plan)));
    }
  }
  LayerRanges ranges;
  for (int c = 0; c < plan.virtual_stages(); ++c) {  // chunk c is virtual stage c * pp + stage
    const StagePlan& planned = part.stage_plan.stages(c * plan.pp() + stage);
    part.chunks.push_back({planned.first_layer(), planned.end_layer()});
    ranges.emplace_back(planned.first_layer(), planned.end_layer());
  }
  // ZeRO-3 draws the values layer by layer as it shards them, where nothing
  // reads them first (a dtype conversion, a copy to the GPU); otherwise a
  // traced part loaded without its values reads its own layers' now.
  TRIDENT_ASSIGN_OR_RETURN(PrecisionPolicy precision,
                           MakePrecisionPolicy(plan.precision().mode(), plan.precision().table()));
  const bool zero_draws = plan.zero().stage() == 3 && device.is_cpu() && precision.param == at::kFloat;
  if (part.traced && !zero_draws) {
    TRIDENT_RETURN_IF_ERROR(CatchExceptions("reading the model's values", [&] {
      for (const auto& [first, end] : ranges) {
        for (int64_t i = first; i < end; ++i) part.layers->MaterializeLayer(i);
      }
    }));
  }
  if (source.kind == ModelSource::Kind::kLayers) {
    const bool deferred = zero_draws && source.build_deferred;
    TRIDENT_ASSIGN_OR_RETURN(part.layers, deferred ? source.build_deferred(ranges) : source.build(ranges));
    if (plan.has_lora()) {
      auto* module = dynamic_cast<torch::nn::Module*>(part.layers.get());
      if (module == nullptr) {
        return absl::InvalidArgumentError(
            "LoRA (lora_config) needs the model's layers to be a torch::nn::Module (as the zoo's are) whose "
            "linear layers are ParallelLinear");
      }
      TRIDENT_RETURN_IF_ERROR(AddAdapters(*module, plan, &part));
    }
  }
  if (plan.trace().no_tie_modules() && !part.traced) TRIDENT_RETURN_IF_ERROR(CheckUntied(source, plan, part));
  if (!plan.recompute().modules().empty() && !part.traced) {
    torch::nn::Module* module = ModuleOf(source, plan, part);
    if (module == nullptr) {
      return absl::InvalidArgumentError(
          "checkpoint_modules needs a model of modules (the zoo, a LayerSequence module, or trace_method=none) or a "
          "traced one (trace_method=jit)");
    }
    TRIDENT_RETURN_IF_ERROR(MarkRecomputedModules(*module, plan, &part));
  }
  if (!plan.module_replace().empty() && !part.traced) {
    torch::nn::Module* module = ModuleOf(source, plan, part);
    if (module == nullptr) {
      return absl::InvalidArgumentError(
          "module_replace needs a model of modules (the zoo, a LayerSequence module, or trace_method=none) or a "
          "traced one (trace_method=jit)");
    }
    TRIDENT_ASSIGN_OR_RETURN(at::ScalarType dtype, ComputeDtype(plan));
    TRIDENT_ASSIGN_OR_RETURN(part.replace_report, ReplaceModules(*module, ToVector(plan.module_replace()), dtype));
  }
  TRIDENT_RETURN_IF_ERROR(CatchExceptions("moving the model to the device", [&] { part.layers->To(device); }));
  return part;
}

}  // namespace internal

absl::StatusOr<SourceLayers> LayersOf(const ModelSource& given, const ParallelPlan& plan, const Batch& example) {
  SourceLayers result;
  TRIDENT_ASSIGN_OR_RETURN(result.layers, internal::ResolveLayerModule(given, plan));
  if (result.layers.kind == ModelSource::Kind::kLayers) return result;
  TRIDENT_ASSIGN_OR_RETURN(internal::WholeModel whole,
                           internal::RunWhole(result.layers, plan, /*tp_rank=*/0, at::kCPU, example));
  for (const LayerProfile& shard : whole.shards) result.forward_flops.push_back(shard.forward_flops);
  result.values_deferred = whole.values_deferred;
  std::shared_ptr<LayerSequence> layers = std::move(whole.layers);
  ModelSource source = ModelSource::FromLayerBuilder(
      layers->NumLayers(),
      [layers](const LayerRanges&) -> absl::StatusOr<std::shared_ptr<LayerSequence>> { return layers; });
  source.aliases = std::move(whole.aliases);
  result.layers = std::move(source);
  return result;
}

}  // namespace trident
