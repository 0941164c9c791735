#include "lora/lora.h"

#include <cmath>
#include <set>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/nn/module.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/module_names.h"
#include "base/rng.h"
#include "base/status.h"
#include "base/text_proto.h"
#include "graph/model_graph.h"

namespace trident {
namespace {

constexpr char kPeftPrefix[] = "base_model.model.";

bool MatchesAny(const std::string& name, const google::protobuf::RepeatedPtrField<std::string>& patterns) {
  for (const std::string& pattern : patterns) {
    if (ModuleNameMatches(name, pattern)) return true;
  }
  return false;
}

// "a.b.weight" -> "a.b"; "weight" -> "".
std::string ModuleOf(const std::string& parameter) {
  const size_t dot = parameter.rfind('.');
  return dot == std::string::npos ? "" : parameter.substr(0, dot);
}

// Whether a module name lies inside an adapter ("x.lora_A", "x.lora_A.default").
bool InsideAdapter(const std::string& module) {
  for (absl::string_view part : absl::StrSplit(module, '.')) {
    if (part == "lora_A" || part == "lora_B") return true;
  }
  return false;
}

// The layer an adapter parameter belongs to ("x.c_attn.lora_A.default.weight" -> "x.c_attn"),
// or nullopt for other parameters and other adapters.
std::optional<std::string> AdaptedLayer(const std::string& parameter, const std::string& adapter) {
  for (const char* part : {"lora_A.", "lora_B."}) {
    const std::string tail = absl::StrCat(part, adapter, ".weight");
    if (parameter == tail) return std::string();
    if (absl::EndsWith(parameter, "." + tail)) return parameter.substr(0, parameter.size() - tail.size() - 1);
  }
  return std::nullopt;
}

// Whether parameter `name` trains under `options`, given the adapted layers.
bool Trains(const std::string& name, const LoraConfig& options, const std::set<std::string>& adapted) {
  if (AdaptedLayer(name, options.adapter_name())) return true;
  const std::string module = ModuleOf(name);
  if (absl::EndsWith(name, "bias")) {
    if (options.bias() == "all" || (options.bias() == "lora_only" && adapted.count(module))) return true;
  }
  for (std::string prefix = module; !prefix.empty(); prefix = ModuleOf(prefix)) {  // the module or one containing it
    if (MatchesAny(prefix, options.modules_to_save())) return true;
  }
  return false;
}

std::set<std::string> AdaptedLayers(const NamedTensors& tensors, const std::string& adapter) {
  std::set<std::string> adapted;
  for (const auto& [name, t] : tensors) {
    if (auto layer = AdaptedLayer(name, adapter)) adapted.insert(*layer);
  }
  return adapted;
}

std::string Join(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : absl::StrCat(prefix, ".", name);
}

// A [r, in] drawn for adapter parameter `a_name`: Kaiming-uniform (a = sqrt(5)), as nn.Linear and PEFT draw it.
at::Tensor DrawA(const std::string& a_name, int64_t r, int64_t in_features, uint64_t seed) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(ParameterSeed(seed, a_name));
  const double bound = 1.0 / std::sqrt(static_cast<double>(in_features));
  c10::NoGradGuard no_grad;
  return at::empty({r, in_features}).uniform_(-bound, bound, generator);
}

std::string AdapterName(const std::string& layer, const char* factor, const LoraConfig& options) {
  return Join(layer, absl::StrCat(factor, ".", options.adapter_name(), ".weight"));
}

// Counts which targets `layer` matches; whether any does.
bool MatchTargets(const std::string& layer, const LoraConfig& options, std::vector<int>& hits) {
  bool hit = false;
  for (int i = 0; i < options.target_modules().size(); ++i) {
    if (ModuleNameMatches(layer, options.target_modules(i))) hit = ++hits[i] > 0;
  }
  return hit;
}

// Freezes every parameter but what trains under `options`; the elements left trainable.
int64_t Freeze(const NamedTensors& parameters, const LoraConfig& options, const std::vector<std::string>& adapted) {
  const std::set<std::string> layers(adapted.begin(), adapted.end());
  int64_t trainable = 0;
  for (const auto& [name, p] : parameters) {
    const bool trains = Trains(name, options, layers);
    p.requires_grad_(trains);
    if (trains) trainable += p.numel();
  }
  return trainable;
}

}  // namespace

