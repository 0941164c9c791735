// GraphLayers: a traced ModelGraph cut into shards, run as a LayerSequence, so
// the pipeline runner, ZeRO-3 and activation checkpointing treat a traced
// model exactly like a model declared layer by layer.
//
//   auto graph = ModelGraph::FromTorchScript("gpt.pt", {tokens, targets});
//   auto shards = SplitIntoShards(**graph, "farthest_min_deps", 12);   // //partition
//   auto layers = GraphLayers::Create(std::move(*graph), *shards);
//   Values out = (*layers)->RunLayer(0, {}, {tokens, targets});          // shard 0
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
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "graph/graph.h"
#include "graph/model_graph.h"

namespace trident {

class GraphLayers : public LayerSequence {
 public:
  // `boundaries` rise from 0 to graph->nodes().size() at cuts where only
  // tensors cross (SplitIntoShards gives such). Errors name a bad cut, and a
  // model output that no operator makes (an input returned as it is).
  static absl::StatusOr<std::unique_ptr<GraphLayers>> Create(std::shared_ptr<ModelGraph> graph,
                                                             const std::vector<int64_t>& boundaries);
  ~GraphLayers() override;

  int64_t NumLayers() const override { return static_cast<int64_t>(shards_.size()); }
  // "shard<i>".
  std::string LayerName(int64_t i) const override;
  Values ForwardLayer(int64_t i, const Values& inputs, const Batch& batch) override;
  std::vector<int> BatchFields(int64_t i) const override;
  NamedTensors LayerParameters(int64_t i) override;

  const ModelGraph& graph() const { return *graph_; }
  const std::vector<int64_t>& boundaries() const { return boundaries_; }

 private:
  GraphLayers() = default;
  std::shared_ptr<ModelGraph> graph_;
  std::vector<int64_t> boundaries_;
  std::vector<std::unique_ptr<StageGraph>> shards_;
  // Value ids crossing each boundary (entering shard i: crossing_[i]); the
  // last entry is the graph's outputs.
  std::vector<std::vector<int64_t>> crossing_;
  std::vector<NamedTensors> parameters_;  // per shard
};

}  // namespace trident

#endif  // TRIDENT_GRAPH_GRAPH_LAYERS_H_
