// strategy=auto in the trainer: the search on the job's ranks (or a saved
// strategy reused), applied to the plan the config resolved to.
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "strategy/strategy.h"
#include "trainer/internal/components.h"
#include "trainer/trainer.h"

namespace trident {
namespace {

std::string Component(const std::pair<std::string, ComponentArgs>& component) {
  std::vector<std::string> args;
  for (const auto& [key, value] : component.second.values()) args.push_back(absl::StrCat(key, "=", value));
  return absl::StrCat(component.first, "(", absl::StrJoin(args, ","), ")");
}

}  // namespace

absl::StatusOr<ParallelPlan> Trainer::ChooseStrategy(const TrainerConfig& config, ParallelPlan base,
                                                     Topology* topology) {
  const int world = topology->world_size();
  TRIDENT_RETURN_IF_ERROR(internal::PrepareDefaultCorpus(config, *topology));
  ModelContext whole;
  whole.seed = base.seed();
  TRIDENT_ASSIGN_OR_RETURN(internal::TrainingParts parts, internal::BuildParts(config, whole, /*open_data=*/true));
  // The first global batch, by the trainer's batch rule: what the profile and the dry runs run on.
  const int64_t global_batch_size = GlobalBatchSize(base);
  BatchSampler sampler(parts.train_data->size(), global_batch_size, base.seed(), config.dataset().shuffle());
  std::vector<int64_t> first;
  for (int64_t j = 0; j < global_batch_size; ++j) first.push_back(sampler.SampleIndex(0, j));
  TRIDENT_ASSIGN_OR_RETURN(Batch global, parts.train_data->Get(first));

  AutoAccelerateOptions options;
  options.base = base;
  SetStrings(options.base.mutable_trace()->mutable_batch_fields(), parts.train_data->field_names());
  options.excluded = ToVector(config.strategy().excluded());
  options.time_limit_s = config.strategy().time_limit_s();
  options.memory_limit_bytes = config.strategy().memory_limit_mb() << 20;
  options.load_strategy = config.strategy().load();
  options.finetune_strategy = config.strategy().finetune();
  options.save_strategy_to_file = config.strategy().save();
  options.verbose = true;
  options.dry_runs = config.strategy().dry_runs();
  options.allow_precision_change = config.strategy().allow_precision_change();
  options.profile_cache_dir = config.strategy().profile_cache_dir();
  options.model_fingerprint =
      absl::StrCat(Component(ModelComponent(config)), ";optimizer=", Component(OptimizerComponent(config)),
                   ";data=", internal::DataDirectory(config));

  // A strategy saved for this very run is reused (strategy_reuse).
  const std::string reuse = config.strategy().reuse() != "auto"         ? config.strategy().reuse()
                            : config.strategy().run_mode() == "compile" ? "moo"
                                                                        : "match";
  const std::string& saved_path = config.strategy().save();
  std::optional<Strategy> chosen;
  if (reuse != "override" && !saved_path.empty() && std::filesystem::exists(saved_path)) {
    TRIDENT_ASSIGN_OR_RETURN(Strategy saved, LoadStrategy(saved_path));
    const std::string wanted = StrategyFingerprint(options, world, global);
    if (saved.fingerprint() == wanted) {
      chosen = saved;
      if (topology->rank() == 0)
        std::cout << "reusing the strategy in " << saved_path << " (it was chosen for this run)\n";
    } else if (reuse == "match") {
      return absl::FailedPreconditionError(absl::StrCat(
          "save_strategy ", saved_path, " was chosen for another run (", saved.fingerprint(), "; this run is ", wanted,
          "); pass --strategy_reuse=override to search again, or moo to search whenever they differ"));
    }
  }
  const bool reused = chosen.has_value();
  if (!reused) {
    auto make_source = [&config](const ModelContext& context) -> absl::StatusOr<ModelSource> {
      TRIDENT_ASSIGN_OR_RETURN(internal::TrainingParts built, internal::BuildParts(config, context, false));
      return std::move(built.model);
    };
    TRIDENT_ASSIGN_OR_RETURN(SearchResult result,
                             SearchStrategy(make_source, global, parts.optimizer, topology, options));
    chosen = result.strategy;
  }
  // The strategy decides the layout, micro-batches (one unless it says), ZeRO,
  // recomputation and precision; the global batch stays.
  ParallelPlan plan = std::move(base);
  TRIDENT_RETURN_IF_ERROR(ApplyStrategy(*chosen, world, &plan));
  TRIDENT_RETURN_IF_ERROR(KeepGlobalBatch(global_batch_size, &plan));
  TRIDENT_RETURN_IF_ERROR(ValidatePlan(plan));
  // The search leaves the topology laid out for its choice; a reused one is laid out here.
  if (reused) TRIDENT_RETURN_IF_ERROR(topology->Reshape(PlanMeshAxes(plan), ToVector(plan.rank_order())));
  return plan;
}

}  // namespace trident
