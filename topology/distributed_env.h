// DistributedEnv: who this process is in a distributed job, read from the
// environment that a launcher sets. Understands the project's launcher and
// torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), Open MPI's
// mpirun (OMPI_COMM_WORLD_*) and Slurm's srun (SLURM_PROCID, SLURM_NTASKS, ...),
// in that order of precedence, so one binary runs under any of them.
//
//   absl::StatusOr<DistributedEnv> env = DistributedEnvFromEnvironment();
//   if (env.ok()) LOG(INFO) << "rank " << env->rank << " of " << env->world_size;
#ifndef TRIDENT_TOPOLOGY_DISTRIBUTED_ENV_H_
#define TRIDENT_TOPOLOGY_DISTRIBUTED_ENV_H_

#include <functional>
#include <string>

#include "absl/status/statusor.h"

namespace trident {

struct DistributedEnv {
  int rank = 0;                           // global rank, 0 <= rank < world_size
  int world_size = 1;                     // number of processes in the job
  int local_rank = 0;                     // rank among the processes on this node
  int local_world_size = 1;               // processes on this node
  std::string master_addr = "127.0.0.1";  // host of rank 0's rendezvous store
  int master_port = 29500;                // port of the rendezvous store
  std::string launcher;                   // "env", "mpirun" or "slurm": where the values came from
};

// Looks a variable up; returns nullptr when it is not set.
using EnvLookup = std::function<const char*(const char* name)>;

// True when a launcher has set the variables DistributedEnvFrom* reads.
bool HasDistributedEnv(const EnvLookup& lookup);
bool HasDistributedEnv();

// Reads the job layout from `lookup` (or the process environment). Errors name
// the variable at fault. Under Slurm the ranks on this node come from
// SLURM_STEP_TASKS_PER_NODE (or SLURM_TASKS_PER_NODE) at SLURM_NODEID, which
// srun sets whether or not --ntasks-per-node was given, else
// SLURM_NTASKS_PER_NODE. MASTER_ADDR / MASTER_PORT default to the first host of
// the Slurm node list (or 127.0.0.1) and 29500 under mpirun and srun.
absl::StatusOr<DistributedEnv> DistributedEnvFrom(const EnvLookup& lookup);
absl::StatusOr<DistributedEnv> DistributedEnvFromEnvironment();

// First host name of a Slurm node list: "node[03-05,9],gpu1" -> "node03".
std::string FirstSlurmHost(const std::string& nodelist);

// The tasks on node `node_id` (0-based, SLURM_NODEID) of a Slurm tasks-per-node
// list, as SLURM_TASKS_PER_NODE and SLURM_STEP_TASKS_PER_NODE give it: counts
// per node in node order, "N(xM)" for M nodes of N ("2(x3),1": nodes 0-2 run
// two, node 3 one). Errors name the malformed list or a node it lacks.
absl::StatusOr<int> SlurmTasksOnNode(const std::string& tasks_per_node, int node_id);

// The CPUs this process may run on: its affinity mask (what Slurm, taskset
// and container runtimes restrict), capped by the cgroup's CPU quota under
// `cgroup_dir` (cpu.max of cgroup v2, or cpu/cpu.cfs_quota_us over
// cpu.cfs_period_us of v1), rounded up; at least 1.
int UsableCpus(const std::string& cgroup_dir = "/sys/fs/cgroup");

// The CPU threads each rank of `env`'s node gets: SLURM_CPUS_PER_TASK where
// Slurm sets it, else the usable CPUs shared evenly by the node's ranks; at
// least 1. (OMP_NUM_THREADS, when set, is the user's choice over this.)
int CpuThreadsPerRank(const DistributedEnv& env, const EnvLookup& lookup);
int CpuThreadsPerRank(const DistributedEnv& env);

}  // namespace trident

#endif  // TRIDENT_TOPOLOGY_DISTRIBUTED_ENV_H_
