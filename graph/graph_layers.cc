#include "graph/graph_layers.h"

#include <algorithm>
#include <functional>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "base/module_names.h"
#include "base/recompute.h"
#include "base/status.h"

namespace trident {
namespace {

// Every module name a parameter name lies under ("a.b.w": "a", "a.b").
std::vector<std::string> EnclosingModules(const std::string& parameter) {
  std::vector<std::string> modules;
  for (size_t dot = parameter.find('.'); dot != std::string::npos; dot = parameter.find('.', dot + 1)) {
    modules.push_back(parameter.substr(0, dot));
  }
  return modules;
}

bool Within(const std::string& name, const std::string& module) {
  return name.size() > module.size() && name.compare(0, module.size(), module) == 0 && name[module.size()] == '.';
}

}  // namespace

absl::StatusOr<ModuleSpans> FindModuleSpans(const ModelGraph& graph, const std::vector<std::string>& patterns,
                                            const std::map<std::string, std::string>& module_types) {
  // Every name of each graph parameter (tied ones have several).
  std::map<std::string, std::vector<std::string>> names;
  for (const std::string& name : graph.parameter_names()) names[name].push_back(name);
  for (const auto& [alias, name] : graph.aliases()) names[name].push_back(alias);
  // The operators reading parameters under each module, by module name.
  std::map<std::string, std::vector<int64_t>> readers;
  const std::vector<GraphNode>& nodes = graph.nodes();
  for (int64_t i = 0; i < static_cast<int64_t>(nodes.size()); ++i) {
    for (const std::string& parameter : nodes[i].parameters) {
      for (const std::string& name : names[parameter]) {
        for (const std::string& module : EnclosingModules(name)) readers[module].push_back(i);
      }
    }
  }
  ModuleSpans result;
  result.hits.assign(patterns.size(), 0);
  std::vector<NodeSpan> spans;
  for (const auto& [module, reading] : readers) {
    auto type = module_types.find(module);
    bool matched = false;
    for (size_t p = 0; p < patterns.size(); ++p) {
      if (ModuleNameMatches(module, patterns[p]) ||
          (type != module_types.end() && ModuleTypeMatches(type->second, patterns[p]))) {
        ++result.hits[p];
        matched = true;
      }
    }
    if (!matched) continue;
    const auto [first, last] = std::minmax_element(reading.begin(), reading.end());
    for (int64_t i = *first; i <= *last; ++i) {
      for (const std::string& parameter : nodes[i].parameters) {
        const std::vector<std::string>& all = names[parameter];
        if (std::none_of(all.begin(), all.end(), [&](const std::string& n) { return Within(n, module); })) {
          return absl::InvalidArgumentError(absl::StrCat(
              "checkpoint_modules: module '", module, "' is not one run of operators in the traced graph: between ",
              "the first and the last operator reading its parameters (", *first, " and ", *last, ") operator ", i,
              " (", nodes[i].kind, ") reads '", parameter, "' of another module; name its submodules instead"));
        }
      }
    }
    spans.push_back({*first, *last + 1});
  }
  std::sort(spans.begin(), spans.end(), [](const NodeSpan& a, const NodeSpan& b) { return a.first < b.first; });
  for (const NodeSpan& span : spans) {  // nested or overlapping modules: one span
    if (!result.spans.empty() && span.first <= result.spans.back().end) {
      result.spans.back().end = std::max(result.spans.back().end, span.end);
    } else {
      result.spans.push_back(span);
    }
  }
  return result;
}

absl::StatusOr<std::unique_ptr<GraphLayers>> GraphLayers::Create(std::shared_ptr<ModelGraph> graph,
                                                                 const std::vector<int64_t>& boundaries,
                                                                 const std::vector<NodeSpan>& recomputed) {
  const int64_t count = static_cast<int64_t>(graph->nodes().size());
  auto cuttable = [&](int64_t position) {
    return position <= 0 || position >= count || graph->CrossingTensors(position).has_value();
  };
  // Pieces: the shards cut again where recomputed spans (widened to cuts) start and end.
  std::set<int64_t> cuts(boundaries.begin(), boundaries.end());
  std::vector<NodeSpan> widened;
  for (NodeSpan span : recomputed) {
    while (!cuttable(span.first)) --span.first;
    while (!cuttable(span.end)) ++span.end;
    span.first = std::max<int64_t>(span.first, 0);
    span.end = std::min(span.end, count);
    if (span.first >= span.end) continue;
    cuts.insert(span.first);
    cuts.insert(span.end);
    widened.push_back(span);
  }
  const std::vector<int64_t> piece_cuts(cuts.begin(), cuts.end());
  bool rising = boundaries.size() >= 2 && boundaries.front() == 0 && boundaries.back() == count;
  for (size_t i = 1; rising && i < boundaries.size(); ++i) rising = boundaries[i] > boundaries[i - 1];
  // Split(boundaries) says what is wrong with boundaries that do not rise.
  TRIDENT_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<StageGraph>> pieces,
                           graph->Split(rising ? piece_cuts : boundaries));
  std::unique_ptr<GraphLayers> layers(new GraphLayers());
  layers->boundaries_ = boundaries;
  std::map<std::string, at::Tensor> by_name;
  for (size_t i = 0; i < graph->parameters().size(); ++i) {
    by_name[graph->parameter_names()[i]] = graph->parameters()[i];
  }
  size_t next = 0;  // the next piece
  for (size_t i = 0; i + 1 < boundaries.size(); ++i) {
    layers->crossing_.push_back(i == 0 ? std::vector<int64_t>{} : graph->CrossingValueIds(boundaries[i]));
    std::vector<Piece> shard;
    NamedTensors parameters;
    std::set<std::string> named;
    std::set<int> fields;
    for (; next < pieces.size() && piece_cuts[next] < boundaries[i + 1]; ++next) {
      const int64_t first = piece_cuts[next];
      const bool recomputing = std::any_of(widened.begin(), widened.end(), [&](const NodeSpan& span) {
        return span.first <= first && first < span.end;
      });
      Values read;
      for (const std::string& name : pieces[next]->parameter_names()) {
        read.push_back(by_name.at(name));
        if (named.insert(name).second) parameters.emplace_back(name, read.back());
      }
      fields.insert(pieces[next]->model_inputs().begin(), pieces[next]->model_inputs().end());
      shard.push_back({std::move(pieces[next]), recomputing, std::move(read)});
    }
    layers->pieces_.push_back(std::move(shard));
    layers->parameters_.push_back(std::move(parameters));
    layers->batch_fields_.emplace_back(fields.begin(), fields.end());
  }
  layers->crossing_.push_back(graph->output_ids());
  // Every output must be made by some shard (carried to the end from there).
  std::set<int64_t> made;
  for (const auto& shard : layers->pieces_) {
    for (const Piece& piece : shard) made.insert(piece.graph->sent().begin(), piece.graph->sent().end());
  }
  for (size_t o = 0; o < graph->output_ids().size(); ++o) {
    if (!made.count(graph->output_ids()[o])) {
      return absl::InvalidArgumentError(
          absl::StrCat("output ", o,
                       " of the traced model is not computed by any operator (an input or a "
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
    throw std::invalid_argument(
        absl::StrCat("shard ", i, " takes ", in_ids.size(), " tensors from the shard before it, got ", inputs.size()));
  }
  std::map<int64_t, at::Tensor> values;
  for (size_t k = 0; k < in_ids.size(); ++k) values[in_ids[k]] = inputs[k];
  for (const Piece& piece : pieces_.at(i)) {
    const StageGraph& graph = *piece.graph;
    Values received;
    for (int64_t id : graph.received()) received.push_back(values.at(id));
    // Held by the recomputing backward after this call returns: copies only.
    std::function<Values(const Values&)> run = [&graph, batch](const Values& in) {
      absl::StatusOr<std::vector<at::Tensor>> sent = graph.Run(in, batch);
      if (!sent.ok()) throw std::runtime_error(std::string(sent.status().message()));
      return *std::move(sent);
    };
    const Values sent = piece.recomputed ? RecomputeInBackward(run, received, piece.parameters) : run(received);
    for (size_t k = 0; k < graph.sent().size(); ++k) values[graph.sent()[k]] = sent[k];
  }
  Values outputs;
  for (int64_t id : crossing_.at(i + 1)) outputs.push_back(values.at(id));
  return outputs;
}

std::vector<int> GraphLayers::BatchFields(int64_t i) const { return batch_fields_.at(i); }

NamedTensors GraphLayers::LayerParameters(int64_t i) { return parameters_.at(i); }

void GraphLayers::MaterializeLayer(int64_t i) {
  if (!read_values_) return;
  std::vector<at::Tensor> tensors;
  for (const auto& [name, tensor] : parameters_.at(i)) tensors.push_back(tensor);
  read_values_(tensors);
}

}  // namespace trident
