// topology: who is who in a distributed job and how the ranks talk.
//
// A Topology joins this process to the job (rendezvous over a c10d TCPStore on
// rank 0), lays the ranks out on a DeviceMesh, and creates one ProcessGroup for
// the whole world and one per mesh axis slice this rank belongs to. Groups are
// reachable by axis name or alias ("tensor"/"tp", "pipeline"/"pp", "data"/"dp",
// "sequence"/"sp", "context"/"cp", "expert"/"ep") on the Topology and, for
// registered operators that only get a name, through FindProcessGroup.
//
//   // Started by tools/launch, mpirun or srun with 8 ranks:
//   TopologyOptions options;
//   options.mesh_axes = {{"tensor", 2}, {"pipeline", 2}, {"data", DeviceMesh::kInferSize}};
//   TRIDENT_ASSIGN_OR_RETURN(std::unique_ptr<Topology> topology,
//                            Topology::CreateFromEnvironment(options));
//   TRIDENT_ASSIGN_OR_RETURN(ProcessGroup* dp, topology->Group("dp"));
//   TRIDENT_RETURN_IF_ERROR(dp->AllReduce(gradients, ReduceOp::kAvg));
//
// Failures never hang: rendezvous, collectives and point-to-point operations
// time out, and a rank that died is named in the errors of the ranks that
// depended on it (ranks send heartbeats to the store while the Topology lives).
//
// The local launcher (RunLocalGroup) that starts the ranks is part of this
// component too; see launcher.h.
#ifndef TRIDENT_TOPOLOGY_TOPOLOGY_H_
#define TRIDENT_TOPOLOGY_TOPOLOGY_H_

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "topology/device_mesh.h"
#include "topology/distributed_env.h"
#include "topology/launcher.h"
#include "topology/process_group.h"

namespace trident {

enum class CommBackend {
  kAuto,  // NCCL when LibTorch has CUDA and a GPU is visible, else Gloo
  kGloo,
  kNccl,
};

struct TopologyOptions {
  // Mesh axes, first fastest; empty means one axis "data" over all ranks.
  std::vector<MeshAxis> mesh_axes;
  // The rank at each mesh position (the reference's rank_order; empty: rank i
  // at position i).
  std::vector<int> rank_order;
  // Limit for every collective and point-to-point operation.
  absl::Duration timeout = absl::Minutes(5);
  // Limit for all ranks to arrive at the rendezvous.
  absl::Duration rendezvous_timeout = absl::Minutes(2);
  CommBackend backend = CommBackend::kAuto;
  // How often a rank tells the store it is alive; a rank silent for three
  // intervals after an operation failed is reported as dead.
  absl::Duration heartbeat_interval = absl::Milliseconds(500);
  // Groups of one rank do their collectives in place, without the backend
  // (through NCCL each would stage its scalars through the GPU and wait for
  // its queued work). Tests of a backend on one device connect them anyway.
  bool connect_one_rank_groups = false;
};

// A connection of its own to the job's rendezvous store, for a thread other
// than the one running collectives (a background checkpoint writer) to
// exchange short messages with the other ranks. Not shared between threads.
// Contains and Add take tens of microseconds; Get about 200 ms (c10d's get
// waits), so poll with Add or Contains and Get only what is known to be set.
class StoreClient {
 public:
  virtual ~StoreClient() = default;
  virtual absl::Status Set(const std::string& key, const std::string& value) = 0;
  // The value of a key that is set.
  virtual absl::StatusOr<std::string> Get(const std::string& key) = 0;
  virtual absl::StatusOr<bool> Contains(const std::string& key) = 0;
  // Adds `delta` to the counter `key` (0 when unset) and returns its new value.
  virtual absl::StatusOr<int64_t> Add(const std::string& key, int64_t delta) = 0;
};

class Topology {
 public:
  // Joins the job described by `env`. Blocks until all env.world_size ranks
  // arrived (or errors naming the missing ranks after options.rendezvous_timeout)
  // and the process groups are connected. At most one Topology per process.
  static absl::StatusOr<std::unique_ptr<Topology>> Create(const DistributedEnv& env, TopologyOptions options);
  // Create() with DistributedEnvFromEnvironment().
  static absl::StatusOr<std::unique_ptr<Topology>> CreateFromEnvironment(TopologyOptions options);

