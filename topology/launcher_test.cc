#include "topology/launcher.h"

#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <map>
#include <string>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace trident {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

// The helper program, from Bazel's runfiles or beside this test (CMake).
std::string RankProgram() {
  if (const char* srcdir = std::getenv("TEST_SRCDIR")) {
    return absl::StrCat(srcdir, "/trident/topology/launcher_test_rank");
  }
  std::string self(4096, '\0');
  self.resize(readlink("/proc/self/exe", self.data(), self.size()));
  return self.substr(0, self.rfind('/')) + "/launcher_test_rank";
}

struct Captured {
  std::map<int, std::string> out;
  std::map<int, std::string> err;
};

LaunchOptions Options(int nproc, std::vector<std::string> args, Captured* captured) {
  LaunchOptions options;
  options.nproc_per_node = nproc;
  options.command = {RankProgram()};
  options.command.insert(options.command.end(), args.begin(), args.end());
  options.on_output = [captured](int rank, bool is_stderr, absl::string_view line) {
    absl::StrAppend(is_stderr ? &captured->err[rank] : &captured->out[rank], line, "\n");
  };
  return options;
}

TEST(LauncherTest, GivesEachRankItsEnvironmentAndCapturesItsLines) {
  Captured captured;
  LaunchOptions options = Options(3, {"print"}, &captured);
  options.master_port = 23456;
  LaunchResult result = RunLocalGroup(options);
  ASSERT_TRUE(result.status.ok()) << result.status;
  ASSERT_EQ(result.exits.size(), 3u);
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_EQ(captured.out[rank], absl::StrCat("rank=", rank, " world=3 local=", rank,
                                               " local_world=3 addr=127.0.0.1 port=23456 restart=0\n"
                                               "no newline at the end\n"));
    EXPECT_EQ(captured.err[rank], absl::StrCat("stderr line of rank ", rank, "\n"));
    EXPECT_EQ(result.exits[rank].exit_code, 0);
  }
}

TEST(LauncherTest, SecondNodeNumbersItsRanksAfterTheFirst) {
  Captured captured;
  LaunchOptions options = Options(2, {"print"}, &captured);
  options.nnodes = 2;
  options.node_rank = 1;
  options.master_port = 23457;
  LaunchResult result = RunLocalGroup(options);
  ASSERT_TRUE(result.status.ok()) << result.status;
  EXPECT_THAT(captured.out[2], StartsWith("rank=2 world=4 local=0 local_world=2"));
  EXPECT_THAT(captured.out[3], StartsWith("rank=3 world=4 local=1 local_world=2"));
}

TEST(LauncherTest, OneFailingRankStopsTheOthersWithinSeconds) {
  Captured captured;
  LaunchOptions options = Options(4, {"fail", "2", "7"}, &captured);
  options.failure_grace = absl::Milliseconds(500);
  const absl::Time start = absl::Now();
  LaunchResult result = RunLocalGroup(options);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  ASSERT_FALSE(result.status.ok());
  EXPECT_THAT(std::string(result.status.message()), HasSubstr("rank 2 exited with code 7; stopped rank(s) 0, 1, 3"));
  EXPECT_EQ(result.exits[2].exit_code, 7);
  EXPECT_FALSE(result.exits[2].stopped_by_launcher);
  for (int rank : {0, 1, 3}) {
    EXPECT_TRUE(result.exits[rank].stopped_by_launcher);
    EXPECT_EQ(result.exits[rank].signal, SIGTERM);
  }
}

TEST(LauncherTest, RestartsTheWholeGroupAfterAFailure) {
  Captured captured;
  LaunchOptions options = Options(2, {"fail_first_attempt"}, &captured);
  options.max_restarts = 2;
  options.failure_grace = absl::Milliseconds(200);
  LaunchResult result = RunLocalGroup(options);
  ASSERT_TRUE(result.status.ok()) << result.status;
  EXPECT_EQ(result.restarts, 1);
  EXPECT_THAT(captured.out[0], HasSubstr("attempt 1 ok"));
  EXPECT_THAT(captured.out[1], HasSubstr("attempt 1 ok"));
}

TEST(LauncherTest, GivesUpAfterMaxRestarts) {
  Captured captured;
  LaunchOptions options = Options(2, {"fail", "0", "3"}, &captured);
  options.max_restarts = 1;
  options.failure_grace = absl::Milliseconds(200);
  LaunchResult result = RunLocalGroup(options);
  ASSERT_FALSE(result.status.ok());
  EXPECT_EQ(result.restarts, 1);
  EXPECT_THAT(std::string(result.status.message()), HasSubstr("rank 0 exited with code 3"));
  EXPECT_THAT(std::string(result.status.message()), HasSubstr("after 1 restart(s)"));
}

TEST(LauncherTest, ForwardsSigtermToTheRanks) {
  Captured captured;
  LaunchOptions options = Options(2, {"sleep"}, &captured);
  options.max_restarts = 3;  // a signal must not trigger a restart
  std::thread interrupter([] {
    absl::SleepFor(absl::Milliseconds(700));
    kill(getpid(), SIGTERM);
  });
  const absl::Time start = absl::Now();
  LaunchResult result = RunLocalGroup(options);
  interrupter.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_EQ(result.status.code(), absl::StatusCode::kCancelled) << result.status;
  EXPECT_EQ(result.restarts, 0);
  for (const RankExit& exit : result.exits) EXPECT_EQ(exit.signal, SIGTERM);
}

TEST(LauncherTest, TimeoutKillsEveryRank) {
  Captured captured;
  LaunchOptions options = Options(2, {"sleep"}, &captured);
  options.timeout = absl::Milliseconds(500);
  LaunchResult result = RunLocalGroup(options);
  EXPECT_EQ(result.status.code(), absl::StatusCode::kDeadlineExceeded) << result.status;
  EXPECT_THAT(std::string(result.status.message()), HasSubstr("timed out after 500ms"));
}

TEST(LauncherTest, BadOptionsAreRejectedBeforeAnythingStarts) {
  LaunchOptions options;
  EXPECT_THAT(std::string(RunLocalGroup(options).status.message()), HasSubstr("no program to launch"));
  options.command = {"true"};
  options.nproc_per_node = 0;
  EXPECT_THAT(std::string(RunLocalGroup(options).status.message()), HasSubstr("--nproc_per_node=0 must be at least 1"));
  options.nproc_per_node = 1;
  options.nnodes = 2;
  EXPECT_THAT(std::string(RunLocalGroup(options).status.message()), HasSubstr("--master_port is required"));
}

TEST(LauncherTest, MissingProgramIsReportedByItsRank) {
  Captured captured;
  LaunchOptions options = Options(1, {}, &captured);
  options.command = {"/nonexistent/program"};
  LaunchResult result = RunLocalGroup(options);
  EXPECT_THAT(std::string(result.status.message()), HasSubstr("rank 0 exited with code 127"));
  EXPECT_THAT(captured.err[0], HasSubstr("cannot execute /nonexistent/program"));
}

}  // namespace
}  // namespace trident
