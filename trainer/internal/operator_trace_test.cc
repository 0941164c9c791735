#include "trainer/internal/operator_trace.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace trident {
namespace internal {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(OperatorTraceTest, RecordsTheOperatorsOfTheAnchoredScope) {
  ASSERT_TRUE(StartOperatorRecording(/*gpu_kernels=*/false).ok());
  EXPECT_FALSE(StartOperatorRecording(false).ok());  // one recording at a time
  {
    RECORD_USER_SCOPE("anchor");
    at::Tensor a = at::ones({64, 64});
    at::mm(a, a);
  }
  absl::StatusOr<std::vector<OperatorEvent>> events = StopOperatorRecording("anchor");
  ASSERT_TRUE(events.ok()) << events.status();
  auto mm = std::find_if(events->begin(), events->end(), [](const OperatorEvent& e) { return e.name == "aten::mm"; });
  ASSERT_NE(mm, events->end());
  EXPECT_GE(mm->start, 0);
  EXPECT_GE(mm->end, mm->start);
  EXPECT_EQ(mm->thread, 0);  // the anchor's thread is row 0
  EXPECT_FALSE(mm->on_gpu);
}

TEST(OperatorTraceTest, RecordsGpuKernelsOnTheirStreams) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  ASSERT_TRUE(StartOperatorRecording(/*gpu_kernels=*/true).ok());
  {
    RECORD_USER_SCOPE("anchor");
    at::Tensor a = at::ones({256, 256}, at::Device(at::kCUDA));
    at::mm(a, a);
  }
  absl::StatusOr<std::vector<OperatorEvent>> events = StopOperatorRecording("anchor");
  ASSERT_TRUE(events.ok()) << events.status();
  auto kernel = std::find_if(events->begin(), events->end(), [](const OperatorEvent& e) { return e.on_gpu; });
  ASSERT_NE(kernel, events->end()) << "no GPU kernel recorded";
  for (const OperatorEvent& e : *events) EXPECT_FALSE(e.on_gpu && e.name == "anchor") << "the scope is no kernel";
  EXPECT_NE(kernel->thread, 0);
  EXPECT_GT(kernel->end, kernel->start);
  EXPECT_THAT(OperatorBreakdown(*events, 5), HasSubstr("GPU busy"));
}

TEST(OperatorTraceTest, StoppingWithoutTheAnchorIsAnError) {
  ASSERT_TRUE(StartOperatorRecording(false).ok());
  at::ones({2});
  absl::StatusOr<std::vector<OperatorEvent>> events = StopOperatorRecording("never ran");
  EXPECT_FALSE(events.ok());
  EXPECT_THAT(std::string(events.status().message()), HasSubstr("never ran"));
}

TEST(OperatorTraceTest, BreakdownCountsSelfTimeWithoutCallees) {
  // "outer" runs 10 ms, of which its callee "inner" 6 ms.
  const std::vector<OperatorEvent> events = {{"outer", 0.000, 0.010, 0}, {"inner", 0.002, 0.008, 0}};
  const std::string table = OperatorBreakdown(events, 5);
  EXPECT_THAT(table, HasSubstr("operator (self time)"));
  EXPECT_THAT(table, testing::ContainsRegex("inner +6.00 +1 +60.0%"));
  EXPECT_THAT(table, testing::ContainsRegex("outer +4.00 +1 +40.0%"));
  EXPECT_THAT(table, HasSubstr("step (main thread, first to last operator): 10.00 ms"));
  EXPECT_THAT(table, Not(HasSubstr("GPU busy")));
}

TEST(OperatorTraceTest, BreakdownOfAGpuStepTabulatesKernelsAndBusyTime) {
  // The CPU queues two kernels on one stream and one on another; busy time is
  // the union of their intervals: [1, 4] and [5, 6] ms = 4 ms of the 10 ms step.
  const std::vector<OperatorEvent> events = {{"aten::mm", 0.000, 0.010, 0},
                                             {"void at::native::gemm_kernel", 0.001, 0.003, 1, true},
                                             {"void at::native::gemm_kernel", 0.005, 0.006, 1, true},
                                             {"nccl_kernel", 0.002, 0.004, 2, true}};
  const std::string table = OperatorBreakdown(events, 5);
  EXPECT_THAT(table, HasSubstr("GPU kernel"));
  EXPECT_THAT(table, testing::ContainsRegex("\ngemm_kernel +3.00 +2 +30.0%"));  // LibTorch's prefixes dropped
  EXPECT_THAT(table, testing::ContainsRegex("nccl_kernel +2.00 +1 +20.0%"));
  EXPECT_THAT(table, Not(HasSubstr("aten::mm")));
  EXPECT_THAT(table, HasSubstr("GPU busy (any kernel running): 4.00 ms, 40.0% of the step"));
}

TEST(OperatorTraceTest, TraceRowsNameThreadsAndGpuStreams) {
  const std::string json =
      OperatorTraceEvents({{"aten::mm", 0, 0.001, 0}, {"gemm_kernel", 0, 0.001, 1, true}}, 0, 1000, "rank 0");
  EXPECT_THAT(json, HasSubstr("\"tid\":1000,\"ts\":0.000,\"dur\":1000.000"));
  EXPECT_THAT(json, HasSubstr("\"name\":\"rank 0 thread 0\""));
  EXPECT_THAT(json, HasSubstr("\"name\":\"rank 0 gpu stream 1\""));
}

}  // namespace
}  // namespace internal
}  // namespace trident
