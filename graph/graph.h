// graph: what partitioning needs to know about a model.
//
// This first part is the module-level path: a model that declares itself as an
// ordered list of named layers (a LayerSequence) is cut into pipeline stages at
// layer boundaries, without tracing, like the reference design's `layer_split`.
// The zoo's gpt, llama and mlp models are LayerSequences.
//
//   LayerSequence& layers = *model;  // e.g. a LanguageModel from //models
//   std::vector<LayerProfile> profile = ProfileLayers(layers, tokens);
//   // profile[i].parameters, .forward_flops, .activation_bytes per layer
//
// Any model can also be traced into an operator graph (ModelGraph,
// model_graph.h), which //partition cuts into stage sub-graphs.
#ifndef TRIDENT_GRAPH_GRAPH_H_
#define TRIDENT_GRAPH_GRAPH_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "graph/model_graph.h"

namespace trident {

// Watches layers run (ZeRO stage 3 gathers a layer's parameters before it runs
// and releases them after).
class LayerObserver {
 public:
  virtual ~LayerObserver() = default;
  virtual void BeforeLayer(int64_t layer) = 0;
  // `output` is the layer's result (it may register gradient hooks on it).
  virtual void AfterLayer(int64_t layer, const at::Tensor& output) = 0;
};

// A model as an ordered list of layers: layer 0 receives the model input, layer
// i > 0 the output of layer i - 1, and the loss is computed from the last output.
// Consecutive layers exchange exactly one tensor.
class LayerSequence {
 public:
  virtual ~LayerSequence() = default;
  // Runs layer i under the observer, if any: how callers run layers.
  at::Tensor RunLayer(int64_t i, const at::Tensor& input) {
    if (observer_ == nullptr) return ForwardLayer(i, input);
    observer_->BeforeLayer(i);
    at::Tensor output = ForwardLayer(i, input);
    observer_->AfterLayer(i, output);
    return output;
  }
  // Not owned; nullptr removes it.
  void SetObserver(LayerObserver* observer) { observer_ = observer; }
  virtual int64_t NumLayers() const = 0;
  // A name for layer i, the prefix of its own parameters where it has one
  // ("transformer.h.3"); usable as a `layer_split` point.
  virtual std::string LayerName(int64_t i) const = 0;
  virtual at::Tensor ForwardLayer(int64_t i, const at::Tensor& input) = 0;
  // The parameters layer i reads, by their model names. A tied parameter (GPT's
  // token embedding, read by the first and the last layer) is listed by both.
  virtual std::vector<std::pair<std::string, at::Tensor>> LayerParameters(int64_t i) = 0;
  // The loss of the last layer's output against `targets`.
  virtual at::Tensor SequenceLoss(const at::Tensor& output, const at::Tensor& targets) = 0;

 private:
  LayerObserver* observer_ = nullptr;
};

// What one layer costs, measured on an example input.
struct LayerProfile {
  std::string name;
  std::vector<std::string> parameter_names;  // as LayerSequence::LayerParameters lists them
  int64_t parameters = 0;        // scalars this layer reads (tied ones in each reader)
  int64_t parameter_bytes = 0;
  // Estimate: 2 * rows * (scalars of its matrices) for layers fed activations; 0
  // for a layer fed token ids (its matrices are looked up, not multiplied).
  double forward_flops = 0;
  int64_t activation_bytes = 0;  // size of the layer's output for the example input
  double forward_seconds = 0;    // measured: median of three runs on the example input
};

// Builds a part of a model that materialises (at least) layer `layer`.
using LayerBuilder = std::function<absl::StatusOr<std::shared_ptr<LayerSequence>>(int64_t layer)>;

// Memory-light profiling for models too large to build whole: layer i is
// profiled on a part that `build(i)` makes, which is freed before layer i + 1 is
// built; layer i's input is layer i - 1's output. Peak memory: about one layer.
absl::StatusOr<std::vector<LayerProfile>> ProfileLayersOneByOne(int64_t num_layers,
                                                                const LayerBuilder& build,
                                                                const at::Tensor& input);

// Profiles every layer by running the sequence on `input` (no gradients).
absl::StatusOr<std::vector<LayerProfile>> ProfileLayers(LayerSequence& layers,
                                                        const at::Tensor& input);

}  // namespace trident

#endif  // TRIDENT_GRAPH_GRAPH_H_
