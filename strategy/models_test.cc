// The search's memory model against what Parallelize builds: for layouts of
// gpt-tiny, llama-tiny and gpt-tiny traced from a plain module (its shards as
// layers) over 4 real ranks (dp, tp, sequence parallelism, pp, interleaving,
// ZeRO 1-3, recomputation), the predicted per-rank state bytes equal the
// ParallelModel's report exactly; the time model gives every layout a
// positive step time.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "models/models.h"
#include "strategy/internal/cost_model.h"
#include "strategy/internal/profile.h"
#include "testing/multiprocess.h"

namespace trident {
namespace {

struct Layout {
  int dp = 1, tp = 1, pp = 1;
  bool sp = false;
  int zero = 0;
  std::string schedule = "1f1b";
  int virtual_stages = 1;
  RecomputeSpec::Method recompute = RecomputeSpec::none;
  std::string partition = "uniform";
  int64_t micro_batches = 1;
  int shard_group_size = 0;     // hybrid sharding (0: every data-parallel rank)
  bool offload = false;         // the optimizer state on disk
  bool offload_params = false;  // ZeRO-3's parameter chunks on disk
  std::string ignored;          // parameters kept whole under ZeRO-3
  std::string wrap;             // ZeRO-3's layers gathered as one unit
};

ParallelPlan PlanOf(const Layout& l) {
  ParallelPlan plan;
  plan.set_dp(l.dp);
  plan.set_tp(l.tp);
  plan.set_pp(l.pp);
  plan.mutable_tensor_parallel()->set_sequence_parallel(l.sp);
  plan.mutable_zero()->set_stage(l.zero);
  plan.mutable_zero()->set_shard_group_size(l.shard_group_size);
  if (!l.ignored.empty()) plan.mutable_zero()->add_ignored(l.ignored);
  if (!l.wrap.empty()) plan.mutable_zero()->add_wrap(l.wrap);
  if (l.offload) plan.mutable_zero()->set_offload_optimizer(ZeroSpec::disk);
  if (l.offload_params) plan.mutable_zero()->set_offload_params(ZeroSpec::disk);
  plan.mutable_zero()->set_offload_dir(::testing::TempDir());
  plan.mutable_pipeline()->set_schedule(l.schedule);
  plan.set_virtual_stages(l.virtual_stages);
  plan.mutable_recompute()->set_method(l.recompute);
  plan.mutable_pipeline()->set_partition_method(l.partition);
  plan.set_num_micro_batches(l.micro_batches);
  plan.set_micro_batch_size(8 / l.dp / l.micro_batches);
  SetStrings(plan.mutable_trace()->mutable_batch_fields(), {"tokens", "targets"});
  return plan;
}

// The zoo's `type` by its registered factory (layers, tensor-parallel shards).
internal::SourceFactory ZooSource(const std::string& type, const std::string& preset) {
  return [=](const ModelContext& context) -> absl::StatusOr<ModelSource> {
    TRIDENT_ASSIGN_OR_RETURN(ModelFactory factory, ModelRegistry().Find(type));
    return factory(ComponentArgs(absl::StrCat("model '", type, "'"), {{"preset", preset}}), context);
  };
}

// GPT as a plain module: traced, cut into shards by farthest_min_deps.
internal::SourceFactory TracedGpt(const std::string& preset) {
  return [=](const ModelContext& context) -> absl::StatusOr<ModelSource> {
    if (context.tp.size > 1) return absl::InvalidArgumentError("a traced model has no tensor-parallel shards");
    TRIDENT_ASSIGN_OR_RETURN(ModelConfig config, PresetModelConfig("gpt", preset));
    TRIDENT_ASSIGN_OR_RETURN(std::shared_ptr<LanguageModel> model, CreateModel(config, /*seed=*/1));
    return ModelSource::FromModule(model, [model](const Values& in) { return Values{model->Loss(in[0], in[1])}; });
  };
}

// `degrees`: the tensor-parallel degrees the model's shapes allow (of 1, 2, 4).
// `blocks`: the module name the model's transformer blocks are under.
void CheckModel(Topology& topology, const std::string& preset, internal::SourceFactory make_source, int degrees,
                const std::string& blocks) {
  internal::ProfileRequest request;
  request.make_source = make_source;
  SetStrings(request.plan.mutable_trace()->mutable_batch_fields(), {"tokens", "targets"});
  request.plan.mutable_zero()->set_offload_dir(::testing::TempDir());  // where the disk is timed
  at::manual_seed(3);
  at::Tensor tokens = at::randint(256, {8, 128}, at::kLong);
  request.batch = {tokens, tokens.roll(-1, 1)};
  auto adamw = MakeOptimizerFactory("adamw", ComponentArgs("optimizer 'adamw'", {}));
  ASSERT_TRUE(adamw.ok()) << adamw.status();
  request.make_optimizer = *adamw;
  request.micro_batch_sizes = {1, 2};
  request.tp_degrees = {2, 4};
  request.max_collective_bytes = 1 << 20;
  request.fingerprint = preset;
  auto profile = internal::ProfileModel(request, &topology);
  ASSERT_TRUE(profile.ok()) << profile.status();
  ASSERT_EQ(profile->tensor_parallel_degrees_size(), degrees) << preset;
  ASSERT_EQ(profile->sequence_parallel_degrees_size(), degrees - 1) << preset;

  const std::vector<Layout> layouts = {
      {.dp = 4},
      {.dp = 4, .zero = 1},
      {.dp = 4, .zero = 2, .micro_batches = 2},
      {.dp = 4, .zero = 3},
      {.dp = 4, .zero = 3, .shard_group_size = 2, .ignored = blocks + ".0"},
      {.dp = 4, .zero = 3, .wrap = blocks},
      {.dp = 4, .zero = 2, .offload = true},
      {.dp = 2, .tp = 2},
      {.dp = 2, .tp = 2, .zero = 3, .offload = true, .offload_params = true},
      {.dp = 2, .tp = 2, .sp = true, .zero = 1},
      {.tp = 2, .pp = 2, .sp = true, .micro_batches = 2},
      {.tp = 4},
      {.tp = 2, .pp = 2, .recompute = RecomputeSpec::full, .micro_batches = 4},
      {.pp = 4, .partition = "parameters", .micro_batches = 4},
      {.dp = 2, .pp = 2, .zero = 2, .schedule = "zb_h1", .micro_batches = 2},
      {.dp = 2, .pp = 2, .zero = 3, .partition = "cost", .micro_batches = 2},
      {.dp = 2, .pp = 2, .zero = 1, .schedule = "interleaved_1f1b", .virtual_stages = 2, .micro_batches = 2},
      {.pp = 4, .schedule = "gpipe", .recompute = RecomputeSpec::stage_aware, .micro_batches = 8},
  };
  int checked = 0;
  for (const Layout& layout : layouts) {
    if (layout.tp >= 1 << degrees) continue;  // llama-tiny's 2 key-value heads: tp <= 2
    ++checked;
    const ParallelPlan plan = PlanOf(layout);
    ASSERT_TRUE(topology.Reshape(PlanMeshAxes(plan), ToVector(plan.rank_order())).ok());
    ModelContext context;
    if (plan.tp() > 1)
      context.tp = {plan.tp(), (*topology.Group("tensor"))->rank(), "tp", plan.tensor_parallel().sequence_parallel()};
    auto source = request.make_source(context);
    ASSERT_TRUE(source.ok()) << source.status();
    auto model =
        Parallelize(*source, plan, &topology,
                    {tokens.narrow(0, 0, plan.micro_batch_size()), tokens.narrow(0, 0, plan.micro_batch_size())},
                    request.make_optimizer);
    ASSERT_TRUE(model.ok()) << model.status();
    auto memory = internal::PredictMemory(*profile, plan);
    ASSERT_TRUE(memory.ok()) << memory.status();
    const MemoryReport reported = (*model)->Memory();
    const MemoryReport& predicted = memory->state[(*model)->stage()];
    const std::string what = absl::StrCat(
        preset, " ", layout.dp, "x", layout.tp, layout.sp ? "sp" : "", "x", layout.pp, " zero", layout.zero, " shard",
        layout.shard_group_size, layout.offload ? " offload" : "", layout.offload_params ? " offload_params" : "", " ",
        layout.schedule, " ", RecomputeSpec::Method_Name(layout.recompute));
    EXPECT_EQ(predicted.parameter_bytes, reported.parameter_bytes) << what;
    EXPECT_EQ(predicted.gradient_bytes, reported.gradient_bytes) << what;
    EXPECT_EQ(predicted.optimizer_bytes, reported.optimizer_bytes) << what;
    EXPECT_EQ(predicted.offloaded_optimizer_bytes, reported.offloaded_optimizer_bytes) << what;
    EXPECT_EQ(predicted.offloaded_parameter_bytes, reported.offloaded_parameter_bytes) << what;
    EXPECT_GT(memory->activations[(*model)->stage()], 0) << what;
    auto time = internal::PredictStepTime(*profile, plan);
    ASSERT_TRUE(time.ok()) << time.status();
    EXPECT_GT(time->step_seconds, 0) << what;
  }
  EXPECT_GE(checked, degrees == 1 ? 8 : 10) << preset;
  // Offload costs the disk's time at its measured bandwidth.
  EXPECT_GT(profile->disk_read_bytes_per_second(), 0);
  EXPECT_GT(profile->disk_write_bytes_per_second(), 0);
  auto in_memory = internal::PredictStepTime(*profile, PlanOf({.dp = 4, .zero = 3}));
  auto offloaded =
      internal::PredictStepTime(*profile, PlanOf({.dp = 4, .zero = 3, .offload = true, .offload_params = true}));
  ASSERT_TRUE(in_memory.ok() && offloaded.ok());
  EXPECT_GT(offloaded->step_seconds, in_memory->step_seconds) << preset;
}

TEST(StrategyModelsTest, PredictedStateBytesEqualTheReportOfEveryLayout) {
  testing::MultiProcessOptions options;
  options.timeout = absl::Seconds(600);
  testing::RunOnRanks(
      4,
      [](int) {
        auto topology = testing::JoinTopology();
        ASSERT_TRUE(topology.ok()) << topology.status();
        CheckModel(**topology, "gpt-tiny", ZooSource("gpt", "gpt-tiny"), 3, "transformer.h");
        CheckModel(**topology, "llama-tiny", ZooSource("llama", "llama-tiny"), 2, "model.layers");
        CheckModel(**topology, "traced gpt-tiny", TracedGpt("gpt-tiny"), 1, "transformer.h");
      },
      options);
}

TEST(StrategyModelsTest, CollectiveCurvesInterpolateAndExtrapolate) {
  ModelProfile profile;
  CollectiveCurve* curve = profile.add_collectives();
  curve->set_op("all_reduce");
  curve->set_group_size(2);
  for (double bytes : {1000.0, 2000.0, 4000.0}) {
    curve->add_bytes(bytes);
    curve->add_seconds(bytes * 1e-6 + 1e-4);
  }
  EXPECT_NEAR(internal::CollectiveSeconds(profile, "all_reduce", 2, 3000), 3e-3 + 1e-4, 1e-9);
  EXPECT_NEAR(internal::CollectiveSeconds(profile, "all_reduce", 2, 8000), 8e-3 + 1e-4, 1e-9);
  EXPECT_EQ(internal::CollectiveSeconds(profile, "all_reduce", 1, 8000), 0);
  EXPECT_EQ(internal::CollectiveSeconds(profile, "all_gather", 2, 8000), 0);  // not profiled
}

}  // namespace
}  // namespace trident
