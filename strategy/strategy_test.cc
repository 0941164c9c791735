#include "strategy/strategy.h"

#include <gmock/gmock.h>
#include <google/protobuf/text_format.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"

namespace trident {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

Strategy Parse(const std::string& text) {
  Strategy strategy;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &strategy)) << text;
  return strategy;
}

absl::StatusOr<ParallelPlan> Apply(const std::string& text, int world_size) {
  ParallelPlan plan;
  plan.set_num_micro_batches(4);
  TRIDENT_RETURN_IF_ERROR(ApplyStrategy(Parse(text), world_size, &plan));
  return plan;
}

std::string Error(const std::string& text, int world_size) {
  return std::string(Apply(text, world_size).status().message());
}

TEST(StrategyTest, ParallelModeAdjustsDataToTheWorld) {
  auto plan = Apply(R"(methods { name: "parallel_mode" parallel_mode { name: "tensor" size: 2 }
                        parallel_mode { name: "pipeline" size: 2 } parallel_mode { name: "data" size: 1 } }
                       methods { name: "mixed_parallel" })",
                    8);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->tp(), 2);
  EXPECT_EQ(plan->pp(), 2);
  EXPECT_EQ(plan->dp(), 2);
  auto plain = Apply("", 4);  // no methods: data parallelism over every rank
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->dp(), 4);
}

TEST(StrategyTest, MethodsSetPrecisionZeroRecomputationAndTheSchedule) {
  auto plan = Apply(R"(methods { name: "parallel_mode" parallel_mode { name: "pipeline" size: 2 } }
                       methods { name: "amp_native" dtype: "bf16" skip_if_nonfinite: true }
                       methods { name: "zero2" }
                       methods { name: "checkpoint" layers: "transformer.h.1" checkpoint_num_layers: 2 }
                       methods { name: "pipeline_parallel" schedule: "zb_h1" micro_batches: 8 })",
                    4);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->dp(), 2);
  EXPECT_EQ(plan->precision().mode(), "bf16");
  EXPECT_TRUE(plan->precision().loss_scaling());
  EXPECT_EQ(plan->precision().loss_scaler().loss_scale(), 1);
  EXPECT_EQ(plan->zero().stage(), 2);
  EXPECT_EQ(plan->recompute().method(), RecomputeSpec::selected);
  EXPECT_THAT(plan->recompute().layers(), ElementsAre("transformer.h.1"));
  EXPECT_EQ(plan->recompute().num_layers(), 2);
  EXPECT_EQ(plan->pipeline().schedule(), "zb_h1");
  EXPECT_EQ(plan->num_micro_batches(), 8);
  EXPECT_EQ(DescribePlan(*plan), "dp2 x pp2 zb_h1 mb1x8 zero2 bf16 recompute=selected");
  auto half = Apply(R"(methods { name: "half" dtype: "bf16" } methods { name: "fsdp" }
                       methods { name: "checkpoint" activation_checkpoint_ratio: 0.3 })",
                    2);
  ASSERT_TRUE(half.ok()) << half.status();
  EXPECT_EQ(half->precision().mode(), "pure_bf16");
  EXPECT_EQ(half->zero().stage(), 3);
  EXPECT_EQ(half->recompute().method(), RecomputeSpec::stage_aware);
}

// Every field a strategy decides, for comparing plans.
std::string DecidedFields(const ParallelPlan& p) {
  return absl::StrCat(
      "dp=", p.dp(), " tp=", p.tp(), " pp=", p.pp(), " axes=", absl::StrJoin(p.axis_order(), ","),
      " ranks=", absl::StrJoin(p.rank_order(), ","), " zero=", p.zero().stage(), "/",
      ZeroShardGroupSize(p.zero(), p.dp()).value_or(-1), "/", ZeroSpec::Offload_Name(p.zero().offload_optimizer()), "/",
      ZeroSpec::Offload_Name(p.zero().offload_params()), "/", absl::StrJoin(p.zero().ignored(), ","), "/",
      absl::StrJoin(p.zero().wrap(), ","), "/", p.zero().min_num_params(), "/", p.zero().limit_all_gathers(),
      " precision=", p.precision().mode(), " table=", p.precision().table(), " scaling=", p.precision().loss_scaling(),
      "/", p.precision().loss_scaler().loss_scale(), "/", p.precision().loss_scaler().initial_scale_power(), "/",
      p.precision().loss_scaler().loss_scale_window(), "/", p.precision().loss_scaler().hysteresis(), "/",
      p.precision().loss_scaler().min_loss_scale(), " recompute=", RecomputeSpec::Method_Name(p.recompute().method()),
      " layers=", absl::StrJoin(p.recompute().layers(), ","), " ratio=", p.recompute().ratio(),
      " segment=", p.recompute().num_layers(), " modules=", absl::StrJoin(p.recompute().modules(), ","),
      " replace=", absl::StrJoin(p.module_replace(), ","), " sp=", p.tensor_parallel().sequence_parallel(),
      " overlap=", p.tensor_parallel().overlapping_level(), " schedule=", p.pipeline().schedule(),
      " chunks=", p.virtual_stages(), " micro=", p.num_micro_batches(), " split=", p.trace().split_method(),
      " partition=", p.pipeline().partition_method());
}

