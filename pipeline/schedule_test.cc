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
  int chunks = 1;
};

bool IsBackward(Op op) { return op == Op::kBackward || op == Op::kBackwardInput; }

class EveryScheduleTest : public ::testing::TestWithParam<Shape> {};

// Each stage runs every micro-batch's forward and then its backward exactly
// once per chunk (and, where backward is split, its weight gradient once after
// its input gradient), and the stages together neither deadlock nor leave
// messages behind. Shapes a schedule refuses are refused by the simulator too.
TEST_P(EveryScheduleTest, RunsEveryMicroBatchOnceWithoutDeadlock) {
  const Shape shape = GetParam();
  auto schedule = MakeSchedule(shape.schedule, shape.chunks);
  ASSERT_TRUE(schedule.ok());
  SimulationOptions options;
  options.num_stages = shape.stages;
  options.num_micro_batches = shape.micro_batches;
  options.comm_seconds = 0.1;
  const absl::Status check = (*schedule)->Check(shape.stages, shape.micro_batches);
  if (!check.ok()) {
    EXPECT_EQ(Simulate(**schedule, options).status(), check);
    EXPECT_TRUE((shape.schedule == "shifted_critical_path" && shape.micro_batches < 4) ||
                (shape.schedule == "interleaved_1f1b" && shape.micro_batches % shape.stages != 0))
        << check;
    return;
  }
  for (int s = 0; s < shape.stages; ++s) {
    std::map<std::pair<int, int>, int> forward_at, backward_at, weight_at;
    const auto program = (*schedule)->Instructions(s, shape.stages, shape.micro_batches);
    for (size_t i = 0; i < program.size(); ++i) {
      const std::pair<int, int> key{program[i].chunk, program[i].micro_batch};
      if (program[i].op == Op::kForward) {
        EXPECT_TRUE(forward_at.emplace(key, i).second);
      }
      if (IsBackward(program[i].op)) {
        EXPECT_TRUE(backward_at.emplace(key, i).second);
      }
      if (program[i].op == Op::kBackwardWeight) {
        EXPECT_TRUE(weight_at.emplace(key, i).second);
      }
    }
    const int expected = shape.micro_batches * shape.chunks;
    ASSERT_EQ(static_cast<int>(forward_at.size()), expected) << "stage " << s;
    ASSERT_EQ(static_cast<int>(backward_at.size()), expected) << "stage " << s;
    for (const auto& [key, at] : backward_at) EXPECT_LT(forward_at[key], at);
    if (shape.schedule == "zb_h1") {
      ASSERT_EQ(static_cast<int>(weight_at.size()), expected) << "stage " << s;
      for (const auto& [key, at] : weight_at) EXPECT_LT(backward_at[key], at);
    } else {
      EXPECT_TRUE(weight_at.empty());
    }
    EXPECT_EQ(program.back().op, Op::kOptimizerStep);
  }
  auto result = Simulate(**schedule, options);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_GT(result->makespan, 0);
}

std::vector<Shape> Shapes() {
  std::vector<Shape> shapes;
  for (const std::string& schedule : ScheduleNames()) {
    for (int stages = 1; stages <= 4; ++stages) {
      for (int micro = 1; micro <= 8; ++micro) {
        if (schedule != "interleaved_1f1b") {
          shapes.push_back({schedule, stages, micro});
          continue;
        }
        for (int chunks : {2, 3}) shapes.push_back({schedule, stages, micro, chunks});
      }
    }
  }
  return shapes;
}

