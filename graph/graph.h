// graph: what partitioning needs to know about a model.
//
// This first part is the module-level path: a model that declares itself as an
// ordered list of named layers (a LayerSequence) is cut into pipeline stages at
// layer boundaries, without tracing, like the reference design's `layer_split`.
// The zoo's gpt, llama and mlp models are LayerSequences.
//
//   LayerSequence& layers = *model;  // e.g. a LanguageModel from //models
//   std::vector<LayerProfile> profile = *ProfileLayers(layers, {tokens, targets});
//   // profile[i].parameters, .forward_flops, .activation_bytes per layer
//
// Any model can also be traced into an operator graph (ModelGraph,
// model_graph.h), which //partition cuts into shards; GraphLayers
// (graph_layers.h) runs a cut graph as a LayerSequence of shards, so the
// pipeline runs traced models and layer sequences alike.
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
#include "base/tensors.h"
#include "graph/model_graph.h"

namespace trident {

// Which layers a part of a model materialises: the union of ranges [first, end).
using LayerRanges = std::vector<std::pair<int64_t, int64_t>>;

// Watches layers run (ZeRO stage 3 gathers a layer's parameters before it runs
// and releases them after).
class LayerObserver {
 public:
  virtual ~LayerObserver() = default;
  virtual void BeforeLayer(int64_t layer) = 0;
  // `outputs` are the layer's results (it may register gradient hooks on
  // them); those that are also among `inputs` were passed through unchanged.
  virtual void AfterLayer(int64_t layer, const Values& inputs, const Values& outputs) = 0;
};

// A model as an ordered list of layers: layer 0 reads the micro-batch, layer
// i > 0 what layer i - 1 returned (and any batch fields it needs), and the
// loss is computed from the last layer's outputs. A layer boundary may carry
// several tensors.
class LayerSequence {
 public:
  virtual ~LayerSequence() = default;
  // Runs layer i under the observer, if any: how callers run layers.
  Values RunLayer(int64_t i, const Values& inputs, const Batch& batch) {
    if (observer_ == nullptr) return ForwardLayer(i, inputs, batch);
    observer_->BeforeLayer(i);
    Values outputs = ForwardLayer(i, inputs, batch);
    observer_->AfterLayer(i, inputs, outputs);
    return outputs;
  }
  // Not owned; nullptr removes it.
  void SetObserver(LayerObserver* observer) { observer_ = observer; }
  virtual int64_t NumLayers() const = 0;
  // A name for layer i, the prefix of its own parameters where it has one
  // ("transformer.h.3"); usable as a `layer_split` point.
  virtual std::string LayerName(int64_t i) const = 0;
  // Layer i on what layer i - 1 returned (empty for layer 0) and the
  // micro-batch (the layer reads the fields it needs; BatchFields says which).
  virtual Values ForwardLayer(int64_t i, const Values& inputs, const Batch& batch) = 0;
  // The batch fields layer i reads (default: layer 0 reads field 0).
  virtual std::vector<int> BatchFields(int64_t i) const { return i == 0 ? std::vector<int>{0} : std::vector<int>{}; }
  // The parameters layer i reads, by their model names. A tied parameter (GPT's
  // token embedding, read by the first and the last layer) is listed by both.
  virtual NamedTensors LayerParameters(int64_t i) = 0;
  // The model's own scalar loss from the last layer's outputs and the batch.
  // The default: the first 0-dim floating-point output (nnScaler's convention:
  // a forward returning the loss, or a tuple whose first scalar is the loss);
  // throws when there is none (then a loss function must be given).
  virtual at::Tensor Loss(const Values& outputs, const Batch& batch);
  // Training or evaluation behaviour (dropout); the default has none.
  virtual void SetTraining(bool /*training*/) {}
  // Moves the parameters (and whatever else the layers hold) to `device`
  // keeping the tensors' identities. The default moves LayerParameters of the
  // layers in [0, NumLayers()) that are materialised.
  virtual void To(const at::Device& device);
  // Parts built with deferred values (ModelSource::build_deferred) draw the
  // values of the parameters layer i reads here, those not drawn yet; the
  // same values `build` gives. The default (values drawn when built): nothing.
  virtual void MaterializeLayer(int64_t /*i*/) {}
  // Incremental decoding (text generation with a key/value cache), for models
  // that offer it: after StartDecoding each forward takes only the positions
  // that follow those already given (token ids for layer 0), which attend to
  // the cached ones; KeepPositions(n) forgets positions from n on (padding);
  // StopDecoding clears the cache. The defaults: not offered.
  virtual bool SupportsDecoding() const { return false; }
  virtual void StartDecoding() {}
  virtual void KeepPositions(int64_t /*n*/) {}
  virtual void StopDecoding() {}

 private:
  LayerObserver* observer_ = nullptr;
};

// What one layer costs, measured on an example input.
struct LayerProfile {
  std::string name;
  std::vector<std::string> parameter_names;  // as LayerSequence::LayerParameters lists them
  int64_t parameters = 0;                    // scalars this layer reads (tied ones in each reader)
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
absl::StatusOr<std::vector<LayerProfile>> ProfileLayersOneByOne(int64_t num_layers, const LayerBuilder& build,
                                                                const Batch& batch);

// Profiles every layer by running the sequence on `batch` (no gradients).
absl::StatusOr<std::vector<LayerProfile>> ProfileLayers(LayerSequence& layers, const Batch& batch);

}  // namespace trident

#endif  // TRIDENT_GRAPH_GRAPH_H_
