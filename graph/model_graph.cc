#include "graph/model_graph.h"

#include <map>
#include <sstream>
#include <stdexcept>

#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/frontend/tracer.h>
#include <torch/csrc/jit/passes/dead_code_elimination.h>
#include <torch/nn/module.h>
#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/logging.h"
#include "base/status.h"

namespace trident {
namespace {

// Tracer warnings mean the trace may not represent the model; make them errors.
void ThrowOnTracerWarning(const std::string& message) { throw std::runtime_error(message); }
void LogTracerWarning(const std::string& message) { LOG(WARNING) << "tracer: " << message; }

bool IsMatrixProduct(const std::string& kind) {
  return kind == "aten::linear" || kind == "aten::matmul" || kind == "aten::mm" ||
         kind == "aten::bmm" || kind == "aten::addmm" || kind == "aten::baddbmm";
}

std::vector<int64_t> ShapeOf(const torch::jit::Value* value) {
  auto type = value->type()->cast<c10::TensorType>();
  if (!type) return {};
  auto sizes = type->sizes().concrete_sizes();
  return sizes ? *sizes : std::vector<int64_t>{};
}

int64_t Elements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

}  // namespace

class ModelGraph::Impl {
 public:
  std::shared_ptr<torch::jit::Graph> graph;
  std::vector<at::Tensor> parameters;
  std::vector<std::string> parameter_names;
  size_t num_inputs = 0;
  std::vector<GraphNode> nodes;
  std::unique_ptr<torch::jit::GraphFunction> function;
};

ModelGraph::ModelGraph(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ModelGraph::~ModelGraph() = default;
const std::vector<GraphNode>& ModelGraph::nodes() const { return impl_->nodes; }
const std::vector<std::string>& ModelGraph::parameter_names() const { return impl_->parameter_names; }

constexpr char kUseLayerSequence[] =
    "Declare the model as a LayerSequence (graph/graph.h) to split it at layer boundaries "
    "instead";

absl::StatusOr<std::unique_ptr<ModelGraph>> ModelGraph::Trace(
    torch::nn::Module& module, const std::vector<at::Tensor>& example_inputs,
    const Forward& forward, const std::vector<at::Tensor>& check_inputs) {
  auto impl = std::make_unique<Impl>();
  impl->num_inputs = example_inputs.size();
  torch::jit::Stack stack;
  for (const at::Tensor& t : example_inputs) stack.emplace_back(t);
  std::map<const void*, std::string> names;
  for (const auto& item : module.named_parameters()) {
    impl->parameters.push_back(item.value());
    impl->parameter_names.push_back(item.key());
    names[item.value().unsafeGetTensorImpl()] = item.key();
    stack.emplace_back(item.value());
  }
  std::shared_ptr<torch::jit::tracer::TracingState> state;
  torch::jit::tracer::setWarn(ThrowOnTracerWarning);
  absl::Status traced = CatchExceptions("tracing the model", [&] {
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
  });
  torch::jit::tracer::setWarn(LogTracerWarning);
  if (!traced.ok()) {
    torch::jit::tracer::abandon();
    return absl::FailedPreconditionError(absl::StrCat(
        traced.message(),
        ". The tracer records one execution; a forward that reads tensor values to decide what "
        "to compute, or takes inputs it cannot record, cannot be traced. ", kUseLayerSequence));
  }
  impl->graph = state->graph;
  for (const torch::jit::Node* node : impl->graph->nodes()) {
    const std::string kind = node->kind().toQualString();
    if (kind == "aten::item" || kind == "aten::_local_scalar_dense" || kind == "aten::Int" ||
        kind == "aten::Float" || kind == "aten::Bool" || kind == "aten::is_nonzero") {
      return absl::FailedPreconditionError(absl::StrCat(
          "tracing the model: its forward reads a tensor's value (", kind,
          "), so control flow may depend on data and the trace would record one branch only. ",
          kUseLayerSequence));
    }
  }
  torch::jit::EliminateDeadCode(impl->graph);

  std::map<const torch::jit::Value*, size_t> parameter_index;
  for (size_t i = 0; i < impl->parameters.size(); ++i) {
    parameter_index[impl->graph->inputs()[impl->num_inputs + i]] = i;
  }
  for (const torch::jit::Node* node : impl->graph->nodes()) {
    const std::string kind = node->kind().toQualString();
    if (node->kind().is_prim() || node->outputs().empty()) continue;
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
    } else {
      g.forward_flops = static_cast<double>(output_elements);
    }
    impl->nodes.push_back(std::move(g));
  }
  impl->function = std::make_unique<torch::jit::GraphFunction>("forward", impl->graph, nullptr);
  std::unique_ptr<ModelGraph> model_graph(new ModelGraph(std::move(impl)));
  if (!check_inputs.empty()) {
    at::NoGradGuard no_grad;
    TRIDENT_ASSIGN_OR_RETURN(std::vector<at::Tensor> traced_outputs, model_graph->Run(check_inputs));
    std::vector<at::Tensor> eager_outputs;
    TRIDENT_RETURN_IF_ERROR(CatchExceptions("running the model on check_inputs",
                                            [&] { eager_outputs = forward(check_inputs); }));
    for (size_t i = 0; i < eager_outputs.size(); ++i) {
      if (i >= traced_outputs.size() || !traced_outputs[i].sizes().equals(eager_outputs[i].sizes()) ||
          !at::allclose(traced_outputs[i], eager_outputs[i], 1e-4, 1e-5)) {
        return absl::FailedPreconditionError(absl::StrCat(
            "tracing the model: the traced graph disagrees with the model on check_inputs (output ",
            i, "), so its control flow depends on tensor values and a trace records one branch "
            "only. ", kUseLayerSequence));
      }
    }
  }
  return model_graph;
}

absl::StatusOr<std::vector<at::Tensor>> ModelGraph::Run(const std::vector<at::Tensor>& inputs) {
  if (inputs.size() != impl_->num_inputs) {
    return absl::InvalidArgumentError(absl::StrCat("the traced graph takes ", impl_->num_inputs,
                                                   " inputs, got ", inputs.size()));
  }
  torch::jit::Stack stack;
  for (const at::Tensor& t : inputs) stack.emplace_back(t);
  for (const at::Tensor& p : impl_->parameters) stack.emplace_back(p);
  TRIDENT_RETURN_IF_ERROR(
      CatchExceptions("running the traced graph", [&] { impl_->function->run(stack); }));
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
  std::string out = absl::StrFormat("%5s  %-28s %-22s %12s %12s %12s  %s\n", "node", "kind",
                                    "output", "flops", "param_bytes", "act_bytes", "parameters");
  int64_t activation = 0;
  for (size_t i = 0; i < impl_->nodes.size(); ++i) {
    const GraphNode& n = impl_->nodes[i];
    const std::string shape =
        n.output_shapes.empty() ? "-" : absl::StrCat("[", absl::StrJoin(n.output_shapes[0], ","), "]");
    absl::StrAppend(&out, absl::StrFormat("%5d  %-28s %-22s %12.4g %12d %12d  %s\n", i, n.kind,
                                          shape, n.forward_flops, n.parameter_bytes,
                                          n.activation_bytes, absl::StrJoin(n.parameters, ",")));
    activation += n.activation_bytes;
  }
  absl::StrAppend(&out, absl::StrFormat(
                            "total: %d nodes, %.4g forward FLOPs, %d parameters (%d bytes), %d "
                            "activation bytes\n",
                            impl_->nodes.size(), total_flops(), impl_->parameters.size(),
                            total_parameter_bytes(), activation));
  return out;
}

std::string ModelGraph::IrText() const { return impl_->graph->toString(); }

}  // namespace trident
