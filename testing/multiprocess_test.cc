#include "testing/multiprocess.h"

#include <cstdlib>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace trident {
namespace testing {
namespace {

using ::testing::HasSubstr;

TEST(MultiProcessTest, EachRankRunsTheBodyWithItsOwnRank) {
  MultiProcessResult result = SpawnRanks(3, [](int rank) {
    EXPECT_TRUE(IsRankProcess());
    EXPECT_EQ(std::atoi(std::getenv("RANK")), rank);
    EXPECT_EQ(std::atoi(std::getenv("WORLD_SIZE")), 3);
    std::printf("body ran on rank %d\n", rank);
  });
  EXPECT_FALSE(IsRankProcess());
  ASSERT_TRUE(result.status.ok()) << result.status;
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_EQ(result.ranks[rank].exit_code, 0);
    EXPECT_THAT(result.ranks[rank].output, HasSubstr("body ran on rank " + std::to_string(rank)));
  }
}

TEST(MultiProcessTest, AFailedExpectationInOneRankFailsThatRankWithItsMessage) {
  MultiProcessResult result = SpawnRanks(2, [](int rank) { EXPECT_NE(rank, 1) << "rank one objects"; });
  EXPECT_FALSE(result.status.ok());
  EXPECT_EQ(result.ranks[0].exit_code, 0);
  EXPECT_EQ(result.ranks[1].exit_code, 1);
  EXPECT_THAT(result.ranks[1].output, HasSubstr("rank one objects"));
}

TEST(MultiProcessTest, SeveralRunsInOneTestEachRunTheirOwnBody) {
  MultiProcessResult first = SpawnRanks(2, [](int) { std::printf("first body\n"); });
  MultiProcessResult second = SpawnRanks(3, [](int) { std::printf("second body\n"); });
  ASSERT_TRUE(first.status.ok() && second.status.ok());
  EXPECT_THAT(first.ranks[1].output, HasSubstr("first body"));
  EXPECT_THAT(first.ranks[1].output, ::testing::Not(HasSubstr("second body")));
  EXPECT_EQ(second.ranks.size(), 3u);
  EXPECT_THAT(second.ranks[2].output, HasSubstr("second body"));
}

TEST(MultiProcessTest, ExceptionsAndHangsBecomeFailuresNotHangs) {
  MultiProcessOptions options;
  // Long enough for rank 0 to start and throw on a loaded machine (at 3 s a
  // busy CI host stopped it before it threw), far short of rank 1's hang.
  options.timeout = absl::Seconds(20);
  MultiProcessResult result = SpawnRanks(
      2,
      [](int rank) {
        if (rank == 0) throw std::runtime_error("boom");
        absl::SleepFor(absl::Seconds(600));
      },
      options);
  EXPECT_EQ(result.ranks[0].exit_code, 1);
  EXPECT_THAT(result.ranks[0].output, HasSubstr("rank 0 threw: boom"));
  EXPECT_TRUE(result.ranks[1].stopped_by_harness);
}

}  // namespace
}  // namespace testing
}  // namespace trident
