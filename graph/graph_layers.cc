#include "graph/graph_layers.h"

#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace trident {

absl::StatusOr<std::unique_ptr<GraphLayers>> GraphLayers::Create(
    std::shared_ptr<ModelGraph> graph, const std::vector<int64_t>& boundaries) {
  std::unique_ptr<GraphLayers> layers(new GraphLayers());
  TRIDENT_ASSIGN_OR_RETURN(layers->shards_, graph->Split(boundaries));
  layers->boundaries_ = boundaries;
  std::map<std::string, at::Tensor> by_name;
  for (size_t i = 0; i < graph->parameters().size(); ++i) {
    by_name[graph->parameter_names()[i]] = graph->parameters()[i];
  }
  for (size_t i = 0; i + 1 < boundaries.size(); ++i) {
    layers->crossing_.push_back(i == 0 ? std::vector<int64_t>{} : graph->CrossingValueIds(boundaries[i]));
    NamedTensors parameters;
    for (const std::string& name : layers->shards_[i]->parameter_names()) {
      parameters.emplace_back(name, by_name.at(name));
    }
    layers->parameters_.push_back(std::move(parameters));
  }
  layers->crossing_.push_back(graph->output_ids());
  // Every output must be made by some shard (carried to the end from there).
  std::set<int64_t> made;
  for (const auto& shard : layers->shards_) made.insert(shard->sent().begin(), shard->sent().end());
  for (size_t o = 0; o < graph->output_ids().size(); ++o) {
    if (!made.count(graph->output_ids()[o])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "output ", o, " of the traced model is not computed by any operator (an input or a "
          "parameter returned as it is); return computed tensors only"));
    }
  }
  layers->graph_ = std::move(graph);
  return layers;
}

GraphLayers::~GraphLayers() = default;

std::string GraphLayers::LayerName(int64_t i) const { return absl::StrCat("shard", i); }

Values GraphLayers::ForwardLayer(int64_t i, const Values& inputs, const Batch& batch) {
  const std::vector<int64_t>& in_ids = crossing_.at(i);
  if (inputs.size() != in_ids.size()) {
    throw std::invalid_argument(absl::StrCat("shard ", i, " takes ", in_ids.size(),
                                             " tensors from the shard before it, got ", inputs.size()));
  }
  std::map<int64_t, at::Tensor> values;
  for (size_t k = 0; k < in_ids.size(); ++k) values[in_ids[k]] = inputs[k];
  const StageGraph& shard = *shards_[i];
  Values received;
  for (int64_t id : shard.received()) received.push_back(values.at(id));
  absl::StatusOr<std::vector<at::Tensor>> sent = shard.Run(received, batch);
  if (!sent.ok()) throw std::runtime_error(std::string(sent.status().message()));
  for (size_t k = 0; k < shard.sent().size(); ++k) values[shard.sent()[k]] = (*sent)[k];
  Values outputs;
  for (int64_t id : crossing_.at(i + 1)) outputs.push_back(values.at(id));
  return outputs;
}

std::vector<int> GraphLayers::BatchFields(int64_t i) const { return shards_.at(i)->model_inputs(); }

NamedTensors GraphLayers::LayerParameters(int64_t i) { return parameters_.at(i); }

}  // namespace trident
