// ModelGraph: a model traced into an operator graph with LibTorch's JIT tracer,
// with what partitioning needs per operator. The model's parameters are inputs
// of the graph (by name), so the graph runs with the live parameters and
// autograd reaches them.
//
//   auto graph = ModelGraph::Trace(*model, {tokens, targets},
//       [&](const std::vector<at::Tensor>& in) {
//         return std::vector<at::Tensor>{model->Loss(in[0], in[1])};
//       });
//   std::cout << (*graph)->Summary();            // node table and totals
//   at::Tensor loss = (*graph)->Run({tokens, targets}).value()[0];
//   loss.backward();                             // gradients in the model's parameters
#ifndef TRIDENT_GRAPH_MODEL_GRAPH_H_
#define TRIDENT_GRAPH_MODEL_GRAPH_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"

namespace torch {
namespace jit {
struct Graph;
}  // namespace jit
namespace nn {
class Module;
}  // namespace nn
}  // namespace torch

namespace trident {

// One operator of a traced graph (constants, and lists of constants, are left
// out: a stage that needs them gets its own copy).
struct GraphNode {
  std::string kind;                     // "aten::linear"
  std::vector<std::string> parameters;  // names of the parameters it reads directly
  std::vector<std::vector<int64_t>> output_shapes;
  std::vector<std::string> output_dtypes;
  double forward_flops = 0;      // 2 * multiply-adds for matrix products, else one per output element
  int64_t parameter_bytes = 0;   // bytes of the parameters it reads
  int64_t activation_bytes = 0;  // bytes of its outputs
};

// One pipeline stage of a split ModelGraph: a sub-graph of consecutive
// operators with explicit inputs and outputs. Tensors are identified across
// stages by value ids (unique within the traced graph).
class StageGraph {
 public:
  ~StageGraph();
  // Tensors received from earlier stages, in the order Run takes them.
  const std::vector<int64_t>& received() const { return received_; }
  // Tensors produced for later stages or as model outputs, in the order Run returns them.
  const std::vector<int64_t>& sent() const { return sent_; }
  // The parameters this stage reads.
  const std::vector<std::string>& parameter_names() const { return parameter_names_; }
  // The model inputs (indices into Run's `model_inputs`) this stage reads.
  const std::vector<int>& model_inputs() const { return model_inputs_; }
  // Runs the stage on `received` (in received() order) and the model's inputs
  // (all of them, as ModelGraph::Run takes them; the stage reads what it needs).
  absl::StatusOr<std::vector<at::Tensor>> Run(const std::vector<at::Tensor>& received,
                                              const std::vector<at::Tensor>& model_inputs) const;

 private:
  friend class ModelGraph;
  struct Impl;
  StageGraph();
  std::unique_ptr<Impl> impl_;
  std::vector<int64_t> received_, sent_;
  std::vector<std::string> parameter_names_;
  std::vector<int> model_inputs_;
};

// A tensor that one stage of a split graph sends to later ones.
struct TensorFlow {
  int64_t value_id = 0;  // as in StageGraph::sent() / received()
  int from_stage = 0;
  std::vector<int> to_stages;  // every later stage that reads it
  std::vector<int64_t> shape;  // for the traced example input
  std::string dtype;
  int64_t bytes = 0;
};

// A TorchScript module saved from Python (torch.jit.save of a torch.jit.trace
// or torch.jit.script result), loaded for tracing.
struct TorchScriptModule {
  // Loads `path`; errors name the file. With `defer_values` the parameters'
  // saved values are not read (the tensors read as zeros and hold no resident
  // memory) until read_values asks for them: a model of any size traces in
  // the memory of its activations, and each rank reads only what it keeps.
  // Buffers are read at once. A file the deferred reader cannot take (a
  // compressed archive) is loaded whole, with a warning.
  static absl::StatusOr<TorchScriptModule> Load(const std::string& path, bool defer_values = false);
  // Every parameter under every name (tied names share one tensor).
  std::vector<std::pair<std::string, at::Tensor>> parameters;
  // The names of forward's arguments, without self.
  std::vector<std::string> argument_names;
  // Every submodule's class by its name ("transformer.h.0" -> "__torch__.Block").
  std::map<std::string, std::string> module_types;
  // Calls forward: a tensor, or a tuple or list of tensors (None elements are
  // dropped), become the outputs. Throws when forward returns anything else.
  std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)> forward;
  // Moves parameters and buffers to `device`.
  std::function<void(const at::Device&)> to;
  // Loaded with defer_values: reads the saved values of the parameters among
  // `tensors` (any tensor sharing one's storage) not read yet; anything else is
  // left alone. Throws on an I/O error. Empty when loaded whole.
  std::function<void(const std::vector<at::Tensor>&)> read_values;
  std::shared_ptr<void> module;  // keeps the loaded module alive
};

class ModelGraph {
 public:
  using Forward = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

