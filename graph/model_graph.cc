#include "graph/model_graph.h"

#include <algorithm>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/jit/frontend/tracer.h>
#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/passes/dead_code_elimination.h>
#include <torch/csrc/jit/passes/inliner.h>
#include <torch/csrc/jit/runtime/interpreter.h>
#include <torch/csrc/jit/serialization/import.h>
#include <torch/nn/module.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/logging.h"
#include "base/status.h"
#include "graph/internal/deferred_records.h"

namespace trident {
namespace {

constexpr char kUseLayerSequence[] =
    "Declare the model as a LayerSequence (graph/graph.h) and use trace_method=layers to split "
    "it at layer boundaries instead (or trace_method=none to run it untraced with pp=1)";

// Tracer warnings mean the trace may not represent the model; make them errors.
struct TracerWarning : std::runtime_error {
  using std::runtime_error::runtime_error;
};
void ThrowOnTracerWarning(const std::string& message) { throw TracerWarning(message); }
void LogTracerWarning(const std::string& message) { LOG(WARNING) << "tracer: " << message; }

bool IsMatrixProduct(const std::string& kind) {
  return kind == "aten::linear" || kind == "aten::matmul" || kind == "aten::mm" || kind == "aten::bmm" ||
         kind == "aten::addmm" || kind == "aten::baddbmm";
}

std::vector<int64_t> ShapeOf(const torch::jit::Value* value) {
  auto type = value->type()->cast<c10::TensorType>();
  if (!type) return {};
  auto sizes = type->sizes().concrete_sizes();
  return sizes ? *sizes : std::vector<int64_t>{};
}

std::string KindOf(const torch::jit::Node* node) { return node->kind().toQualString(); }

int64_t RankOf(const torch::jit::Value* value) { return static_cast<int64_t>(ShapeOf(value).size()); }

std::optional<int64_t> IntOf(const torch::jit::Value* value) {
  auto constant = torch::jit::toIValue(value);
  if (constant && constant->isInt()) return constant->toInt();
  return std::nullopt;
}

bool IsParameter(const torch::jit::Graph& graph, size_t first_parameter, const torch::jit::Value* value) {
  for (size_t i = first_parameter; i < graph.inputs().size(); ++i) {
    if (graph.inputs()[i] == value) return true;
  }
  return false;
}

int64_t Elements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// A constant, or a list of constants: copied into every stage that uses it.
bool Cloneable(const torch::jit::Node* node) {
  if (node->kind() == c10::prim::Constant) return true;
  if (node->kind() != c10::prim::ListConstruct) return false;
  for (const torch::jit::Value* input : node->inputs()) {
    if (input->node()->kind() == c10::prim::Param || !Cloneable(input->node())) return false;
  }
  return true;
}

// Runs `code` op by op in the interpreter: autograd records every operator as
// eager execution would (no profiling, fusion or differentiable subgraphs), so
// gradients, hooks and ZeRO-3's parameter gathering behave as for eager layers.
void RunCode(const torch::jit::Code& code, torch::jit::Stack& stack) {
  torch::jit::InterpreterState state(code);
  state.run(stack);
}

}  // namespace

class ModelGraph::Impl {
 public:
  std::shared_ptr<torch::jit::Graph> graph;
  std::vector<at::Tensor> parameters;
  std::vector<std::string> parameter_names;
  size_t num_inputs = 0;
  std::vector<GraphNode> nodes;
  std::vector<torch::jit::Node*> ops;  // the graph's nodes behind `nodes`, in order
  std::map<const torch::jit::Node*, int64_t> op_index;
  std::vector<int64_t> output_ids;
  std::unique_ptr<torch::jit::Code> code;
  std::shared_ptr<void> keep_alive;  // a loaded TorchScript module that owns the parameters
  std::map<std::string, std::string> aliases;
  std::vector<std::string> alias_order;  // aliases' keys in the order Trace was given them

