#include "topology/distributed_env.h"

#include <sched.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace trident {
namespace {

const EnvLookup& ProcessEnvironment() {
  static const EnvLookup* lookup = new EnvLookup([](const char* name) { return std::getenv(name); });
  return *lookup;
}

// Reads integer variable `name`; `fallback` when unset and `fallback` >= 0.
absl::StatusOr<int> ReadInt(const EnvLookup& lookup, const char* name, int fallback = -1) {
  const char* value = lookup(name);
  if (value == nullptr) {
    if (fallback >= 0) return fallback;
    return absl::InvalidArgumentError(
        absl::StrCat("environment variable ", name,
                     " is not set; start the program with tools/launch, "
                     "mpirun or srun, or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT"));
  }
  int parsed;
  if (!absl::SimpleAtoi(value, &parsed) || parsed < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("environment variable ", name, "='", value, "' is not a non-negative integer"));
  }
  return parsed;
}

}  // namespace

bool HasDistributedEnv(const EnvLookup& lookup) {
  return DistributedEnvFrom(lookup).status().code() != absl::StatusCode::kFailedPrecondition;
}

bool HasDistributedEnv() { return HasDistributedEnv(ProcessEnvironment()); }

std::string FirstSlurmHost(const std::string& nodelist) {
  std::string host;
  for (size_t i = 0; i < nodelist.size(); ++i) {
    char c = nodelist[i];
    if (c == ',') break;
    if (c == '[') {
      // Take the first number (with its zero padding) of the first range.
      size_t j = i + 1;
      while (j < nodelist.size() && nodelist[j] != '-' && nodelist[j] != ',' && nodelist[j] != ']') {
        host += nodelist[j++];
      }
      break;
    }
    host += c;
  }
  return host;
}

absl::StatusOr<int> SlurmTasksOnNode(const std::string& tasks_per_node, int node_id) {
  auto malformed = [&tasks_per_node]() {
    return absl::InvalidArgumentError(absl::StrCat("the Slurm tasks-per-node list '", tasks_per_node,
                                                   "' is not of the form N or N(xM), comma-separated"));
  };
  int first_node = 0;  // of the current item
  for (absl::string_view item : absl::StrSplit(tasks_per_node, ',')) {
    int tasks = 0;
    int nodes = 1;
    absl::string_view count = item;
    if (const size_t open = item.find('('); open != absl::string_view::npos) {
      count = item.substr(0, open);
      absl::string_view repeat = item.substr(open);
      if (!absl::ConsumePrefix(&repeat, "(x") || !absl::ConsumeSuffix(&repeat, ")") ||
          !absl::SimpleAtoi(repeat, &nodes) || nodes < 1) {
        return malformed();
      }
    }
    if (!absl::SimpleAtoi(count, &tasks) || tasks < 0) return malformed();
    if (node_id < first_node + nodes) return tasks;
    first_node += nodes;
  }
  return absl::InvalidArgumentError(absl::StrCat("the Slurm tasks-per-node list '", tasks_per_node, "' covers ",
                                                 first_node, " node(s), not node ", node_id, " (SLURM_NODEID)"));
}

namespace {

// The CPUs of a cgroup's quota under `dir`, rounded up; 0 when it sets none.
int CgroupCpuQuota(const std::string& dir) {
  double quota = -1;
  double period = 0;
  std::string max;
  if (std::ifstream v2(dir + "/cpu.max"); v2 >> max >> period) {
    if (max != "max" && !absl::SimpleAtod(max, &quota)) quota = -1;
  } else {
    std::ifstream v1_quota(dir + "/cpu/cpu.cfs_quota_us");
    std::ifstream v1_period(dir + "/cpu/cpu.cfs_period_us");
    if (!(v1_quota >> quota) || !(v1_period >> period)) return 0;
  }
  if (quota <= 0 || period <= 0) return 0;
  return static_cast<int>(std::ceil(quota / period));
}

}  // namespace

int UsableCpus(const std::string& cgroup_dir) {
  int cpus = static_cast<int>(std::thread::hardware_concurrency());
  cpu_set_t mask;
  CPU_ZERO(&mask);
  if (sched_getaffinity(0, sizeof(mask), &mask) == 0) cpus = CPU_COUNT(&mask);
  if (const int quota = CgroupCpuQuota(cgroup_dir); quota > 0) cpus = std::min(cpus, quota);
  return std::max(1, cpus);
}

