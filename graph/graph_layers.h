// GraphLayers: a traced ModelGraph cut into shards, run as a LayerSequence, so
// the pipeline runner, ZeRO-3 and activation checkpointing treat a traced
// model exactly like a model declared layer by layer.
//
//   std::shared_ptr<ModelGraph> graph = *ModelGraph::FromTorchScript("gpt.pt", {tokens, targets});
//   auto shards = SplitIntoShards(*graph, "farthest_min_deps", 12);    // //partition
//   auto layers = GraphLayers::Create(graph, *shards);
//   Values out = (*layers)->RunLayer(0, {}, {tokens, targets});          // shard 0
//
//   // ATorch's checkpoint method: the blocks' operators recompute in backward.
//   auto blocks = FindModuleSpans(*graph, {"Block"}, module_types);
//   auto recomputing = GraphLayers::Create(graph, *shards, blocks->spans);
//
// Layer i runs the operators [boundaries[i], boundaries[i + 1]) of
// graph.nodes(). It receives every tensor that earlier shards made and it or a
// later shard reads (skip connections ride along until their last reader), in
// the order the graph makes them, and returns the same for layer i + 1; the
// last layer returns the graph's outputs in order. Model inputs (batch fields)
// go straight to the shards that read them.
#ifndef TRIDENT_GRAPH_GRAPH_LAYERS_H_
#define TRIDENT_GRAPH_GRAPH_LAYERS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "graph/graph.h"
#include "graph/model_graph.h"

namespace trident {

// Operators [first, end) of a graph's nodes().
struct NodeSpan {
  int64_t first = 0, end = 0;
};

// The operator spans of the modules `patterns` name (ATorch's checkpoint
// method on a traced model). A pattern names modules by name, as
// ModuleNameMatches does, or by class (`module_types`: module name -> class
// name, ModuleTypeMatches). The graph keeps no module boundaries, so a module
// is found through its parameters: its span runs from the first operator that
// reads one of them to the last that does (a module without parameters cannot
// be found). `hits` counts the modules each pattern matched. Errors name a
// module whose span holds operators reading parameters of modules outside it
// (it is not one run of operators; a tied weight read far away, say).
struct ModuleSpans {
  std::vector<NodeSpan> spans;  // rising, disjoint
  std::vector<int> hits;        // per pattern
};
absl::StatusOr<ModuleSpans> FindModuleSpans(const ModelGraph& graph, const std::vector<std::string>& patterns,
                                            const std::map<std::string, std::string>& module_types);

class GraphLayers : public LayerSequence {
 public:
  // `boundaries` rise from 0 to graph->nodes().size() at cuts where only
  // tensors cross (SplitIntoShards gives such). Errors name a bad cut, and a
  // model output that no operator makes (an input returned as it is).
  // The operators of `recomputed` keep none of their activations: they run
  // without gradients in forward and again in backward (RecomputeInBackward).
  // A span widens to the nearest cuts where only tensors cross and is cut at
  // shard boundaries.
  static absl::StatusOr<std::unique_ptr<GraphLayers>> Create(std::shared_ptr<ModelGraph> graph,
                                                             const std::vector<int64_t>& boundaries,
                                                             const std::vector<NodeSpan>& recomputed = {});
  ~GraphLayers() override;

  int64_t NumLayers() const override { return static_cast<int64_t>(pieces_.size()); }
  // "shard<i>".
  std::string LayerName(int64_t i) const override;
  Values ForwardLayer(int64_t i, const Values& inputs, const Batch& batch) override;
  std::vector<int> BatchFields(int64_t i) const override;
  NamedTensors LayerParameters(int64_t i) override;
  // Reads shard i's parameter values through the function DeferValues gave.
  void MaterializeLayer(int64_t i) override;

  // The graph's parameters were loaded without their values (a TorchScript
  // file loaded with defer_values): MaterializeLayer(i) reads those of shard
  // i with `read_values` (TorchScriptModule::read_values).
  void DeferValues(std::function<void(const std::vector<at::Tensor>&)> read_values) {
    read_values_ = std::move(read_values);
  }

  const ModelGraph& graph() const { return *graph_; }
  const std::vector<int64_t>& boundaries() const { return boundaries_; }

 private:
  GraphLayers() = default;
  std::shared_ptr<ModelGraph> graph_;
  std::vector<int64_t> boundaries_;
  // Shard i runs pieces_[i] in order: its operators, cut where recomputed
  // spans start and end.
  struct Piece {
    std::unique_ptr<StageGraph> graph;
    bool recomputed = false;
    Values parameters;  // what the piece reads (recomputed pieces: see RecomputeInBackward)
  };
  std::vector<std::vector<Piece>> pieces_;
  // Value ids crossing each boundary (entering shard i: crossing_[i]); the
  // last entry is the graph's outputs.
  std::vector<std::vector<int64_t>> crossing_;
  std::vector<NamedTensors> parameters_;        // per shard
  std::vector<std::vector<int>> batch_fields_;  // per shard
  std::function<void(const std::vector<at::Tensor>&)> read_values_;
};

}  // namespace trident

#endif  // TRIDENT_GRAPH_GRAPH_LAYERS_H_