  // Index of the op that makes `value`; -1 for graph inputs and cloneable values.
  int64_t Producer(const torch::jit::Value* value) const {
    auto it = op_index.find(value->node());
    return it == op_index.end() ? -1 : it->second;
  }
  // Values made by ops before `position` and used at or after it (or returned).
  std::vector<torch::jit::Value*> Crossing(int64_t position) const {
    std::vector<torch::jit::Value*> crossing;
    for (int64_t i = 0; i < position; ++i) {
      for (torch::jit::Value* output : ops[i]->outputs()) {
        bool later = false;
        for (const torch::jit::Use& use : output->uses()) {
          auto it = op_index.find(use.user);
          later |= use.user->kind() == c10::prim::Return || (it != op_index.end() && it->second >= position);
        }
        if (later) crossing.push_back(output);
      }
    }
    return crossing;
  }
};

struct StageGraph::Impl {
  // Where each graph input comes from: a received tensor, a model input or a parameter.
  enum class Source { kReceived, kModelInput, kParameter };
  std::vector<std::pair<Source, size_t>> inputs;
  std::vector<at::Tensor> parameters;
  std::shared_ptr<torch::jit::Graph> graph;
  std::unique_ptr<torch::jit::Code> code;
};

StageGraph::StageGraph() : impl_(std::make_unique<Impl>()) {}
StageGraph::~StageGraph() = default;

namespace {

// `graph` returning its outputs as one value, as a graph function does
// (several outputs travel as a tuple).
std::shared_ptr<torch::jit::Graph> Runnable(std::shared_ptr<torch::jit::Graph> graph) {
  if (graph->outputs().size() != 1) {
    std::vector<torch::jit::Value*> outputs(graph->outputs().begin(), graph->outputs().end());
    while (!graph->outputs().empty()) graph->eraseOutput(0);
    graph->registerOutput(graph->insertNode(graph->createTuple(outputs))->output());
  }
  return graph;
}

std::vector<at::Tensor> Unpack(const torch::jit::Stack& stack) {
  std::vector<at::Tensor> outputs;
  for (const c10::IValue& value : stack) {
    if (value.isTensor()) {
      outputs.push_back(value.toTensor());
    } else if (value.isTuple()) {
      for (const c10::IValue& element : value.toTupleRef().elements()) {
        outputs.push_back(element.toTensor());
      }
    }
  }
  return outputs;
}

}  // namespace

ModelGraph::ModelGraph(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ModelGraph::~ModelGraph() = default;
const std::vector<GraphNode>& ModelGraph::nodes() const { return impl_->nodes; }
const std::vector<std::string>& ModelGraph::parameter_names() const { return impl_->parameter_names; }
const std::vector<at::Tensor>& ModelGraph::parameters() const { return impl_->parameters; }
const std::map<std::string, std::string>& ModelGraph::aliases() const { return impl_->aliases; }

absl::StatusOr<std::unique_ptr<ModelGraph>> ModelGraph::Trace(torch::nn::Module& module,
                                                              const std::vector<at::Tensor>& example_inputs,
                                                              const Forward& forward,
                                                              const std::vector<at::Tensor>& check_inputs) {
  std::vector<std::pair<std::string, at::Tensor>> parameters;
  for (const auto& item : module.named_parameters()) parameters.emplace_back(item.key(), item.value());
  return Trace(parameters, example_inputs, forward, check_inputs);
}

namespace {

bool ReadsTensorValue(const std::string& kind) {
  return kind == "aten::item" || kind == "aten::_local_scalar_dense" || kind == "aten::Int" || kind == "aten::Float" ||
         kind == "aten::Bool" || kind == "aten::is_nonzero";
}

// Whether `value` is computed from the values (not only the shapes) of tensors:
// the module's tensor inputs, parameters or buffers.
bool DependsOnTensorData(const torch::jit::Value* value, std::map<const torch::jit::Value*, bool>& memo) {
  auto found = memo.find(value);
  if (found != memo.end()) return found->second;
  memo[value] = false;  // cycles through loops: decided by the other paths
  const torch::jit::Node* node = value->node();
  const std::string kind = node->kind().toQualString();
  bool depends = false;
  if (node->kind() == c10::prim::Param || node->kind() == c10::prim::GetAttr) {
    depends = value->type()->cast<c10::TensorType>() != nullptr;
  } else if (kind != "aten::size" && kind != "aten::dim" && kind != "aten::numel" &&
             node->kind() != c10::prim::Constant) {
    for (const torch::jit::Value* input : node->inputs()) depends |= DependsOnTensorData(input, memo);
  }
  memo[value] = depends;
  return depends;
}

// The first node of `block` (or a block inside it) that turns tensor data
// into a Python value: control flow after it may depend on the data. Shape
// arithmetic (int(x.size(1) // heads) in traced code) is not such a read.
const torch::jit::Node* FindValueRead(const torch::jit::Block* block, std::map<const torch::jit::Value*, bool>& memo) {
  for (const torch::jit::Node* node : block->nodes()) {
    if (ReadsTensorValue(node->kind().toQualString()) && !node->inputs().empty() &&
        DependsOnTensorData(node->input(0), memo)) {
      return node;
    }
    for (const torch::jit::Block* inner : node->blocks()) {
      if (const torch::jit::Node* found = FindValueRead(inner, memo)) return found;
    }
  }
  return nullptr;
}

// A trace records the devices its tensors were made on as constants (Python's
// torch.arange(T, device=idx.device) traced on the CPU makes its positions on
// the CPU ever after): every CPU device constant of every method of `module`
// and its submodules becomes `device`.
void MoveDeviceConstants(torch::jit::Module& module, const at::Device& device) {
  std::set<const torch::jit::Graph*> done;
  std::function<void(torch::jit::Block*)> rewrite = [&](torch::jit::Block* block) {
    for (torch::jit::Node* node : block->nodes()) {
      for (torch::jit::Block* inner : node->blocks()) rewrite(inner);
      const bool device_constant =
          node->kind() == c10::prim::Constant && node->output()->type()->kind() == c10::TypeKind::DeviceObjType;
      if (!device_constant || !torch::jit::toIValue(node->output())->toDevice().is_cpu()) continue;
      torch::jit::WithInsertPoint here(node);
      node->output()->replaceAllUsesWith(node->owningGraph()->insertConstant(device));
    }
    torch::jit::EliminateDeadCode(block);
  };
  for (const torch::jit::Module& owner : module.modules()) {
    for (const torch::jit::Method& method : owner.get_methods()) {
      std::shared_ptr<torch::jit::Graph> graph = method.graph();
      if (done.insert(graph.get()).second) rewrite(graph->block());
    }
  }
}

}  // namespace

absl::StatusOr<TorchScriptModule> TorchScriptModule::Load(const std::string& path, bool defer_values) {
  auto module = std::make_shared<torch::jit::Module>();
  TorchScriptModule loaded;
  absl::Status not_deferred;  // why a deferred load failed
  if (defer_values) {
    absl::StatusOr<graph_internal::DeferredRecords::Loaded> lazy = graph_internal::DeferredRecords::Load(path);
    if (lazy.ok()) {
      *module = std::move(lazy->module);
      loaded.read_values = [records = std::move(lazy->records)](const std::vector<at::Tensor>& tensors) {
        records->Read(tensors);
      };
    } else {
      not_deferred = lazy.status();
    }
  }
  if (!loaded.read_values) {
    TRIDENT_RETURN_IF_ERROR(
        CatchExceptions(absl::StrCat("loading TorchScript module ", path), [&] { *module = torch::jit::load(path); }));
    if (!not_deferred.ok()) LOG(WARNING) << not_deferred.message() << "; loaded it whole instead";
  }
  // A scripted forward whose control flow reads tensor values traces one path
  // only (the interpreter runs its `if` without the tracer seeing it): refuse.
  std::string value_read;
  TRIDENT_RETURN_IF_ERROR(CatchExceptions(absl::StrCat("reading forward of ", path), [&] {
    std::shared_ptr<torch::jit::Graph> graph = module->get_method("forward").graph()->copy();
    torch::jit::Inline(*graph);
    std::map<const torch::jit::Value*, bool> memo;
    if (const torch::jit::Node* node = FindValueRead(graph->block(), memo)) {
      std::ostringstream where;
      node->sourceRange().highlight(where);
      value_read = absl::StrCat(node->kind().toQualString(), " in\n", where.str());
    }
  }));
  if (!value_read.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "forward of ", path, " reads a tensor's value (", value_read,
        "), so its control flow may depend on the data and a trace would record one branch only. ", kUseLayerSequence));
  }
  for (const auto& item : module->named_parameters(/*recurse=*/true)) {
    loaded.parameters.emplace_back(item.name, item.value);
  }
  for (const auto& item : module->named_modules()) {
    if (!item.name.empty()) loaded.module_types[item.name] = item.value.type()->name()->qualifiedName();
  }
  TRIDENT_RETURN_IF_ERROR(CatchExceptions(absl::StrCat("reading forward of ", path), [&] {
    const auto& arguments = module->get_method("forward").function().getSchema().arguments();
    for (size_t i = 1; i < arguments.size(); ++i) loaded.argument_names.push_back(arguments[i].name());
  }));
  loaded.forward = [module, path](const std::vector<at::Tensor>& in) {
    std::vector<c10::IValue> args(in.begin(), in.end());
    const c10::IValue result = module->forward(args);
    std::vector<at::Tensor> outputs;
    auto add = [&](const c10::IValue& value) {
      if (value.isNone()) return;
      if (!value.isTensor()) {
        throw std::invalid_argument(absl::StrCat("forward of ", path, " returned a ", value.tagKind(),
                                                 "; return tensors (a tuple or list of them)"));
      }
      outputs.push_back(value.toTensor());
    };
    if (result.isTuple()) {
      for (const c10::IValue& element : result.toTupleRef().elements()) add(element);
    } else if (result.isList()) {
      for (const c10::IValue& element : result.toListRef()) add(element);
    } else {
      add(result);
    }
    return outputs;
  };
  loaded.to = [module](const at::Device& device) {
    module->to(device);
    if (!device.is_cpu()) MoveDeviceConstants(*module, device);
  };
  loaded.module = module;
  return loaded;
}