int CpuThreadsPerRank(const DistributedEnv& env, const EnvLookup& lookup) {
  if (const char* per_task = lookup("SLURM_CPUS_PER_TASK")) {
    int cpus = 0;
    if (absl::SimpleAtoi(per_task, &cpus) && cpus > 0) return cpus;
  }
  return std::max(1, UsableCpus() / std::max(1, env.local_world_size));
}

int CpuThreadsPerRank(const DistributedEnv& env) { return CpuThreadsPerRank(env, ProcessEnvironment()); }

namespace {

// The variables each supported launcher sets, in order of precedence.
struct LauncherVariables {
  const char* launcher;
  const char* rank;
  const char* world_size;
  const char* local_rank;
  const char* local_world_size;
};
constexpr LauncherVariables kLaunchers[] = {
    {"env", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
    {"mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"},
    {"slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"},
};

}  // namespace

absl::StatusOr<DistributedEnv> DistributedEnvFrom(const EnvLookup& lookup) {
  const LauncherVariables* vars = nullptr;
  for (const LauncherVariables& candidate : kLaunchers) {
    if (lookup(candidate.rank) != nullptr) {
      vars = &candidate;
      break;
    }
  }
  if (vars == nullptr) {
    return absl::FailedPreconditionError(
        "no distributed environment: none of RANK, OMPI_COMM_WORLD_RANK or SLURM_PROCID is "
        "set; start the program with tools/launch, mpirun or srun");
  }
  DistributedEnv env;
  env.launcher = vars->launcher;
  const char* rank_var = vars->rank;
  const char* size_var = vars->world_size;
  const char* local_rank_var = vars->local_rank;
  const char* local_size_var = vars->local_world_size;
  auto rank = ReadInt(lookup, rank_var);
  if (!rank.ok()) return rank.status();
  auto world_size = ReadInt(lookup, size_var);
  if (!world_size.ok()) return world_size.status();
  env.rank = *rank;
  env.world_size = *world_size;
  if (env.world_size == 0 || env.rank >= env.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(rank_var, "=", env.rank, " must be below ", size_var, "=", env.world_size));
  }
  // Without local information every process is assumed to be on its own node.
  auto local_rank = ReadInt(lookup, local_rank_var, 0);
  if (!local_rank.ok()) return local_rank.status();
  auto local_size = ReadInt(lookup, local_size_var, *local_rank + 1);
  if (!local_size.ok()) return local_size.status();
  env.local_rank = *local_rank;
  env.local_world_size = *local_size;
  // srun sets the tasks of every node of the step; SLURM_NTASKS_PER_NODE only
  // with --ntasks-per-node.
  const char* slurm_list_var =
      lookup("SLURM_STEP_TASKS_PER_NODE") != nullptr ? "SLURM_STEP_TASKS_PER_NODE" : "SLURM_TASKS_PER_NODE";
  if (env.launcher == "slurm" && lookup(slurm_list_var) != nullptr) {
    auto node_id = ReadInt(lookup, "SLURM_NODEID", 0);
    if (!node_id.ok()) return node_id.status();
    auto tasks = SlurmTasksOnNode(lookup(slurm_list_var), *node_id);
    if (!tasks.ok()) return absl::InvalidArgumentError(absl::StrCat(slurm_list_var, ": ", tasks.status().message()));
    env.local_world_size = *tasks;
  }
  if (env.local_rank >= env.local_world_size) {
    return absl::InvalidArgumentError(absl::StrCat(local_rank_var, "=", env.local_rank, " must be below the ",
                                                   env.local_world_size, " ranks of this node"));
  }

  if (const char* addr = lookup("MASTER_ADDR")) {
    env.master_addr = addr;
  } else if (env.launcher == "env") {
    return absl::InvalidArgumentError("environment variable MASTER_ADDR is not set; set it to the host of rank 0");
  } else if (const char* nodes =
                 lookup("SLURM_STEP_NODELIST") ? lookup("SLURM_STEP_NODELIST") : lookup("SLURM_JOB_NODELIST")) {
    env.master_addr = FirstSlurmHost(nodes);
  }
  const bool port_required = env.launcher == "env";
  auto port = ReadInt(lookup, "MASTER_PORT", port_required ? -1 : 29500);
  if (!port.ok()) return port.status();
  if (*port == 0 || *port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("MASTER_PORT=", *port, " is not a TCP port (1..65535)"));
  }
  env.master_port = *port;
  return env;
}

absl::StatusOr<DistributedEnv> DistributedEnvFromEnvironment() { return DistributedEnvFrom(ProcessEnvironment()); }

}  // namespace trident
