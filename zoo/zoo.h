// The zoo as model sources for Parallelize, registered by name ("gpt",
// "llama", "mlp") in ModelRegistry exactly as a user's model registers. Their
// arguments are a preset and the ModelConfig fields that override it:
//
//   auto factory = *ModelRegistry().Find("gpt");
//   ModelSource gpt = *factory(ComponentArgs("model 'gpt'", {{"preset", "gpt-tiny"}, {"n_layer", "2"}}),
//                              ModelContext{.seed = 1});
//
// Each pipeline rank builds only its own layers; under tensor parallelism each
// rank builds its shards (ModelContext::tp).
#ifndef TRIDENT_ZOO_ZOO_H_
#define TRIDENT_ZOO_ZOO_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "base/registry.h"
#include "models/models.h"
#include "parallel/parallel.h"

namespace trident {

// `config`'s model as a source: built layer range by layer range with the
// weights CreateModel gives for `seed`, its shards and tied head described.
ModelSource ZooModelSource(const ModelConfig& config, uint64_t seed);

// The config of zoo model `model` from `args` ("preset" and ModelConfig field
// names); the vocabulary defaults to `data_vocab_size` when that is positive.
// Errors name a bad argument or size.
absl::StatusOr<ModelConfig> ZooModelConfig(const std::string& model, const ComponentArgs& args,
                                           int64_t data_vocab_size);

}  // namespace trident

#endif  // TRIDENT_ZOO_ZOO_H_
