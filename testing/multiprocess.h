// The multi-process test harness: runs a test body on W ranks, each a separate
// process (this test binary started again, running only the current test), so
// distributed behaviour is tested over real c10d process groups on loopback.
//
//   TEST(AllReduceTest, SumsOverRanks) {
//     testing::RunOnRanks(4, [](int rank) {
//       auto topology = testing::JoinTopology();
//       ASSERT_TRUE(topology.ok()) << topology.status();
//       at::Tensor t = at::full({2}, rank + 1.0);
//       ASSERT_TRUE((*topology)->world().AllReduce(t).ok());
//       EXPECT_EQ(t[0].item<float>(), 10.0f);
//     });
//   }
//
// In the test process RunOnRanks picks a free port, starts the ranks through the
// local launcher with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set, waits for
// them (killing all after `timeout`), and turns each failed rank into a test
// failure that carries the rank's output. In a rank process it runs `body` and
// exits: 0 when the body recorded no failure. A rank process runs the test from
// its start up to its own RunOnRanks call (earlier calls return at once there),
// so guard side effects between calls, such as deleting or corrupting files,
// with `if (!IsRankProcess())`.
#ifndef TRIDENT_TESTING_MULTIPROCESS_H_
#define TRIDENT_TESTING_MULTIPROCESS_H_

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "topology/topology.h"

namespace trident {
namespace testing {

struct MultiProcessOptions {
  absl::Duration timeout = absl::Seconds(120);       // for the whole run; then all ranks die
  absl::Duration failure_grace = absl::Seconds(30);  // after one rank fails, others' time to end
  std::map<std::string, std::string> env;            // extra environment for the ranks
};

// How one rank ended, with everything it printed.
struct RankOutcome {
  int rank = -1;
  int exit_code = -1;  // -1 when killed by a signal
  int signal = 0;
  bool stopped_by_harness = false;
  std::string output;  // stdout and stderr lines, in arrival order
};

struct MultiProcessResult {
  absl::Status status;             // OK when every rank exited 0
  std::vector<RankOutcome> ranks;  // by rank
};

// Runs `body(rank)` on `world_size` ranks and returns how each ended. Use it
// when ranks are expected to fail; otherwise use RunOnRanks.
MultiProcessResult SpawnRanks(int world_size, const std::function<void(int rank)>& body,
                              const MultiProcessOptions& options = {});

// SpawnRanks, plus a test failure for every rank that did not exit 0.
void RunOnRanks(int world_size, const std::function<void(int rank)>& body, const MultiProcessOptions& options = {});

// True inside a rank process started by the harness.
bool IsRankProcess();

// In a rank: joins the harness's job as a Topology on `mesh_axes` with test
// timeouts (30 s for rendezvous, 60 s for operations), or with `options`. The
// backend is Gloo unless `options.backend` names another.
absl::StatusOr<std::unique_ptr<Topology>> JoinTopology(std::vector<MeshAxis> mesh_axes = {});
absl::StatusOr<std::unique_ptr<Topology>> JoinTopology(TopologyOptions options);

}  // namespace testing
}  // namespace trident

#endif  // TRIDENT_TESTING_MULTIPROCESS_H_
