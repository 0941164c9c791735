// TrainerConfig handling: text-format files, flag overrides by field name,
// and resolution into the run's ParallelPlan, checked before any work starts.
#ifndef TRIDENT_TRAINER_CONFIG_H_
#define TRIDENT_TRAINER_CONFIG_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "parallel/parallel.h"
#include "strategy/strategy.h"
#include "trainer/config.pb.h"

namespace trident {

// The trainer's defaults where they differ from the messages' own: the plan's
// dp 2, micro_batch_size 8, seed 1337 and ZeRO bucket sizes of 2e9 bytes.
// `train`, LoadTrainerConfig and the tests start from it.
TrainerConfig DefaultTrainerConfig();

// Reads a text-format TrainerConfig file over DefaultTrainerConfig(). A config
// in the flat form of earlier versions (lr: 3e-4, dp: 2, one field per line as
// every saved config has them) loads too: TranslateFlatConfig reads it.
absl::StatusOr<TrainerConfig> LoadTrainerConfig(const std::string& path);

// Applies every "--field=value" / "--field value" / "--[no]bool_field" in
// `args` that names a TrainerConfig field, by dotted path in nnScaler's form
// (--loop.lr=3e-4, --plan.zero.stage=3, --model.args.n_layer=4: a map's key is
// the rest of the name; a list grows by one item per flag), or by the flat
// alias of earlier versions (--lr, --zero_stage, --checkpoint_layers=a,b).
// Later flags win. Other arguments stay. Errors name the flag and the value
// that does not parse, or the part of a dotted name that is no field.
absl::Status ApplyConfigFlags(std::vector<std::string>* args, TrainerConfig* config);
// One flag: `name` (a dotted path or an alias) set from `value`.
absl::Status SetConfigFlag(const std::string& name, const std::string& value, TrainerConfig* config);
// The flat aliases by the dotted field they spell ("plan.zero.stage" ->
// "--zero_stage"), for --help; " (converted)" marks one whose value converts
// (bucket sizes in elements, torchscript:PATH, loss_scale's -1, ...).
std::multimap<std::string, std::string> ConfigFlagAliases();
// Applies the flat-form lines of a text config (top-level `alias: value`,
// tp_layer_lists { ... }) to `config` as their flags, renames the blocks of
// renamed messages (model_config -> model, ...) and returns the rest of the
// text, line numbers kept, for the text-format parser. Errors name the line.
absl::StatusOr<std::string> TranslateFlatConfig(const std::string& text, TrainerConfig* config);

// The run `config` describes on `world_size` ranks, resolved once, one way:
// every field is checked (the first problem found is the error, naming the
// field and what to do) and the layout comes back as a plan: the config's
// dp x tp x pp (dp following the rank count under elastic) with a
// load_strategy applied on top, and the micro-batches of the global batch
// (global_batch_size = micro_batch_size * grad_accumulation_steps * dp; a
// strategy keeps the config's global batch and sets the micro-batch size).
// With strategy=auto the plan is the search's starting point, one rank holding
// the whole global batch (Trainer::ChooseStrategy edits it). The config
// itself is not rewritten from the plan; only profile_step fills in its trace.
absl::StatusOr<ParallelPlan> ResolveConfig(TrainerConfig* config, int world_size);

// The checks of ResolveConfig that do not depend on the layout (the loop,
// evaluation, checkpoints, sampling, loss scaling, LoRA): what a config
// given with a model already laid out (Trainer::Create from TrainerInputs)
// must pass.
absl::Status CheckConfigFields(TrainerConfig* config);

// The ranks `config` lays out: dp*tp*pp, or its load_strategy's parallel_mode.
absl::StatusOr<int> ConfigWorldSize(const TrainerConfig& config);

// micro_batch_size * num_micro_batches * dp: the samples of one step.
int64_t GlobalBatchSize(const ParallelPlan& plan);
// Sets plan's micro_batch_size to keep `global` (strong scaling, as the
// reference has it) once a strategy has set dp and the micro-batch count;
// an error when they do not divide it.
absl::Status KeepGlobalBatch(int64_t global, ParallelPlan* plan);

// The model's registered type and arguments (the zoo's preset defaulting to
// <type>-tiny; no_tie_modules unties the zoo's head).
std::pair<std::string, ComponentArgs> ModelComponent(const TrainerConfig& config);
// The optimizer's type and arguments (adamw's absent ones the trainer's defaults).
std::pair<std::string, ComponentArgs> OptimizerComponent(const TrainerConfig& config);

// The items of a comma-separated field, trimmed.
std::vector<std::string> CommaList(const std::string& text);

// The config as text format, every field with a default included: what a
// run saves beside its checkpoints and metrics, and --config reads back.
std::string ConfigToText(const TrainerConfig& config);
// The fields that differ from their defaults, on one line (what a run prints).
std::string ConfigChangesToText(const TrainerConfig& config);

}  // namespace trident

#endif  // TRIDENT_TRAINER_CONFIG_H_