absl::StatusOr<std::unique_ptr<ModelGraph>> ModelGraph::FromTorchScript(const std::string& path,
                                                                        const std::vector<at::Tensor>& example_inputs,
                                                                        const std::vector<at::Tensor>& check_inputs) {
  TRIDENT_ASSIGN_OR_RETURN(TorchScriptModule module, TorchScriptModule::Load(path));
  return Trace(module.parameters, example_inputs, module.forward, check_inputs, module.module);
}

absl::StatusOr<std::unique_ptr<ModelGraph>> ModelGraph::Trace(
    const std::vector<std::pair<std::string, at::Tensor>>& parameters, const std::vector<at::Tensor>& example_inputs,
    const Forward& forward, const std::vector<at::Tensor>& check_inputs, std::shared_ptr<void> keep_alive) {
  auto impl = std::make_unique<Impl>();
  impl->num_inputs = example_inputs.size();
  impl->keep_alive = std::move(keep_alive);
  torch::jit::Stack stack;
  for (const at::Tensor& t : example_inputs) stack.emplace_back(t);
  std::map<const void*, std::string> names;
  for (const auto& [name, tensor] : parameters) {
    auto [it, first] = names.emplace(tensor.unsafeGetTensorImpl(), name);
    if (!first) {  // tied: one graph input under the first name
      impl->aliases[name] = it->second;
      impl->alias_order.push_back(name);
      continue;
    }
    impl->parameters.push_back(tensor);
    impl->parameter_names.push_back(name);
    stack.emplace_back(tensor);
  }
  std::shared_ptr<torch::jit::tracer::TracingState> state;
  torch::jit::tracer::setWarn(ThrowOnTracerWarning);
  bool warned = false;  // a tracer warning, rather than a failing forward
  absl::Status traced = CatchExceptions("tracing the model", [&] {
    try {
      state = torch::jit::tracer::trace(
                  stack,
                  [&](torch::jit::Stack) {
                    torch::jit::Stack outputs;
                    for (const at::Tensor& t : forward(example_inputs)) outputs.emplace_back(t);
                    return outputs;
                  },
                  [&](const at::Tensor& t) {
                    auto it = names.find(t.unsafeGetTensorImpl());
                    return it == names.end() ? std::string() : it->second;
                  })
                  .first;
    } catch (const TracerWarning&) {
      warned = true;
      throw;
    }
  });
  torch::jit::tracer::setWarn(LogTracerWarning);
  if (!traced.ok()) {
    torch::jit::tracer::abandon();
    if (!warned) {
      return absl::InvalidArgumentError(
          absl::StrCat(traced.message(),
                       " (the forward failed on the example batch: do its shapes and values "
                       "fit the model?)"));
    }
    return absl::FailedPreconditionError(
        absl::StrCat(traced.message(),
                     ". The tracer records one execution; a forward that reads tensor values to decide what "
                     "to compute, or takes inputs it cannot record, cannot be traced. ",
                     kUseLayerSequence));
  }
  impl->graph = state->graph;
  int64_t position = 0;
  for (const torch::jit::Node* node : impl->graph->nodes()) {
    const std::string kind = node->kind().toQualString();
    ++position;
    if (ReadsTensorValue(kind)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "tracing the model: its forward reads a tensor's value (node ", position, ", ", kind,
          node->sourceRange().source() ? absl::StrCat(" at ", node->sourceRange().str()) : "",
          "), so control flow may depend on data and the trace would record one branch only. ", kUseLayerSequence));
    }
  }
  torch::jit::EliminateDeadCode(impl->graph);

  std::map<const torch::jit::Value*, size_t> parameter_index;
  for (size_t i = 0; i < impl->parameters.size(); ++i) {
    parameter_index[impl->graph->inputs()[impl->num_inputs + i]] = i;
  }
  for (torch::jit::Node* node : impl->graph->nodes()) {
    const std::string kind = node->kind().toQualString();
    if (Cloneable(node)) continue;
    impl->op_index[node] = static_cast<int64_t>(impl->ops.size());
    impl->ops.push_back(node);
    GraphNode g;
    g.kind = kind;
    for (const torch::jit::Value* input : node->inputs()) {
      auto it = parameter_index.find(input);
      if (it == parameter_index.end()) continue;
      const at::Tensor& p = impl->parameters[it->second];
      g.parameters.push_back(impl->parameter_names[it->second]);
      g.parameter_bytes += p.numel() * p.element_size();
    }
    int64_t output_elements = 0;
    for (const torch::jit::Value* output : node->outputs()) {
      auto type = output->type()->cast<c10::TensorType>();
      if (!type) continue;
      std::vector<int64_t> shape = ShapeOf(output);
      g.output_shapes.push_back(shape);
      auto dtype = type->scalarType();
      g.output_dtypes.push_back(dtype ? c10::toString(*dtype) : "?");
      output_elements += Elements(shape);
      g.activation_bytes += Elements(shape) * (dtype ? c10::elementSize(*dtype) : 4);
    }
    if (IsMatrixProduct(kind) && !node->inputs().empty()) {
      // The contracted dimension: the last of the first matrix operand.
      const size_t operand = (kind == "aten::addmm" || kind == "aten::baddbmm") ? 1 : 0;
      const std::vector<int64_t> shape = ShapeOf(node->inputs()[operand]);
      g.forward_flops = 2.0 * output_elements * (shape.empty() ? 1 : shape.back());
    } else if (kind == "trident::causal_attention") {
      // Two products, q k^T and P v, counted whole as an unfused graph's are.
      const std::vector<int64_t> keys = ShapeOf(node->inputs()[1]);
      g.forward_flops = 4.0 * output_elements * (keys.size() == 4 ? keys[2] : 1);
    } else {
      g.forward_flops = static_cast<double>(output_elements);
    }
    impl->nodes.push_back(std::move(g));
  }
  for (const torch::jit::Value* output : impl->graph->outputs()) {
    impl->output_ids.push_back(static_cast<int64_t>(output->unique()));
  }
  impl->code = std::make_unique<torch::jit::Code>(Runnable(impl->graph->copy()), "forward");
  std::unique_ptr<ModelGraph> model_graph(new ModelGraph(std::move(impl)));
  if (!check_inputs.empty()) {
    c10::NoGradGuard no_grad;
    TRIDENT_ASSIGN_OR_RETURN(std::vector<at::Tensor> traced_outputs, model_graph->Run(check_inputs));
    std::vector<at::Tensor> eager_outputs;
    TRIDENT_RETURN_IF_ERROR(
        CatchExceptions("running the model on check_inputs", [&] { eager_outputs = forward(check_inputs); }));
    for (size_t i = 0; i < eager_outputs.size(); ++i) {
      if (i >= traced_outputs.size() || !traced_outputs[i].sizes().equals(eager_outputs[i].sizes()) ||
          !at::allclose(traced_outputs[i], eager_outputs[i], 1e-4, 1e-5)) {
        return absl::FailedPreconditionError(
            absl::StrCat("tracing the model: the traced graph disagrees with the model on check_inputs (output ", i,
                         "), so its control flow depends on tensor values and a trace records one branch "
                         "only. ",
                         kUseLayerSequence));
      }
    }
  }
  return model_graph;
}

