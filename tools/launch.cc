// Starts the local ranks of a distributed job:
//
//   launch --nproc_per_node=4 -- bazel-bin/trainer/train --model=gpt
//   launch --nproc_per_node=8 --nnodes=2 --node_rank=0 --master_addr=node0 --master_port=29500 -- PROGRAM ARGS...
//
// Exits 0 when every rank exits 0; otherwise stops the other ranks within
// seconds and exits 1 with a line naming the rank that failed.
#include <gflags/gflags.h>

#include <vector>

#include "absl/strings/str_cat.h"
#include "base/flags_help.h"
#include "base/status.h"
#include "topology/topology.h"

DEFINE_int32(nproc_per_node, 1, "ranks to start on this node");
DEFINE_int32(nnodes, 1, "nodes in the job");
DEFINE_int32(node_rank, 0, "index of this node, 0 <= node_rank < nnodes");
DEFINE_string(master_addr, "127.0.0.1", "host of global rank 0 (the rendezvous store)");
DEFINE_int32(master_port, 0, "rendezvous port; 0 picks a free one (single node only)");
DEFINE_int32(max_restarts, 0, "times the local group is restarted after a rank fails");
DEFINE_double(failure_grace_s, 3, "seconds the other ranks get to exit after one fails");

int main(int argc, char** argv) {
  gflags::SetUsageMessage(
      "launch [flags] -- PROGRAM ARGS...\nStarts --nproc_per_node ranks of PROGRAM with RANK, "
      "WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set.");
  if (trident::HelpRequested(argc, argv)) return trident::PrintHelp(__FILE__);
  gflags::ParseCommandLineFlags(&argc, &argv, /*remove_flags=*/true);
  trident::LaunchOptions options;
  options.nproc_per_node = FLAGS_nproc_per_node;
  options.nnodes = FLAGS_nnodes;
  options.node_rank = FLAGS_node_rank;
  options.master_addr = FLAGS_master_addr;
  options.master_port = FLAGS_master_port;
  options.max_restarts = FLAGS_max_restarts;
  options.failure_grace = absl::Seconds(FLAGS_failure_grace_s);
  for (int i = 1; i < argc; ++i) options.command.push_back(argv[i]);
  return trident::ExitCodeFor("launch", trident::RunLocalGroup(options).status);
}
