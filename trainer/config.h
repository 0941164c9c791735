// TrainerConfig handling: text-format files, flag overrides by field name,
// resolution of the batch sizes, and validation before any work starts.
#ifndef TRIDENT_TRAINER_CONFIG_H_
#define TRIDENT_TRAINER_CONFIG_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "models/models.h"
#include "trainer/config.pb.h"

namespace trident {

// Parses a text-format TrainerConfig file.
absl::StatusOr<TrainerConfig> LoadTrainerConfig(const std::string& path);

// Applies every "--field=value" / "--field value" / "--[no]bool_field" in `args`
// that names a TrainerConfig field, and removes it from `args`. Other arguments
// stay. Errors name the flag and the value that does not parse.
absl::Status ApplyConfigFlags(std::vector<std::string>* args, TrainerConfig* config);

// Fills in global_batch_size / grad_accumulation_steps and checks every field
// against `world_size` ranks; the first problem found is the error, naming the
// field and what to do.
absl::Status ResolveConfig(TrainerConfig* config, int world_size);

// The model described by `config`'s preset and overrides; `data_vocab_size` is
// used when the config does not set vocab_size.
absl::StatusOr<ModelConfig> ResolveModelConfig(const TrainerConfig& config, int data_vocab_size);

// The config as text format, for printing and saving.
std::string ConfigToText(const TrainerConfig& config);

}  // namespace trident

#endif  // TRIDENT_TRAINER_CONFIG_H_