absl::StatusOr<std::vector<at::Tensor>> ModelGraph::Run(const std::vector<at::Tensor>& inputs) {
  if (inputs.size() != impl_->num_inputs) {
    return absl::InvalidArgumentError(
        absl::StrCat("the traced graph takes ", impl_->num_inputs, " inputs, got ", inputs.size()));
  }
  torch::jit::Stack stack;
  for (const at::Tensor& t : inputs) stack.emplace_back(t);
  for (const at::Tensor& p : impl_->parameters) stack.emplace_back(p);
  TRIDENT_RETURN_IF_ERROR(CatchExceptions("running the traced graph", [&] { RunCode(*impl_->code, stack); }));
  return Unpack(stack);
}

const std::vector<int64_t>& ModelGraph::output_ids() const { return impl_->output_ids; }

std::optional<int> ModelGraph::CrossingTensors(int64_t position) const {
  int count = 0;
  for (const torch::jit::Value* value : impl_->Crossing(position)) {
    if (!value->type()->cast<c10::TensorType>()) return std::nullopt;
    // A tensor modified in place after the cut (linear's bias add_ on its matmul)
    // would be a received leaf changed in place: no cut there either.
    for (const torch::jit::Use& use : value->uses()) {
      const std::string name = use.user->kind().toUnqualString();
      if (use.offset == 0 && !name.empty() && name.back() == '_') return std::nullopt;
    }
    ++count;
  }
  return count;
}