  ~Topology();
  Topology(const Topology&) = delete;
  Topology& operator=(const Topology&) = delete;

  int rank() const { return env_.rank; }
  int world_size() const { return env_.world_size; }
  const DistributedEnv& env() const { return env_; }
  const DeviceMesh& mesh() const { return mesh_; }
  // "gloo" or "nccl".
  const std::string& backend_name() const { return backend_name_; }

  // The group of all ranks (also reachable as "world").
  ProcessGroup& world() const { return *world_; }
  // The group called `name`: "world", a mesh axis or its alias, or a group made
  // by GroupSpanning. Errors list the names that exist.
  absl::StatusOr<ProcessGroup*> Group(absl::string_view name) const;
  // The group of this rank spanning several axes (for example {"tensor", "data"}),
  // named by joining the axis names with '+'. Creating it is collective: every
  // rank must call this with the same axes in the same order. Later calls return
  // the same group.
  absl::StatusOr<ProcessGroup*> GroupSpanning(const std::vector<std::string>& axes);
  // The groups of hybrid sharding: `axis`'s ranks (in its group order) in
  // consecutive blocks of `block_size` (`block`: this rank's), and this rank
  // with those at its place in every other block (`across`), named
  // "AXIS.blockN" and "AXIS.acrossN". Collective over the world as
  // GroupSpanning is; later calls return the same groups. Errors when
  // `block_size` does not divide the axis.
  struct SplitGroups {
    ProcessGroup* block = nullptr;
    ProcessGroup* across = nullptr;
  };
  absl::StatusOr<SplitGroups> SplitAxis(const std::string& axis, int block_size);
  // Lays the same ranks out on a new mesh (empty: one "data" axis; rank_order
  // as in TopologyOptions), keeping
  // the rendezvous store and the heartbeats: every group is replaced, so
  // pointers to the old ones (and whatever holds them, a ParallelModel) must
  // be gone first. Collective: every rank calls it with the same axes. The
  // strategy search runs each candidate layout in one job this way.
  absl::Status Reshape(std::vector<MeshAxis> mesh_axes, std::vector<int> rank_order = {});
  // A new connection to the rendezvous store (see StoreClient).
  absl::StatusOr<std::unique_ptr<StoreClient>> ConnectStoreClient() const;

 private:
  class Impl;
  Topology(DistributedEnv env, DeviceMesh mesh);
  // The group of this rank spanning `axes`, its members in mesh order or, with
  // `by_global_rank`, in the order of their global ranks.
  absl::StatusOr<ProcessGroup*> AddGroup(const std::vector<std::string>& axes, bool by_global_rank = false);
  // The group `name` of the global `ranks` (this rank among them).
  absl::StatusOr<ProcessGroup*> AddGroupOfRanks(const std::string& name, const std::vector<int>& ranks);
  // The world group and one per mesh axis, then a barrier.
  absl::Status ConnectGroups();

  DistributedEnv env_;
  DeviceMesh mesh_;
  std::string backend_name_;
  std::unique_ptr<Impl> impl_;
  ProcessGroup* world_ = nullptr;
  std::map<std::string, ProcessGroup*> groups_by_name_;
};

// The group called `name` of this process's live Topology; for registered
// operators that receive a group name. Errors when no Topology exists or no
// group has that name.
absl::StatusOr<ProcessGroup*> FindProcessGroup(absl::string_view name);

// The short alias of a mesh axis ("tensor" -> "tp"), or "" when it has none.
std::string AxisAlias(absl::string_view axis);

}  // namespace trident

#endif  // TRIDENT_TOPOLOGY_TOPOLOGY_H_
