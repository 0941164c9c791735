#include "strategy/strategy.h"

#include <gmock/gmock.h>
#include <google/protobuf/text_format.h>
#include <gtest/gtest.h>

#include "base/status.h"

namespace trident {
namespace {

using ::testing::HasSubstr;

Strategy Parse(const std::string& text) {
  Strategy strategy;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &strategy)) << text;
  return strategy;
}

absl::StatusOr<ParallelPlan> Apply(const std::string& text, int world_size) {
  ParallelPlan plan;
  plan.num_micro_batches = 4;
  TRIDENT_RETURN_IF_ERROR(ApplyStrategy(Parse(text), world_size, &plan));
  return plan;
}

std::string Error(const std::string& text, int world_size) {
  return std::string(Apply(text, world_size).status().message());
}

TEST(StrategyTest, ParallelModeAdjustsDataToTheWorld) {
  auto plan = Apply(R"(methods { name: "parallel_mode" parallel_mode { name: "tensor" size: 2 }
                        parallel_mode { name: "pipeline" size: 2 } parallel_mode { name: "data" size: 1 } }
                       methods { name: "mixed_parallel" })", 8);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->tp, 2);
  EXPECT_EQ(plan->pp, 2);
  EXPECT_EQ(plan->dp, 2);
  auto plain = Apply("", 4);  // no methods: data parallelism over every rank
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->dp, 4);
}

TEST(StrategyTest, MethodsSetPrecisionZeroRecomputationAndTheSchedule) {
  auto plan = Apply(R"(methods { name: "parallel_mode" parallel_mode { name: "pipeline" size: 2 } }
                       methods { name: "amp_native" dtype: "bf16" skip_if_nonfinite: true }
                       methods { name: "zero2" }
                       methods { name: "checkpoint" layers: "transformer.h.1" checkpoint_num_layers: 2 }
                       methods { name: "pipeline_parallel" schedule: "zb_h1" micro_batches: 8 })", 4);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->dp, 2);
  EXPECT_EQ(plan->precision, "bf16");
  EXPECT_TRUE(plan->loss_scaling);
  EXPECT_EQ(plan->loss_scaler.loss_scale, 1);
  EXPECT_EQ(plan->zero_stage, 2);
  EXPECT_EQ(plan->activation_checkpointing, "selected");
  EXPECT_EQ(plan->checkpoint_layers, std::vector<std::string>{"transformer.h.1"});
  EXPECT_EQ(plan->checkpoint_num_layers, 2);
  EXPECT_EQ(plan->schedule, "zb_h1");
  EXPECT_EQ(plan->num_micro_batches, 8);
  EXPECT_EQ(DescribePlan(*plan), "dp2 x pp2 zb_h1 mb1x8 zero2 bf16 recompute=selected");
  auto half = Apply(R"(methods { name: "half" dtype: "bf16" } methods { name: "fsdp" }
                       methods { name: "checkpoint" activation_checkpoint_ratio: 0.3 })", 2);
  ASSERT_TRUE(half.ok()) << half.status();
  EXPECT_EQ(half->precision, "pure_bf16");
  EXPECT_EQ(half->zero_stage, 3);
  EXPECT_EQ(half->activation_checkpointing, "stage_aware");
}

TEST(StrategyTest, APlanRoundTripsThroughItsStrategy) {
  ParallelPlan plan;
  plan.dp = 2;
  plan.tp = 2;
  plan.pp = 2;
  plan.sequence_parallel = true;
  plan.zero_stage = 1;
  plan.precision = "bf16";
  plan.schedule = "interleaved_1f1b";
  plan.virtual_stages = 2;
  plan.num_micro_batches = 4;
  plan.activation_checkpointing = "full";
  ParallelPlan again;
  again.num_micro_batches = 1;
  ASSERT_TRUE(ApplyStrategy(StrategyFromPlan(plan), 8, &again).ok());
  EXPECT_EQ(DescribePlan(again), DescribePlan(plan));
  EXPECT_EQ(DescribePlan(plan), "dp2 x tp2 x pp2 interleaved_1f1bx2 mb1x4 sp zero1 bf16 recompute=full");
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
                       methods { name: "fsdp" } methods { name: "pipeline_parallel" schedule: "zb_h1" })", 2),
              HasSubstr("fsdp with pipeline_parallel schedule zb_h1"));
  EXPECT_THAT(Error(R"(methods { name: "parallel_mode" parallel_mode { name: "tensor" size: 3 } })", 4),
              HasSubstr("tensor x pipeline = 3 x 1 does not divide the 4 ranks"));
  EXPECT_THAT(Error(R"(methods { name: "tensor_parallel" })", 2), HasSubstr("tensor_parallel needs tensor ranks"));
  EXPECT_THAT(Error(R"(methods { name: "fsdp" wrap: "h" })", 2), HasSubstr("fsdp's wrap"));
  EXPECT_THAT(Error(R"(methods { name: "amp_native" dtype: "fp8" })", 2), HasSubstr("choose bf16 or fp16"));
  // The plan's own checks follow: fp16 needs a GPU.
  EXPECT_THAT(Error(R"(methods { name: "amp_native" })", 2), HasSubstr("float16, which needs a GPU"));
}

}  // namespace
}  // namespace trident