std::vector<int64_t> ModelGraph::CrossingValueIds(int64_t position) const {
  std::vector<int64_t> ids;
  for (const torch::jit::Value* value : impl_->Crossing(position)) {
    if (value->type()->cast<c10::TensorType>()) ids.push_back(static_cast<int64_t>(value->unique()));
  }
  return ids;
}

absl::StatusOr<std::vector<std::unique_ptr<StageGraph>>> ModelGraph::Split(
    const std::vector<int64_t>& boundaries) const {
  const Impl& g = *impl_;
  const int64_t count = static_cast<int64_t>(g.ops.size());
  bool valid = boundaries.size() >= 2 && boundaries.front() == 0 && boundaries.back() == count;
  for (size_t i = 1; valid && i < boundaries.size(); ++i) valid = boundaries[i] > boundaries[i - 1];
  if (!valid) {
    return absl::InvalidArgumentError(absl::StrCat("stage boundaries [", absl::StrJoin(boundaries, ", "),
                                                   "] must rise from 0 to the ", count, " nodes"));
  }
  for (size_t i = 1; i + 1 < boundaries.size(); ++i) {
    if (!CrossingTensors(boundaries[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot cut before node ", boundaries[i], " (", g.nodes[boundaries[i]].kind,
                       "): a value that is not a tensor would cross; choose another boundary"));
    }
  }
  std::vector<std::unique_ptr<StageGraph>> stages;
  for (size_t s = 0; s + 1 < boundaries.size(); ++s) {
    const int64_t first = boundaries[s], end = boundaries[s + 1];
    std::unique_ptr<StageGraph> stage(new StageGraph());
    StageGraph::Impl& st = *stage->impl_;
    st.graph = std::make_shared<torch::jit::Graph>();
    std::map<const torch::jit::Value*, torch::jit::Value*> mapped;
    std::function<torch::jit::Value*(torch::jit::Value*)> map_value =
        [&](torch::jit::Value* value) -> torch::jit::Value* {
      auto it = mapped.find(value);
      if (it != mapped.end()) return it->second;
      torch::jit::Value* result;
      if (value->node()->kind() == c10::prim::Param) {
        const size_t index = value->offset();
        result = st.graph->addInput()->copyMetadata(value);
        if (index < g.num_inputs) {
          st.inputs.emplace_back(StageGraph::Impl::Source::kModelInput, index);
          stage->model_inputs_.push_back(static_cast<int>(index));
        } else {
          st.inputs.emplace_back(StageGraph::Impl::Source::kParameter, st.parameters.size());
          st.parameters.push_back(g.parameters[index - g.num_inputs]);
          stage->parameter_names_.push_back(g.parameter_names[index - g.num_inputs]);
        }
      } else if (g.Producer(value) < 0) {  // a constant: copy it here
        torch::jit::Node* clone = st.graph->appendNode(st.graph->createClone(value->node(), map_value));
        result = clone->output(value->offset());
      } else {  // made by an earlier stage
        result = st.graph->addInput()->copyMetadata(value);
        st.inputs.emplace_back(StageGraph::Impl::Source::kReceived, stage->received_.size());
        stage->received_.push_back(static_cast<int64_t>(value->unique()));
      }
      mapped[value] = result;
      return result;
    };
    for (int64_t i = first; i < end; ++i) {
      torch::jit::Node* clone = st.graph->appendNode(st.graph->createClone(g.ops[i], map_value));
      for (size_t o = 0; o < g.ops[i]->outputs().size(); ++o) {
        mapped[g.ops[i]->output(o)] = clone->output(o);
      }
    }
    std::vector<torch::jit::Value*> outputs;
    for (torch::jit::Value* value : g.Crossing(end)) {
      if (g.Producer(value) < first) continue;
      outputs.push_back(mapped.at(value));
      stage->sent_.push_back(static_cast<int64_t>(value->unique()));
    }
    // A graph function returns one value: several outputs travel as a tuple.
    st.graph->registerOutput(outputs.size() == 1 ? outputs[0]
                                                 : st.graph->insertNode(st.graph->createTuple(outputs))->output());
    st.code = std::make_unique<torch::jit::Code>(st.graph, absl::StrCat("stage", s));
    stages.push_back(std::move(stage));
  }
  return stages;
}

std::vector<TensorFlow> ModelGraph::Flows(const std::vector<int64_t>& boundaries) const {
  const Impl& g = *impl_;
  auto stage_of = [&](int64_t op) {
    return static_cast<int>(std::upper_bound(boundaries.begin(), boundaries.end(), op) - boundaries.begin()) - 1;
  };
  std::vector<TensorFlow> flows;
  for (int64_t i = 0; i < static_cast<int64_t>(g.ops.size()); ++i) {
    const int from = stage_of(i);
    for (const torch::jit::Value* output : g.ops[i]->outputs()) {
      auto type = output->type()->cast<c10::TensorType>();
      if (!type) continue;
      std::set<int> readers;
      for (const torch::jit::Use& use : output->uses()) {
        auto it = g.op_index.find(use.user);
        if (it != g.op_index.end() && stage_of(it->second) != from) readers.insert(stage_of(it->second));
      }
      if (readers.empty()) continue;
      TensorFlow flow;
      flow.value_id = static_cast<int64_t>(output->unique());
      flow.from_stage = from;
      flow.to_stages.assign(readers.begin(), readers.end());
      flow.shape = ShapeOf(output);
      flow.dtype = type->scalarType() ? c10::toString(*type->scalarType()) : "?";
      flow.bytes =
          Elements(flow.shape) * (type->scalarType() ? static_cast<int64_t>(c10::elementSize(*type->scalarType())) : 4);
      flows.push_back(std::move(flow));
    }
  }
  return flows;
}

absl::StatusOr<std::vector<at::Tensor>> StageGraph::Run(const std::vector<at::Tensor>& received,
                                                        const std::vector<at::Tensor>& model_inputs) const {
  if (received.size() != received_.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("stage takes ", received_.size(), " received tensors, got ", received.size()));
  }
  torch::jit::Stack stack;
  for (const auto& [source, index] : impl_->inputs) {
    switch (source) {
      case Impl::Source::kReceived:
        stack.emplace_back(received[index]);
        break;
      case Impl::Source::kModelInput:
        if (index >= model_inputs.size()) {
          return absl::InvalidArgumentError(
              absl::StrCat("stage reads model input ", index, " but ", model_inputs.size(), " were given"));
        }
        stack.emplace_back(model_inputs[index]);
        break;
      case Impl::Source::kParameter:
        stack.emplace_back(impl_->parameters[index]);
        break;
    }
  }
  TRIDENT_RETURN_IF_ERROR(CatchExceptions("running a pipeline stage", [&] { RunCode(*impl_->code, stack); }));
  return Unpack(stack);
}

