// This rank's part of a model source under a plan: the layers it holds (a
// LayerSequence, or a traced graph's shards) and the chunks (virtual stages)
// it runs. Private to //parallel.
#ifndef TRIDENT_PARALLEL_INTERNAL_MODEL_PART_H_
#define TRIDENT_PARALLEL_INTERNAL_MODEL_PART_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "graph/graph.h"
#include "parallel/parallel.h"
#include "partition/plan.pb.h"
#include "pipeline/stage_runner.h"
#include "replace/replace.h"

namespace trident {
namespace internal {

struct ModelPart {
  std::shared_ptr<LayerSequence> layers;       // holds (at least) this rank's chunks
  std::shared_ptr<void> keep_alive;            // what the layers borrow from (a loaded module)
  std::vector<StageChunk> chunks;              // this rank's virtual stages, specs not yet known
  Plan stage_plan;                             // every virtual stage
  std::map<std::string, std::string> aliases;  // second names of tied parameters
  double flops_per_sample = 0;                 // known for traced graphs
  bool traced = false;
  // Traced graphs at tp > 1: how the automatic pass sliced parameters, and
  // its plan as a table.
  std::map<std::string, ShardSpec> shards;
  std::string tensor_parallel_report;
  // With plan.lora(): how many modules each target matched here (a target no
  // stage matches is an error), and the adapters split over tp (in shards).
  std::vector<int> lora_target_hits;
  // How many modules each plan.recompute().modules() entry matched here.
  std::vector<int> recompute_hits;
  // Traced with plan.trace().no_tie_modules(): the names untied, as ModelGraph::Untie reports them.
  std::vector<std::string> untied;
  // What plan.module_replace() replaced here.
  ReplaceReport replace_report;
  // Module sources: a given loss function runs inside the layers, its result
  // first among the last layer's outputs.
  bool loss_inside = false;
};

// Builds `stage`'s part of `source` for tensor-parallel rank `tp_rank`.
// `example` is one micro-batch.
absl::StatusOr<ModelPart> BuildModelPart(const ModelSource& source, const ParallelPlan& plan, int stage, int tp_rank,
                                         const at::Device& device, const Batch& example);

// The batch fields `forward` takes: `input_names` looked up in `field_names`
// (all fields, in order, when empty). Errors name an unknown input.
absl::StatusOr<std::vector<int>> SelectInputs(const google::protobuf::RepeatedPtrField<std::string>& input_names,
                                              const google::protobuf::RepeatedPtrField<std::string>& field_names,
                                              size_t num_fields);

}  // namespace internal
}  // namespace trident

#endif  // TRIDENT_PARALLEL_INTERNAL_MODEL_PART_H_