double LoraScale(const LoraConfig& lora) { return lora.alpha() / static_cast<double>(lora.r()); }

absl::Status ValidateLoraConfig(const LoraConfig& o) {
  auto invalid = [](const std::string& m) { return absl::InvalidArgumentError(absl::StrCat("lora_config: ", m)); };
  if (o.r() < 1) return invalid(absl::StrCat("r must be at least 1; it is ", o.r()));
  if (!(o.alpha() > 0)) return invalid(absl::StrCat("alpha must be positive; it is ", o.alpha()));
  if (!(o.dropout() >= 0 && o.dropout() < 1))
    return invalid(absl::StrCat("dropout must be in [0, 1); it is ", o.dropout()));
  if (o.target_modules().empty()) {
    return invalid("target_modules is empty; name the linear layers that get adapters (for gpt: c_attn, c_proj, c_fc)");
  }
  if (o.bias() != "none" && o.bias() != "all" && o.bias() != "lora_only") {
    return invalid(absl::StrCat("bias '", o.bias(), "' is unknown; choose none, all or lora_only"));
  }
  if (o.adapter_name().empty() || absl::StrContains(o.adapter_name(), ".")) {
    return invalid(absl::StrCat("adapter_name '", o.adapter_name(), "' must be a non-empty name without '.'"));
  }
  return absl::OkStatus();
}

absl::StatusOr<LoraConfig> ReadLoraConfig(const std::string& path, const std::string& adapter_name) {
  LoraConfig config;
  TRIDENT_RETURN_IF_ERROR(ReadTextProto(path, "lora_config", &config));
  config.set_adapter_name(adapter_name);
  absl::Status valid = ValidateLoraConfig(config);
  if (!valid.ok()) return absl::InvalidArgumentError(absl::StrCat(path, ": ", valid.message()));
  return config;
}