double ModelGraph::total_flops() const {
  double total = 0;
  for (const GraphNode& n : impl_->nodes) total += n.forward_flops;
  return total;
}

int64_t ModelGraph::total_parameter_bytes() const {
  int64_t total = 0;
  for (const at::Tensor& p : impl_->parameters) total += p.numel() * p.element_size();
  return total;
}

std::string ModelGraph::Summary() const {
  std::string out = absl::StrFormat("%5s  %-28s %-22s %12s %12s %12s  %s\n", "node", "kind", "output", "flops",
                                    "param_bytes", "act_bytes", "parameters");
  int64_t activation = 0;
  for (size_t i = 0; i < impl_->nodes.size(); ++i) {
    const GraphNode& n = impl_->nodes[i];
    const std::string shape =
        n.output_shapes.empty() ? "-" : absl::StrCat("[", absl::StrJoin(n.output_shapes[0], ","), "]");
    absl::StrAppend(&out, absl::StrFormat("%5d  %-28s %-22s %12.4g %12d %12d  %s\n", i, n.kind, shape, n.forward_flops,
                                          n.parameter_bytes, n.activation_bytes, absl::StrJoin(n.parameters, ",")));
    activation += n.activation_bytes;
  }
  absl::StrAppend(&out, absl::StrFormat("total: %d nodes, %.4g forward FLOPs, %d parameters (%d bytes), %d "
                                        "activation bytes\n",
                                        impl_->nodes.size(), total_flops(), impl_->parameters.size(),
                                        total_parameter_bytes(), activation));
  return out;
}