std::vector<ParallelPlan> PlansUsingEveryMethod() {
  std::vector<ParallelPlan> plans(9);
  {
    ParallelPlan& p = plans[0];  // 3D, sequence parallel, interleaved, full recomputation
    p.set_dp(2);
    p.set_tp(2);
    p.set_pp(2);
    p.mutable_tensor_parallel()->set_sequence_parallel(true);
    p.mutable_zero()->set_stage(1);
    p.mutable_precision()->set_mode("bf16");
    p.mutable_pipeline()->set_schedule("interleaved_1f1b");
    p.set_virtual_stages(2);
    p.set_num_micro_batches(4);
    p.mutable_recompute()->set_method(RecomputeSpec::full);
  }
  {
    ParallelPlan& p = plans[1];  // data fastest, a rank order, overlap, replacement, modules
    p.set_dp(2);
    p.set_tp(2);
    SetStrings(p.mutable_axis_order(), {"data", "tensor", "pipeline"});
    for (int rank : {3, 1, 2, 0}) p.add_rank_order(rank);
    p.mutable_tensor_parallel()->set_overlapping_level(2);
    SetStrings(p.mutable_module_replace(), {"fused_attention", "fused_layer_norm"});
    p.mutable_recompute()->add_modules("attn");
    p.mutable_precision()->set_mode("pure_bf16");
    p.mutable_precision()->set_table("buffer=fp32");
  }
  {
    ParallelPlan& p = plans[2];  // zero bubble, selected layers, skip on overflow
    p.set_dp(1);
    p.set_pp(4);
    p.mutable_pipeline()->set_schedule("zb_h1");
    p.set_num_micro_batches(8);
    p.mutable_recompute()->set_method(RecomputeSpec::selected);
    p.mutable_recompute()->add_layers("transformer.h.1");
    p.mutable_recompute()->add_layers("transformer.h.5");
    p.mutable_recompute()->set_num_layers(2);
    p.mutable_trace()->set_split_method("layer_split");
    p.mutable_pipeline()->set_partition_method("parameters");
    p.mutable_precision()->set_mode("bf16");
    p.mutable_precision()->set_loss_scaling(true);  // a static scale of 1: skip_if_nonfinite
    p.mutable_precision()->mutable_loss_scaler()->set_loss_scale(1);
  }
  {
    ParallelPlan& p = plans[3];  // stage-aware with modules, pipeline before tensor
    p.set_dp(1);
    p.set_tp(2);
    p.set_pp(2);
    SetStrings(p.mutable_axis_order(), {"pipeline", "tensor", "data"});
    p.mutable_recompute()->set_method(RecomputeSpec::stage_aware);
    p.mutable_recompute()->set_ratio(0.3);
    p.mutable_recompute()->add_modules("mlp");
    p.set_num_micro_batches(2);
  }
  {
    ParallelPlan& p = plans[4];  // ZeRO-3, every layer and modules, accumulation
    p.set_dp(4);
    p.mutable_zero()->set_stage(3);
    p.mutable_recompute()->set_method(RecomputeSpec::full);
    p.mutable_recompute()->add_modules("attn");
    p.mutable_recompute()->add_modules("mlp");
    p.set_num_micro_batches(3);
    p.mutable_precision()->set_table("param=bf16");
  }
  plans[5].set_dp(4);  // the default plan
  {
    ParallelPlan& p = plans[6];  // fp16 with a dynamic scaler of its own
    p.set_dp(2);
    p.set_device(ParallelPlan::cuda);
    p.mutable_precision()->set_mode("fp16");
    p.mutable_precision()->mutable_loss_scaler()->set_initial_scale_power(8);
    p.mutable_precision()->mutable_loss_scaler()->set_loss_scale_window(500);
    p.mutable_precision()->mutable_loss_scaler()->set_hysteresis(3);
    p.mutable_precision()->mutable_loss_scaler()->set_min_loss_scale(0.5);
  }
  {
    ParallelPlan& p = plans[7];  // fp16 storage with a static scale
    p.set_dp(2);
    p.set_device(ParallelPlan::cuda);
    p.mutable_precision()->set_mode("pure_fp16");
    p.mutable_precision()->mutable_loss_scaler()->set_loss_scale(1024);
  }
  {
    ParallelPlan& p = plans[8];  // hybrid sharding: ZeRO-3 over pairs, replicated twice, beside tensor ranks
    p.set_dp(4);
    p.set_tp(2);
    p.mutable_zero()->set_stage(3);
    p.mutable_zero()->set_shard_group_size(2);
    p.mutable_zero()->set_offload_optimizer(ZeroSpec::disk);
    p.mutable_zero()->set_offload_params(ZeroSpec::disk);
    p.mutable_zero()->add_ignored("transformer.wte");
    p.mutable_zero()->add_wrap("transformer.h");
    p.mutable_zero()->set_min_num_params(100000);
    p.mutable_zero()->set_limit_all_gathers(true);
  }
  return plans;
}

