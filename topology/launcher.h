// The local launcher: starts the ranks of one node as child processes, the way
// `tools/launch` and a `train` started without RANK do.
//
//   LaunchOptions options;
//   options.nproc_per_node = 4;
//   options.command = {"/path/to/program", "--flag"};
//   LaunchResult result = RunLocalGroup(options);
//   if (!result.status.ok()) std::cerr << result.status.message();
//
// Each child gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
// MASTER_ADDR, MASTER_PORT, TRIDENT_RESTART_COUNT (and OMP_NUM_THREADS and
// OPENBLAS_NUM_THREADS when unset, so the ranks share the cores). Every output line is prefixed with the
// rank. When a rank fails, the others get `failure_grace` to end on their own,
// then SIGTERM, then SIGKILL after `kill_grace`; children also die with the
// launcher (PR_SET_PDEATHSIG), so nothing is left behind.
#ifndef TRIDENT_TOPOLOGY_LAUNCHER_H_
#define TRIDENT_TOPOLOGY_LAUNCHER_H_

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace trident {

struct LaunchOptions {
  int nproc_per_node = 1;                           // ranks started on this node
  int nnodes = 1;                                   // nodes in the job
  int node_rank = 0;                                // this node's index; its ranks are node_rank * nproc_per_node + i
  std::string master_addr = "127.0.0.1";            // host of global rank 0
  int master_port = 0;                              // 0: a free local port (only with nnodes == 1)
  int max_restarts = 0;                             // times the whole local group is restarted after a failure
  std::vector<std::string> command;                 // program and its arguments
  std::map<std::string, std::string> env;           // extra environment for every rank
  absl::Duration failure_grace = absl::Seconds(3);  // others' time to exit after a failure
  absl::Duration kill_grace = absl::Seconds(5);     // SIGTERM to SIGKILL
  // After a SIGINT or SIGTERM forwarded to the ranks, their time to finish
  // (a rank may save a checkpoint) before SIGKILL. Ranks that all exit 0
  // then make the attempt a success.
  absl::Duration signal_grace = absl::Seconds(5);
  absl::Duration timeout = absl::InfiniteDuration();  // limit for one attempt
  // Receives each output line (without '\n'; a line ended by '\r' keeps it) of a
  // local rank; stderr lines have `is_stderr` set. Default: "[rank R] line" on
  // this process's stdout/stderr.
  std::function<void(int rank, bool is_stderr, absl::string_view line)> on_output;
};

// How a rank's process ended.
struct RankExit {
  int rank = -1;                     // global rank
  int exit_code = -1;                // exit status, or -1 when killed by a signal
  int signal = 0;                    // terminating signal, 0 when it exited
  bool stopped_by_launcher = false;  // killed because another rank failed, a signal or the timeout
};

struct LaunchResult {
  // OK when every rank exited 0; otherwise names the first rank that failed and how.
  absl::Status status;
  std::vector<RankExit> exits;  // of the last attempt, by local rank
  int restarts = 0;             // restarts performed
};

// Runs the local ranks to completion (with up to max_restarts restarts).
// SIGINT and SIGTERM received meanwhile are forwarded to the ranks.
LaunchResult RunLocalGroup(const LaunchOptions& options);

// For binaries that start their own local job: when this process was not started
// by a launcher (no RANK, OMPI_COMM_WORLD_RANK or SLURM_PROCID), runs `nproc`
// copies of this program with the same arguments as a local job and returns its
// status; returns nullopt when this process already is a rank of a job.
// `options` give the rest (restarts, grace periods).
std::optional<absl::Status> RunAsLocalJobUnlessLaunched(int nproc, int argc, char** argv, LaunchOptions options = {});
// How many times the launcher restarted this rank's group (TRIDENT_RESTART_COUNT; 0 when unset).
int RestartCount();

// A TCP port on 127.0.0.1 that was free a moment ago.
int PickFreePort();

}  // namespace trident

#endif  // TRIDENT_TOPOLOGY_LAUNCHER_H_