std::string ModelGraph::IrText() const { return impl_->graph->toString(); }
std::shared_ptr<torch::jit::Graph> ModelGraph::jit_graph() const { return impl_->graph; }

ModelGraph::Forward ModelGraph::GraphForward(std::shared_ptr<torch::jit::Graph> graph,
                                             std::vector<at::Tensor> parameters) {
  auto code = std::make_shared<torch::jit::Code>(Runnable(std::move(graph)), "rewritten_forward");
  return [code, parameters = std::move(parameters)](const std::vector<at::Tensor>& inputs) {
    torch::jit::Stack stack(inputs.begin(), inputs.end());
    stack.insert(stack.end(), parameters.begin(), parameters.end());
    RunCode(*code, stack);
    return Unpack(stack);
  };
}

absl::StatusOr<ModelGraph::Untied> ModelGraph::Untie() const {
  Untied result;
  std::shared_ptr<torch::jit::Graph> graph = impl_->graph->copy();
  const std::vector<at::Tensor>& tensors = impl_->parameters;
  for (size_t i = 0; i < tensors.size(); ++i) result.parameters.emplace_back(impl_->parameter_names[i], tensors[i]);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::string& owner = impl_->parameter_names[i];
    std::vector<std::string> names = {owner};
    for (const std::string& alias : impl_->alias_order) {
      if (impl_->aliases.at(alias) == owner) names.push_back(alias);
    }
    if (names.size() == 1) continue;
    torch::jit::Value* tied = graph->inputs()[impl_->num_inputs + i];
    std::vector<torch::jit::Node*> readers;
    for (const torch::jit::Use& use : tied->uses()) {
      if (std::find(readers.begin(), readers.end(), use.user) == readers.end()) readers.push_back(use.user);
    }
    std::sort(readers.begin(), readers.end(), [](torch::jit::Node* a, torch::jit::Node* b) { return a->isBefore(b); });
    if (readers.size() != names.size()) {
      std::vector<std::string> kinds;
      for (const torch::jit::Node* reader : readers) kinds.push_back(reader->kind().toQualString());
      return absl::FailedPreconditionError(absl::StrCat(
          "no_tie_modules: the tied parameter ", absl::StrJoin(names, " = "), " has ", names.size(), " names but ",
          readers.size(), " operator(s) read it in the traced graph (", absl::StrJoin(kinds, ", "),
          "), so which name each reads is unknown; untie it in the model itself"));
    }
    for (size_t k = 1; k < names.size(); ++k) {
      torch::jit::Value* own = graph->addInput();
      own->setType(tied->type());
      readers[k]->replaceInputWith(tied, own);
      result.parameters.emplace_back(names[k],
                                     tensors[i].detach().clone().set_requires_grad(tensors[i].requires_grad()));
      result.untied.push_back(absl::StrCat(names[k], " (was ", owner, ")"));
    }
  }
  std::vector<at::Tensor> inputs;
  for (const auto& [name, tensor] : result.parameters) inputs.push_back(tensor);
  result.forward = GraphForward(std::move(graph), std::move(inputs));
  return result;
}