TEST(StrategyTest, DescribePlanNamesTheLayoutInALine) {
  EXPECT_EQ(DescribePlan(PlansUsingEveryMethod()[0]),
            "dp2 x tp2 x pp2 interleaved_1f1bx2 mb1x4 sp zero1 bf16 recompute=full");
}

TEST(StrategyTest, ZeroBesideDataShardsOverBlocksOfZeroRanks) {
  auto plan = Apply(R"(methods { name: "parallel_mode" parallel_mode { name: "zero" size: 2 }
                       parallel_mode { name: "data" size: 2 } } methods { name: "fsdp" })",
                    4);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->dp(), 4);
  EXPECT_EQ(plan->zero().shard_group_size(), 2);
  EXPECT_EQ(DescribePlan(*plan), "dp4 mb1x4 zero3 shard2");
  auto uneven = Apply(R"(methods { name: "parallel_mode" parallel_mode { name: "zero" size: 4 }
                         parallel_mode { name: "data" size: 2 } } methods { name: "fsdp" })",
                      6);
  ASSERT_FALSE(uneven.ok());
  EXPECT_THAT(std::string(uneven.status().message()), HasSubstr("zero size 4 does not divide the 6"));
}

TEST(StrategyTest, ApplyStrategyInvertsStrategyFromPlan) {
  for (const ParallelPlan& plan : PlansUsingEveryMethod()) {
    ASSERT_TRUE(ValidatePlan(plan).ok()) << ValidatePlan(plan) << DecidedFields(plan);
    ParallelPlan again;
    again.set_device(plan.device());  // not the strategy's: fp16 needs a GPU
    absl::Status applied = ApplyStrategy(StrategyFromPlan(plan), plan.dp() * plan.tp() * plan.pp(), &again);
    ASSERT_TRUE(applied.ok()) << applied << "\n" << StrategyToText(StrategyFromPlan(plan));
    EXPECT_EQ(DecidedFields(again), DecidedFields(plan)) << StrategyToText(StrategyFromPlan(plan));
  }
}

TEST(StrategyTest, ASavedStrategyLoadsAndSavesByteForByte) {
  const std::string path = ::testing::TempDir() + "/strategy.pbtxt";
  for (const ParallelPlan& plan : PlansUsingEveryMethod()) {
    const std::string text = StrategyToText(StrategyFromPlan(plan));
    ASSERT_TRUE(SaveStrategy(StrategyFromPlan(plan), path).ok());
    auto loaded = LoadStrategy(path);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    ParallelPlan applied;
    applied.set_device(plan.device());
    ASSERT_TRUE(ApplyStrategy(*loaded, plan.dp() * plan.tp() * plan.pp(), &applied).ok());
    EXPECT_EQ(StrategyToText(StrategyFromPlan(applied)), text);
  }
}