absl::StatusOr<LoraGraph> ApplyLoraToGraph(const ModelGraph& model, const LoraConfig& options, uint64_t seed,
                                           const std::map<std::string, ShardSpec>& shards) {
  TRIDENT_RETURN_IF_ERROR(ValidateLoraConfig(options));
  if (options.dropout() > 0) {
    return absl::UnimplementedError(
        "lora_config: adapter dropout is not offered on traced models; set dropout 0, or declare the model's "
        "layers (LayerSequence with ParallelLinear)");
  }
  using torch::jit::Node;
  using torch::jit::Value;
  std::shared_ptr<torch::jit::Graph> graph = model.jit_graph()->copy();
  const size_t first_parameter = graph->inputs().size() - model.parameters().size();
  ModelGraph::CanonicalizeLinearProducts(*graph, first_parameter);
  LoraGraph result;
  result.layers.target_hits.assign(options.target_modules().size(), 0);
  for (size_t i = 0; i < model.parameters().size(); ++i) {
    result.parameters.emplace_back(model.parameter_names()[i], model.parameters()[i]);
  }
  std::vector<Node*> linears;
  for (Node* node : graph->nodes()) {
    if (node->kind() == c10::aten::linear) linears.push_back(node);
  }
  // The region collective `node` (the entry of a column product's input, or
  // the reduction of a row product's output) applied again to `x`.
  auto same_collective = [&](Node* node, Value* x) {
    std::vector<torch::jit::NamedValue> inputs = {x};
    for (size_t i = 1; i < node->inputs().size(); ++i) inputs.emplace_back(node->input(i));
    return graph->insert(node->kind(), inputs);
  };
  auto region_op = [](const Node* node, std::initializer_list<const char*> kinds) {
    for (const char* kind : kinds) {
      if (node->kind() == c10::Symbol::fromQualString(kind)) return true;
    }
    return false;
  };
  for (Node* node : linears) {
    Value* weight = node->input(1);
    if (weight->node() != graph->param_node() || weight->offset() < first_parameter) continue;
    const auto [name, w] = result.parameters[weight->offset() - first_parameter];  // copies: the list grows
    if (!absl::EndsWith(name, ".weight") || w.dim() != 2) continue;
    const std::string layer = name.substr(0, name.size() - std::string(".weight").size());
    if (!MatchTargets(layer, options, result.layers.target_hits)) continue;
    const std::string a_name = AdapterName(layer, "lora_A", options), b_name = AdapterName(layer, "lora_B", options);
    // Tensor parallelism (the automatic pass's shards): a column product keeps
    // A whole and its rows of B, the rank-r product entering the region as the
    // product's input does; a row product its columns of A and B whole, the
    // partial rank-r product reduced as the product's output is.
    auto spec = shards.find(name);
    const bool column = spec != shards.end() && spec->second.dim == 0;
    const bool row = spec != shards.end() && spec->second.dim == 1;
    Node* entry = node->input(0)->node();
    Node* reduction = node->output()->uses().size() == 1 ? node->output()->uses()[0].user : nullptr;
    if (column && !region_op(entry, {"trident::copy_to_tp_region", "trident::gather_from_sequence_region"})) {
      return absl::UnimplementedError(absl::StrCat("lora_config: the column-parallel product of '", layer,
                                                   "' does not read its input straight from the tensor-parallel "
                                                   "region's entry; leave it out of target_modules, or use tp=1"));
    }
    if (row && (reduction == nullptr || !region_op(reduction, {"trident::reduce_from_tp_region",
                                                               "trident::reduce_scatter_to_sequence_region"}))) {
      return absl::UnimplementedError(absl::StrCat("lora_config: the row-parallel product of '", layer,
                                                   "' is not reduced straight after it; leave it out of "
                                                   "target_modules, or use tp=1"));
    }
    const int64_t in_features = row ? w.size(1) * spec->second.parts : w.size(1);
    at::Tensor a = DrawA(a_name, options.r(), in_features, seed).to(w.options());
    if (row) {
      const ShardSpec columns{1, spec->second.parts, spec->second.index, 1};
      a = columns.Slice(a).contiguous();
      result.layers.shards[a_name] = columns;
    }
    at::Tensor b = at::zeros({w.size(0), options.r()}, w.options());  // rows of B where W's rows are split
    if (column) result.layers.shards[b_name] = spec->second;
    Value* a_input = graph->addInput(a_name)->setType(c10::TensorType::create(a));
    Value* b_input = graph->addInput(b_name)->setType(c10::TensorType::create(b));
    result.parameters.emplace_back(a_name, a);
    result.parameters.emplace_back(b_name, b);
    // y = W x (+ b) + scale * B A x, the adapter added where the product's output is whole.
    Node* after = row ? reduction : node;
    torch::jit::WithInsertPoint insert(after->next());
    Value* none = graph->insertConstant(c10::IValue());
    Value* low_rank = graph->insert(c10::aten::linear, {column ? entry->input(0) : node->input(0), a_input, none});
    if (column || row) low_rank = same_collective(column ? entry : reduction, low_rank);
    Value* adapter = graph->insert(c10::aten::linear, {low_rank, b_input, none});
    Value* output = after->output();
    Value* sum =
        graph->insert(c10::aten::add, {output, adapter}, {torch::jit::NamedValue("alpha", LoraScale(options))});
    sum->setType(output->type());
    output->replaceAllUsesAfterNodeWith(sum->node(), sum);
    result.layers.adapted.push_back(layer);
  }
  result.layers.trainable_parameters = Freeze(result.parameters, options, result.layers.adapted);
  std::vector<at::Tensor> tensors;
  for (const auto& [name, p] : result.parameters) tensors.push_back(p);
  result.forward = ModelGraph::GraphForward(graph, std::move(tensors));
  return result;
}

