#include "testing/multiprocess.h"

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <mutex>

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace trident {
namespace testing {
namespace {

constexpr char kInvocationVar[] = "TRIDENT_TEST_INVOCATION";

// Which RunOnRanks/SpawnRanks call of the current test this is, counting from 0.
int NextInvocation() {
  static const ::testing::TestInfo* test = nullptr;
  static int count = 0;
  const ::testing::TestInfo* current = ::testing::UnitTest::GetInstance()->current_test_info();
  if (current != test) {
    test = current;
    count = 0;
  }
  return count++;
}

int ChildInvocation() {
  const char* value = std::getenv(kInvocationVar);
  int invocation = -1;
  if (value == nullptr || !absl::SimpleAtoi(value, &invocation)) return -1;
  return invocation;
}

// Runs the body in a rank process and exits.
[[noreturn]] void RunRank(const std::function<void(int rank)>& body) {
  const int rank = std::atoi(std::getenv("RANK"));
  try {
    body(rank);
  } catch (const std::exception& e) {
    ADD_FAILURE() << "rank " << rank << " threw: " << e.what();
  } catch (...) {
    ADD_FAILURE() << "rank " << rank << " threw an unknown exception";
  }
  const bool failed = ::testing::Test::HasFailure();
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(failed ? 1 : 0);
}

}  // namespace

bool IsRankProcess() { return ChildInvocation() >= 0; }

MultiProcessResult SpawnRanks(int world_size, const std::function<void(int rank)>& body,
                              const MultiProcessOptions& options) {
  const int invocation = NextInvocation();
  MultiProcessResult result;
  if (IsRankProcess()) {
    if (ChildInvocation() == invocation) RunRank(body);
    return result;  // an earlier invocation of this test, already run by its own ranks
  }
  const ::testing::TestInfo* test = ::testing::UnitTest::GetInstance()->current_test_info();
  LaunchOptions launch;
  launch.nproc_per_node = world_size;
  launch.command = {"/proc/self/exe", absl::StrCat("--gtest_filter=", test->test_suite_name(), ".", test->name()),
                    "--gtest_color=no"};
  launch.env = options.env;
  launch.env[kInvocationVar] = absl::StrCat(invocation);
  // Rank processes are plain runs of one test: no sharding, no Bazel exit-file bookkeeping.
  launch.env["GTEST_TOTAL_SHARDS"] = "1";
  launch.env["GTEST_SHARD_INDEX"] = "0";
  launch.env["TEST_PREMATURE_EXIT_FILE"] = "";
  launch.env["XML_OUTPUT_FILE"] = "";
  launch.failure_grace = options.failure_grace;
  launch.timeout = options.timeout;
  result.ranks.resize(world_size);
  std::mutex mutex;
  launch.on_output = [&](int rank, bool, absl::string_view line) {
    std::lock_guard<std::mutex> lock(mutex);
    absl::StrAppend(&result.ranks[rank].output, line, "\n");
  };
  LaunchResult launched;
  for (int attempt = 1;; ++attempt) {
    for (RankOutcome& outcome : result.ranks) outcome = RankOutcome();
    launched = RunLocalGroup(launch);
    // The launcher picks a free port for the rendezvous store and rank 0
    // binds it moments later; another test's process may take it in between.
    // That is not the code under test, so the ranks start again on a new port.
    const bool port_taken = absl::StrContains(result.ranks[0].output, "could not serve the rendezvous store") &&
                            absl::StrContains(result.ranks[0].output, "Address already in use");
    if (launched.status.ok() || !port_taken || attempt == 3) break;
  }
  result.status = launched.status;
  for (const RankExit& exit : launched.exits) {
    RankOutcome& outcome = result.ranks[exit.rank];
    outcome.rank = exit.rank;
    outcome.exit_code = exit.exit_code;
    outcome.signal = exit.signal;
    outcome.stopped_by_harness = exit.stopped_by_launcher;
  }
  return result;
}

void RunOnRanks(int world_size, const std::function<void(int rank)>& body, const MultiProcessOptions& options) {
  MultiProcessResult result = SpawnRanks(world_size, body, options);
  if (result.status.ok()) return;
  ADD_FAILURE() << "multi-process run on " << world_size << " ranks failed: " << result.status.message();
  for (const RankOutcome& outcome : result.ranks) {
    if (outcome.exit_code == 0) continue;
    ADD_FAILURE() << "rank " << outcome.rank
                  << (outcome.stopped_by_harness
                          ? " was stopped by the harness"
                          : absl::StrCat(" exited with code ", outcome.exit_code, " signal ", outcome.signal))
                  << "; its output:\n"
                  << outcome.output;
  }
}

absl::StatusOr<std::unique_ptr<Topology>> JoinTopology(std::vector<MeshAxis> mesh_axes) {
  TopologyOptions options;
  options.mesh_axes = std::move(mesh_axes);
  options.rendezvous_timeout = absl::Seconds(30);
  options.timeout = absl::Seconds(60);
  return JoinTopology(std::move(options));
}

absl::StatusOr<std::unique_ptr<Topology>> JoinTopology(TopologyOptions options) {
  if (options.backend == CommBackend::kAuto) options.backend = CommBackend::kGloo;
  return Topology::CreateFromEnvironment(std::move(options));
}

}  // namespace testing
}  // namespace trident
