// The distributed engine at work, until the trainer lands: started plainly it
// launches --nproc ranks of itself; each joins a tensor=2 x data mesh and
// all-reduces its rank over the world, tensor and data groups, checks the sums
// against the group members, and prints them.
//
//   bazel run -c opt //tools:hello_world            # 4 local ranks
//   tools/launch --nproc_per_node=8 -- hello_world  # 8 ranks, tensor=2 x data=4
#include <gflags/gflags.h>

#include <cstdio>
#include <string>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/flags_help.h"
#include "base/status.h"
#include "topology/topology.h"

DEFINE_int32(nproc, 4, "local ranks to start when not run by a launcher");
DEFINE_int32(tp, 2, "size of the tensor axis; the data axis takes the rest");

namespace trident {
namespace {

absl::Status Run() {
  TopologyOptions options;
  options.mesh_axes = {{"tensor", FLAGS_tp}, {"data", DeviceMesh::kInferSize}};
  TRIDENT_ASSIGN_OR_RETURN(std::unique_ptr<Topology> topology, Topology::CreateFromEnvironment(options));
  std::string report = absl::StrCat("rank ", topology->rank(), ":");
  for (const char* name : {"world", "tp", "dp"}) {
    TRIDENT_ASSIGN_OR_RETURN(ProcessGroup * group, topology->Group(name));
    at::Tensor value = at::full({1}, static_cast<double>(topology->rank()), at::kDouble);
    TRIDENT_RETURN_IF_ERROR(group->AllReduce(value));
    double expected = 0;
    for (int member : group->global_ranks()) expected += member;
    if (value.item<double>() != expected) {
      return absl::InternalError(
          absl::StrCat("all-reduce over ", name, " gave ", value.item<double>(), ", expected ", expected));
    }
    absl::StrAppend(&report, " ", name, "[", absl::StrJoin(group->global_ranks(), ","), "] sum=", value.item<double>());
  }
  std::printf("%s\n", report.c_str());
  std::fflush(stdout);
  TRIDENT_RETURN_IF_ERROR(topology->world().Barrier());
  if (topology->rank() == 0) {
    std::printf("distributed engine OK: %s over %s, every group's all-reduce checked\n",
                topology->mesh().ToString().c_str(), topology->backend_name().c_str());
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace trident

int main(int argc, char** argv) {
  gflags::SetUsageMessage("hello_world [--nproc=N] [--tp=T]: ranks all-reduce over a tensor x data mesh");
  if (trident::HelpRequested(argc, argv)) return trident::PrintHelp(__FILE__);
  gflags::ParseCommandLineFlags(&argc, &argv, /*remove_flags=*/false);
  if (auto job = trident::RunAsLocalJobUnlessLaunched(FLAGS_nproc, argc, argv)) {
    return trident::ExitCodeFor("hello_world", *job);
  }
  return trident::ExitCodeFor("hello_world", trident::Run());
}