absl::StatusOr<LoraLayers> ApplyLora(torch::nn::Module& model, const LoraConfig& options, uint64_t seed) {
  TRIDENT_RETURN_IF_ERROR(ValidateLoraConfig(options));
  LoraLayers result;
  result.target_hits.assign(options.target_modules().size(), 0);
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> targets;
  for (const auto& item : model.named_modules()) {  // first all matches: adapters add modules
    if (!InsideAdapter(item.key()) && MatchTargets(item.key(), options, result.target_hits)) {
      targets.emplace_back(item.key(), item.value());
    }
  }
  for (const auto& [name, module] : targets) {
    const auto features = LinearFeatures(*module);
    if (!features) {
      return absl::InvalidArgumentError(absl::StrCat(
          "LoRA target '", name, "' is a ", module->name(),
          ", not a linear layer that takes adapters (ColumnParallelLinear, RowParallelLinear or ParallelLinear); "
          "name linear layers in target_modules, or build this one as trident::ParallelLinear"));
    }
    const at::Tensor full_a = DrawA(AdapterName(name, "lora_A", options), options.r(), features->second, seed);
    TRIDENT_ASSIGN_OR_RETURN(
        auto shards, AddLowRankAdapter(*module, options.adapter_name(), full_a, LoraScale(options), options.dropout()));
    for (const auto& [relative, spec] : shards) result.shards[Join(name, relative)] = spec;
    result.adapted.push_back(name);
  }
  NamedTensors parameters;
  for (const auto& item : model.named_parameters()) parameters.emplace_back(item.key(), item.value());
  result.trainable_parameters = Freeze(parameters, options, result.adapted);
  return result;
}

bool IsAdapterParameter(const std::string& name) { return InsideAdapter(ModuleOf(name)); }

NamedTensors PeftAdapter(const NamedTensors& full, const LoraConfig& options) {
  const std::set<std::string> adapted = AdaptedLayers(full, options.adapter_name());
  NamedTensors adapter;
  for (const auto& [name, tensor] : full) {
    if (Trains(name, options, adapted)) adapter.emplace_back(kPeftPrefix + name, tensor);
  }
  return adapter;
}

absl::StatusOr<NamedTensors> MergeAdapters(const NamedTensors& full, const LoraConfig& options) {
  std::map<std::string, at::Tensor> by_name(full.begin(), full.end());
  NamedTensors merged;
  for (const auto& [name, tensor] : full) {
    if (IsAdapterParameter(name)) continue;
    const std::string layer = ModuleOf(name);
    const std::string suffix = absl::StrCat(".", options.adapter_name(), ".weight");
    auto a = by_name.find(Join(layer, "lora_A") + suffix);
    auto b = by_name.find(Join(layer, "lora_B") + suffix);
    if (name != Join(layer, "weight") || a == by_name.end() || b == by_name.end()) {
      merged.emplace_back(name, tensor);
      continue;
    }
    if (tensor.dim() != 2 || tensor.size(0) != b->second.size(0) || tensor.size(1) != a->second.size(1)) {
      return absl::InvalidArgumentError(absl::StrCat("cannot merge the adapter of '", layer, "': its weight is ",
                                                     c10::str(tensor.sizes()), ", A ", c10::str(a->second.sizes()),
                                                     " and B ", c10::str(b->second.sizes())));
    }
    c10::NoGradGuard no_grad;
    merged.emplace_back(name, tensor + LoraScale(options) * at::mm(b->second, a->second).to(tensor.scalar_type()));
  }
  for (const std::string& layer : AdaptedLayers(full, options.adapter_name())) {
    if (!by_name.count(Join(layer, "weight"))) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot merge the adapter of '", layer, "': the tensors hold no ", Join(layer, "weight")));
    }
  }
  return merged;
}

}  // namespace trident