TEST(StrategyTest, ParallelModeOrderAndRankOrderLayTheRanksOut) {
  auto data_first = Apply(R"(methods { name: "parallel_mode" parallel_mode { name: "data" size: 2 }
                              parallel_mode { name: "tensor" size: 2 } rank_order: [0, 2, 1, 3] })",
                          4);
  ASSERT_TRUE(data_first.ok()) << data_first.status();
  EXPECT_EQ(absl::StrJoin(data_first->axis_order(), ","), "data,tensor,pipeline");
  EXPECT_EQ(absl::StrJoin(data_first->rank_order(), ","), "0,2,1,3");
  EXPECT_EQ(DescribePlan(*data_first), "dp2 x tp2 mb1x4 axes=data,tensor,pipeline ranks=0,2,1,3");
  std::vector<MeshAxis> axes = PlanMeshAxes(*data_first);
  ASSERT_EQ(axes.size(), 3u);
  EXPECT_EQ(axes[0].name, "data");
  EXPECT_EQ(axes[1].name, "tensor");
  // The default order, and an identity rank order, are written as empty.
  auto usual = Apply(R"(methods { name: "parallel_mode" parallel_mode { name: "pipeline" size: 2 }
                         parallel_mode { name: "data" size: 2 } rank_order: [0, 1, 2, 3] })",
                     4);
  ASSERT_TRUE(usual.ok()) << usual.status();
  EXPECT_TRUE(usual->axis_order().empty());
  EXPECT_TRUE(usual->rank_order().empty());
  EXPECT_THAT(
      Error(R"(methods { name: "parallel_mode" parallel_mode { name: "data" size: 2 } rank_order: [0, 0] })", 2),
      HasSubstr("rank order 0,0 is not a permutation of the ranks 0 to 1"));
}

TEST(StrategyTest, BadStrategiesNameTheMethodOrThePair) {
  EXPECT_THAT(Error(R"(methods { name: "turbo" })", 2), HasSubstr("unknown method 'turbo'; choose amp_native"));
  EXPECT_THAT(Error(R"(methods { name: "zero2" schedule: "1f1b" })", 2),
              HasSubstr("method 'zero2' takes no 'schedule'"));
  EXPECT_THAT(Error(R"(methods { name: "zero1" } methods { name: "zero1" })", 2), HasSubstr("given twice"));
  EXPECT_THAT(Error(R"(methods { name: "amp_native" } methods { name: "half" })", 2),
              HasSubstr("'amp_native' and 'half' do not go together"));
  EXPECT_THAT(Error(R"(methods { name: "zero1" } methods { name: "fsdp" })", 2),
              HasSubstr("'zero1' and 'fsdp' do not go together"));
  EXPECT_THAT(Error(R"(methods { name: "parallel_mode" parallel_mode { name: "pipeline" size: 2 } }
                       methods { name: "fsdp" } methods { name: "pipeline_parallel" schedule: "zb_h1" })",
                    2),
              HasSubstr("fsdp with pipeline_parallel schedule zb_h1"));
  EXPECT_THAT(Error(R"(methods { name: "parallel_mode" parallel_mode { name: "tensor" size: 3 } })", 4),
              HasSubstr("tensor x pipeline = 3 x 1 does not divide the 4 ranks"));
  EXPECT_THAT(Error(R"(methods { name: "tensor_parallel" })", 2), HasSubstr("tensor_parallel needs tensor ranks"));
  EXPECT_THAT(Error(R"(methods { name: "amp_native" dtype: "fp8" })", 2), HasSubstr("choose bf16 or fp16"));
  EXPECT_THAT(Error(R"(methods { name: "module_replace" })", 2), HasSubstr("module_replace names no pairs"));
  EXPECT_THAT(Error(R"(methods { name: "checkpoint" all_layers: true layers: "h.1" })", 2),
              HasSubstr("all_layers recomputes every layer"));
  // The plan's own checks follow: fp16 needs a GPU.
  EXPECT_THAT(Error(R"(methods { name: "amp_native" })", 2), HasSubstr("float16, which needs a GPU"));
}

}  // namespace
}  // namespace trident
