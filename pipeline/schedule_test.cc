#include <algorithm>
#include <map>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "pipeline/pipeline.h"

namespace trident {
namespace {

using ::testing::HasSubstr;

struct Shape {
  std::string schedule;
  int stages;
  int micro_batches;
};

class EveryScheduleTest : public ::testing::TestWithParam<Shape> {};

// Each stage runs every micro-batch's forward and then its backward exactly
// once, and the stages together neither deadlock nor leave messages behind.
TEST_P(EveryScheduleTest, RunsEveryMicroBatchOnceWithoutDeadlock) {
  const Shape shape = GetParam();
  auto schedule = MakeSchedule(shape.schedule);
  ASSERT_TRUE(schedule.ok());
  for (int s = 0; s < shape.stages; ++s) {
    std::map<int, int> forward_at, backward_at;
    const auto program = (*schedule)->Instructions(s, shape.stages, shape.micro_batches);
    for (size_t i = 0; i < program.size(); ++i) {
      if (program[i].op == Op::kForward) EXPECT_TRUE(forward_at.emplace(program[i].micro_batch, i).second);
      if (program[i].op == Op::kBackward) EXPECT_TRUE(backward_at.emplace(program[i].micro_batch, i).second);
    }
    ASSERT_EQ(static_cast<int>(forward_at.size()), shape.micro_batches) << "stage " << s;
    ASSERT_EQ(static_cast<int>(backward_at.size()), shape.micro_batches) << "stage " << s;
    for (const auto& [m, at] : backward_at) EXPECT_LT(forward_at[m], at);
    EXPECT_EQ(program.back().op, Op::kOptimizerStep);
  }
  SimulationOptions options;
  options.num_stages = shape.stages;
  options.num_micro_batches = shape.micro_batches;
  options.comm_seconds = 0.1;
  auto result = Simulate(**schedule, options);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_GT(result->makespan, 0);
}

std::vector<Shape> Shapes() {
  std::vector<Shape> shapes;
  for (const std::string& schedule : ScheduleNames()) {
    for (int stages = 1; stages <= 4; ++stages) {
      for (int micro = 1; micro <= 8; ++micro) shapes.push_back({schedule, stages, micro});
    }
  }
  return shapes;
}

INSTANTIATE_TEST_SUITE_P(AllShapes, EveryScheduleTest, ::testing::ValuesIn(Shapes()),
                         [](const auto& info) {
                           std::string name = info.param.schedule;
                           for (char& ch : name) {
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           }
                           return "s" + name + "_" + std::to_string(info.param.stages) + "x" +
                                  std::to_string(info.param.micro_batches);
                         });

TEST(SimulatorTest, OneFOneBBubbleIsStagesMinusOneOverMicroBatchesPlusStagesMinusOne) {
  auto schedule = MakeSchedule("1f1b");
  for (int stages : {2, 4}) {
    for (int micro : {4, 8, 16}) {
      SimulationOptions options;
      options.num_stages = stages;
      options.num_micro_batches = micro;
      auto result = Simulate(**schedule, options);
      ASSERT_TRUE(result.ok()) << result.status();
      EXPECT_NEAR(result->bubble_fraction, double(stages - 1) / (micro + stages - 1), 1e-12)
          << stages << " stages, " << micro << " micro-batches";
      EXPECT_NEAR(result->makespan, (micro + stages - 1) * 3.0, 1e-12);
    }
  }
}

// 1F1B keeps at most min(M, S - s) micro-batches' activations alive on stage s
// (0-based); GPipe keeps all M.
TEST(ScheduleMemoryTest, OneFOneBBoundsLiveActivations) {
  const int stages = 4, micro = 8;
  for (const char* name : {"1f1b", "gpipe"}) {
    auto schedule = MakeSchedule(name);
    for (int s = 0; s < stages; ++s) {
      int live = 0, peak = 0;
      for (const Instruction& inst : (*schedule)->Instructions(s, stages, micro)) {
        if (inst.op == Op::kForward) peak = std::max(peak, ++live);
        if (inst.op == Op::kBackward) --live;
      }
      EXPECT_EQ(peak, std::string(name) == "1f1b" ? std::min(micro, stages - s) : micro)
          << name << " stage " << s;
    }
  }
}

TEST(ScheduleTest, OneFOneBFusesSendsWithTheNextReceive) {
  auto schedule = MakeSchedule("1f1b");
  const auto program = (*schedule)->Instructions(1, 3, 4);
  std::vector<std::string> ops;
  for (const Instruction& inst : program) {
    ops.push_back(std::string(OpName(inst.op)) + " " + std::to_string(inst.micro_batch) +
                  (inst.other >= 0 ? "/" + std::to_string(inst.other) : ""));
  }
  EXPECT_EQ(ops, (std::vector<std::string>{
                     "recv_activation 0", "forward 0", "send_activation 0",
                     "recv_activation 1", "forward 1", "send_activation_recv_grad 1/0",
                     "backward 0", "send_grad_recv_activation 0/2",
                     "forward 2", "send_activation_recv_grad 2/1", "backward 1",
                     "send_grad_recv_activation 1/3", "forward 3",
                     "send_activation_recv_grad 3/2", "backward 2", "send_grad 2",
                     "recv_grad 3", "backward 3", "send_grad 3",
                     "reduce_tied_grads -1", "reduce_data_parallel_grads -1",
                     "optimizer_step -1"}));
}

TEST(TimelineTest, ChromeTraceAndSvgShowEveryStage) {
  auto schedule = MakeSchedule("1f1b");
  SimulationOptions options;
  options.num_stages = 3;
  options.num_micro_batches = 4;
  auto result = Simulate(**schedule, options);
  ASSERT_TRUE(result.ok());
  const std::string json = ChromeTraceJson(result->events);
  EXPECT_THAT(json, HasSubstr("\"traceEvents\""));
  EXPECT_THAT(json, HasSubstr("\"name\":\"backward 3\""));
  EXPECT_THAT(json, HasSubstr("\"tid\":2"));
  const std::string svg = TimelineSvg(result->events, "1f1b");
  EXPECT_THAT(svg, HasSubstr("<svg"));
  EXPECT_THAT(svg, HasSubstr("stage 2</text>"));
  EXPECT_THAT(svg, HasSubstr("<title>forward 3</title>"));
}

TEST(ScheduleTest, UnknownNamesAndEmptyShapesAreClearErrors) {
  EXPECT_THAT(std::string(MakeSchedule("zigzag").status().message()),
              HasSubstr("unknown schedule 'zigzag'; choose gpipe, 1f1b, last_no_recompute_1f1b, "
                        "pre_recompute_1f1b"));
  auto schedule = MakeSchedule("gpipe");
  SimulationOptions options;
  options.num_micro_batches = 0;
  EXPECT_THAT(std::string(Simulate(**schedule, options).status().message()),
              HasSubstr("needs at least one stage and one micro-batch"));
  options.num_micro_batches = 2;
  options.forward_seconds = {1, 2, 3};
  EXPECT_THAT(std::string(Simulate(**schedule, options).status().message()),
              HasSubstr("forward_seconds has 3 values"));
}

}  // namespace
}  // namespace trident