  // Traces `forward` of `module` on `example_inputs`. A trace records one
  // execution: when `check_inputs` (other inputs of the same shapes) are given,
  // the graph and the eager forward must agree on them too. Fails, naming what
  // happened and suggesting the LayerSequence path, when the forward cannot be
  // traced or its control flow depends on tensor values (the check disagrees).
  static absl::StatusOr<std::unique_ptr<ModelGraph>> Trace(torch::nn::Module& module,
                                                           const std::vector<at::Tensor>& example_inputs,
                                                           const Forward& forward,
                                                           const std::vector<at::Tensor>& check_inputs = {});
  // The same for a forward that reads `parameters` (name, tensor) directly. A
  // tensor listed under several names (tied weights) becomes one graph input
  // under its first name; aliases() maps the others to it. `keep_alive` is
  // held as long as the graph (the owner of the parameters).
  static absl::StatusOr<std::unique_ptr<ModelGraph>> Trace(
      const std::vector<std::pair<std::string, at::Tensor>>& parameters, const std::vector<at::Tensor>& example_inputs,
      const Forward& forward, const std::vector<at::Tensor>& check_inputs = {},
      std::shared_ptr<void> keep_alive = nullptr);
  // Loads a TorchScript module saved from Python (torch.jit.save) and traces its
  // forward on `example_inputs` into a graph of its operators, with the module's
  // parameters as named inputs. The loaded module stays alive inside the graph.
  static absl::StatusOr<std::unique_ptr<ModelGraph>> FromTorchScript(const std::string& path,
                                                                     const std::vector<at::Tensor>& example_inputs,
                                                                     const std::vector<at::Tensor>& check_inputs = {});
  ~ModelGraph();

  const std::vector<GraphNode>& nodes() const;
  // Parameter names in the order they follow the inputs in the graph, and the
  // parameter tensors themselves (the module's own, so gradients land there).
  const std::vector<std::string>& parameter_names() const;
  const std::vector<at::Tensor>& parameters() const;
  // Second names of tied parameters: alias -> the name in parameter_names().
  const std::map<std::string, std::string>& aliases() const;
  // Runs the graph on `inputs` (shaped like the example) with the module's
  // current parameters.
  absl::StatusOr<std::vector<at::Tensor>> Run(const std::vector<at::Tensor>& inputs);

  // Value ids of the model's outputs (what the forward returned).
  const std::vector<int64_t>& output_ids() const;
  // Value ids of the tensors that cross a cut before node `position` (see
  // CrossingTensors), in the order the graph makes them.
  std::vector<int64_t> CrossingValueIds(int64_t position) const;
  // Tensors that would cross a cut before node `position` (0 < position <
  // nodes().size()): values made by earlier nodes and used by later ones or
  // returned. nullopt where a non-tensor value, or a tensor later modified in
  // place, would cross: no cut there.
  std::optional<int> CrossingTensors(int64_t position) const;
  // Cuts the nodes at `boundaries` (first 0, last nodes().size(), increasing;
  // every inner one a position where CrossingTensors has a value) into stages.
  absl::StatusOr<std::vector<std::unique_ptr<StageGraph>>> Split(const std::vector<int64_t>& boundaries) const;
  // The tensors that cross between the stages `boundaries` makes (see Split),
  // in the order they are made.
  std::vector<TensorFlow> Flows(const std::vector<int64_t>& boundaries) const;

  double total_flops() const;
  int64_t total_parameter_bytes() const;
  // A table of the nodes (index, kind, output shape, FLOPs, parameter and
  // activation bytes, parameters) and the totals.
  std::string Summary() const;
  // The TorchScript IR of the traced graph.
  std::string IrText() const;
  // The traced graph itself (inputs: the model's inputs, then parameters();
  // shapes are the example's), for passes that rewrite a copy of it
  // (Graph::copy), never the graph itself.
  std::shared_ptr<torch::jit::Graph> jit_graph() const;
  // A forward that runs `graph` (a rewritten copy of a jit_graph(): the
  // model's inputs, then one tensor per parameter) with `parameters` in the
  // interpreter: trace it (Trace) for the rewritten model's graph.
  static Forward GraphForward(std::shared_ptr<torch::jit::Graph> graph, std::vector<at::Tensor> parameters);
  // Rewrites the products of a linear layer as the tracer records them from
  // C++ (matmul(x, t(W)) then add_(b), or addmm(b, x, t(W))) in `graph` (a
  // copy of a jit_graph(), parameters from input `first_parameter` on) into
  // aten::linear(x, W, b), as Python's traces record them: one operator per
  // layer for the passes that rewrite layers.
  static void CanonicalizeLinearProducts(torch::jit::Graph& graph, size_t first_parameter);

  // The graph with its tied parameters untied (Merak's no_tie_modules): each
  // second name of a tied tensor (aliases()) becomes a parameter of its own,
  // starting as a copy of the tied tensor. The operators that read a tied
  // input are given its names in turn: the k-th reader in graph order reads
  // the k-th name in the order Trace was given them (module order: GPT's
  // embedding, transformer.wte, before its head, lm_head). Fails, naming the
  // readers, where a tied tensor has not one reading operator per name.
  struct Untied {
    std::vector<std::pair<std::string, at::Tensor>> parameters;  // trace `forward` with these
    Forward forward;
    std::vector<std::string> untied;  // "lm_head.weight (was transformer.wte.weight)", one per alias
  };
  absl::StatusOr<Untied> Untie() const;

 private:
  class Impl;
  explicit ModelGraph(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace trident

#endif  // TRIDENT_GRAPH_MODEL_GRAPH_H_