void ModelGraph::CanonicalizeLinearProducts(torch::jit::Graph& graph, size_t first_parameter) {
  std::vector<torch::jit::Node*> nodes(graph.nodes().begin(), graph.nodes().end());
  std::set<torch::jit::Node*> destroyed;
  for (torch::jit::Node* node : nodes) {
    if (destroyed.count(node)) continue;
    const std::string kind = KindOf(node);
    const bool addmm = kind == "aten::addmm";
    if (kind != "aten::matmul" && !addmm) continue;
    torch::jit::Value* transposed = node->input(addmm ? 2 : 1);
    if (KindOf(transposed->node()) != "aten::t" || transposed->uses().size() != 1) continue;
    torch::jit::Value* weight = transposed->node()->input(0);
    if (!IsParameter(graph, first_parameter, weight) || RankOf(weight) != 2) continue;
    torch::jit::Value* x = node->input(addmm ? 1 : 0);
    torch::jit::Value* bias = nullptr;
    torch::jit::Value* result = node->output();
    torch::jit::Node* add = nullptr;
    if (addmm) {
      if (IntOf(node->input(3)).value_or(0) != 1 || IntOf(node->input(4)).value_or(0) != 1) continue;
      bias = node->input(0);
    } else if (result->uses().size() == 1) {
      torch::jit::Node* user = result->uses()[0].user;
      const std::string user_kind = KindOf(user);
      if ((user_kind == "aten::add" || user_kind == "aten::add_") && user->input(0) == result &&
          IsParameter(graph, first_parameter, user->input(1)) && RankOf(user->input(1)) == 1 &&
          IntOf(user->input(2)).value_or(0) == 1) {
        add = user;
        bias = add->input(1);
        result = add->output();
      }
    }
    torch::jit::WithInsertPoint here(node);
    torch::jit::Value* linear =
        graph.insert(c10::aten::linear, {x, weight, bias != nullptr ? bias : graph.insertConstant(c10::IValue())});
    linear->setType(result->type());
    result->replaceAllUsesWith(linear);
    // The replaced operators go (an in-place add_ is not dead code to the JIT).
    if (add != nullptr) {
      destroyed.insert(add);
      add->destroy();
    }
    node->destroy();
    transposed->node()->destroy();
  }
  torch::jit::EliminateDeadCode(graph.block());
}

}  // namespace trident