INSTANTIATE_TEST_SUITE_P(AllShapes, EveryScheduleTest, ::testing::ValuesIn(Shapes()), [](const auto& info) {
  std::string name = info.param.schedule;
  for (char& ch : name) {
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  }
  return "s" + name + "_" + std::to_string(info.param.stages) + "x" + std::to_string(info.param.micro_batches) + "x" +
         std::to_string(info.param.chunks);
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

// A replayed timeline sets each instruction's duration: the simulation's own
// events give its makespan back; one slower forward on the last stage (busy
// from its first forward to its last backward under 1F1B) delays the end by
// its extra second; events that match no instruction change nothing.
TEST(SimulatorTest, ReplayedTimesReplaceThePerStageTimes) {
  auto schedule = MakeSchedule("1f1b");
  SimulationOptions options;
  options.num_stages = 2;
  options.num_micro_batches = 4;
  auto base = Simulate(**schedule, options);
  ASSERT_TRUE(base.ok()) << base.status();
  ASSERT_NEAR(base->makespan, 15.0, 1e-12);
  options.replay = base->events;
  auto replayed = Simulate(**schedule, options);
  ASSERT_TRUE(replayed.ok()) << replayed.status();
  EXPECT_NEAR(replayed->makespan, 15.0, 1e-12);
  options.replay = {{1, Op::kForward, 2, 0, 0.0, 2.0}, {1, Op::kForward, 9, 0, 0.0, 50.0}};
  auto slower = Simulate(**schedule, options);
  ASSERT_TRUE(slower.ok()) << slower.status();
  EXPECT_NEAR(slower->makespan, 16.0, 1e-12);
}

// 1F1B keeps at most min(M, S - s) micro-batches' activations alive on stage s
// (0-based); GPipe keeps all M.
TEST(ScheduleMemoryTest, OneFOneBBoundsLiveActivations) {
  const int stages = 4, micro = 8;
  for (const std::string name : {"1f1b", "zb_h1", "gpipe", "shifted_critical_path"}) {
    auto schedule = MakeSchedule(name);
    for (int s = 0; s < stages; ++s) {
      int live = 0, peak = 0;
      for (const Instruction& inst : (*schedule)->Instructions(s, stages, micro)) {
        if (inst.op == Op::kForward) peak = std::max(peak, ++live);
        if (IsBackward(inst.op)) --live;
      }
      // The shifted schedule holds one more on the stages before the last.
      const int expected = name == "gpipe"                                     ? micro
                           : name == "shifted_critical_path" && s < stages - 1 ? std::min(micro, stages - s + 1)
                                                                               : std::min(micro, stages - s);
      EXPECT_EQ(peak, expected) << name << " stage " << s;
      // Until its weight gradient runs, a micro-batch holds (part of) its
      // activations: ZB-H1 still never holds more than 1F1B's largest count, S.
      if (name == "zb_h1") {
        int held = 0, most = 0;
        for (const Instruction& inst : (*schedule)->Instructions(s, stages, micro)) {
          if (inst.op == Op::kForward) most = std::max(most, ++held);
          if (inst.op == Op::kBackwardWeight) --held;
        }
        EXPECT_LE(most, stages) << "stage " << s;
      }
    }
  }
}

// Simulated with F = 1, B = 2 (W = 1 of it), no communication time.
double Makespan(const std::string& name, int stages, int micro, int chunks = 1) {
  auto schedule = MakeSchedule(name, chunks);
  SimulationOptions options;
  options.num_stages = stages;
  options.num_micro_batches = micro;
  auto result = Simulate(**schedule, options);
  EXPECT_TRUE(result.ok()) << result.status();
  return result.ok() ? result->makespan : 0;
}

// Interleaving C chunks divides 1F1B's bubble by C: (S - 1)(F + B) / C.
TEST(SimulatorTest, InterleavingDividesTheBubbleByTheChunks) {
  for (int stages : {2, 4}) {
    for (int chunks : {2, 4}) {
      const int micro = 2 * stages;
      EXPECT_NEAR(Makespan("interleaved_1f1b", stages, micro, chunks), micro * 3.0 + (stages - 1) * 3.0 / chunks, 1e-9)
          << stages << " stages, " << chunks << " chunks";
    }
  }
}

// ZB-H1 shrinks 1F1B's bubble from (S - 1)(F + B) to (S - 1)(F + B_input - W)
// (the zero-bubble paper's H1 figure).
TEST(SimulatorTest, ZeroBubbleH1ShrinksTheBubbleByTheWeightGradients) {
  for (int stages : {2, 4}) {
    for (int micro : {4, 8, 16}) {
      EXPECT_NEAR(Makespan("zb_h1", stages, micro), micro * 3.0 + (stages - 1) * 1.0, 1e-9)
          << stages << " stages, " << micro << " micro-batches";
    }
  }
}

// With recomputation, the shifted critical path finishes before both schedules
// it combines, with and without message latency.
TEST(SimulatorTest, ShiftedCriticalPathBeatsPreRecomputeAndLastNoRecompute) {
  for (int stages : {2, 4}) {
    for (double comm : {0.0, 0.3}) {
      SimulationOptions options;
      options.num_stages = stages;
      options.num_micro_batches = 8;
      options.recompute_seconds = {1.0};
      options.comm_seconds = comm;
      auto shifted = Simulate(**MakeSchedule("shifted_critical_path"), options);
      ASSERT_TRUE(shifted.ok());
      for (const char* other : {"pre_recompute_1f1b", "last_no_recompute_1f1b"}) {
        auto result = Simulate(**MakeSchedule(other), options);
        ASSERT_TRUE(result.ok());
        EXPECT_LT(shifted->makespan, result->makespan) << other << ", " << stages << " stages, comm " << comm;
      }
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
  EXPECT_EQ(ops, (std::vector<std::string>{"recv_activation 0",
                                           "forward 0",
                                           "send_activation 0",
                                           "recv_activation 1",
                                           "forward 1",
                                           "send_activation_recv_grad 1/0",
                                           "backward 0",
                                           "send_grad_recv_activation 0/2",
                                           "forward 2",
                                           "send_activation_recv_grad 2/1",
                                           "backward 1",
                                           "send_grad_recv_activation 1/3",
                                           "forward 3",
                                           "send_activation_recv_grad 3/2",
                                           "backward 2",
                                           "send_grad 2",
                                           "recv_grad 3",
                                           "backward 3",
                                           "send_grad 3",
                                           "reduce_tied_grads -1",
                                           "reduce_data_parallel_grads -1",
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
              HasSubstr("unknown schedule 'zigzag'; choose 1f1b, gpipe, interleaved_1f1b, "
                        "last_no_recompute_1f1b, pre_recompute_1f1b, shifted_critical_path, zb_h1"));
  EXPECT_THAT(std::string(MakeSchedule("1f1b", 2).status().message()),
              HasSubstr("virtual_stages = 2 needs schedule interleaved_1f1b"));
  EXPECT_THAT(std::string((*MakeSchedule("interleaved_1f1b", 1))->Check(2, 4).message()),
              HasSubstr("needs virtual_stages >= 2"));
  EXPECT_THAT(std::string((*MakeSchedule("interleaved_1f1b", 2))->Check(4, 6).message()),
              HasSubstr("micro-batches per step (6) to be a multiple of the pipeline stages (4)"));
  EXPECT_THAT(std::string((*MakeSchedule("shifted_critical_path"))->Check(2, 3).message()),
              HasSubstr("needs at least 4 micro-batches per step; got 3"));
  auto schedule = MakeSchedule("gpipe");
  SimulationOptions options;
  options.num_micro_batches = 0;
  EXPECT_THAT(std::string(Simulate(**schedule, options).status().message()),
              HasSubstr("needs at least one stage and one micro-batch"));
  options.num_micro_batches = 2;
  options.forward_seconds = {1, 2, 3};
  EXPECT_THAT(std::string(Simulate(**schedule, options).status().message()), HasSubstr("forward_seconds has 3 values"));
}

}  // namespace
}  // namespace trident
