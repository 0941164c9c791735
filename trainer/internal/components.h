// What a TrainerConfig names, built from the registries: the model source, the
// datasets, the tokenizer and the optimizer factory.
#ifndef TRIDENT_TRAINER_INTERNAL_COMPONENTS_H_
#define TRIDENT_TRAINER_INTERNAL_COMPONENTS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "data/data.h"
#include "parallel/parallel.h"
#include "topology/topology.h"
#include "trainer/config.pb.h"

namespace trident {
namespace internal {

struct TrainingParts {
  ModelSource model;
  std::unique_ptr<Dataset> train_data, val_data;  // val_data may be null
  std::unique_ptr<Tokenizer> tokenizer;           // for token data
  OptimizerFactory optimizer;
};

// The data directory: config.data, or the default corpus's (prepared on first use).
std::string DataDirectory(const TrainerConfig& config);

// Builds the parts for the tensor-parallel place in `context`. With
// `open_data` false the datasets are only checked to exist (before ranks start).
absl::StatusOr<TrainingParts> BuildParts(const TrainerConfig& config, const ModelContext& context, bool open_data);

// Rank 0 prepares the default corpus (Debian's fortunes) once; the others wait.
absl::Status PrepareDefaultCorpus(const TrainerConfig& config, const Topology& topology);

}  // namespace internal
}  // namespace trident

#endif  // TRIDENT_TRAINER_INTERNAL_COMPONENTS_H_
