#include "topology/distributed_env.h"

#include <sched.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace trident {
namespace {

using ::testing::HasSubstr;

EnvLookup FakeEnv(std::map<std::string, std::string> vars) {
  auto shared = std::make_shared<std::map<std::string, std::string>>(std::move(vars));
  return [shared](const char* name) -> const char* {
    auto it = shared->find(name);
    return it == shared->end() ? nullptr : it->second.c_str();
  };
}

TEST(DistributedEnvTest, ReadsTorchrunStyleVariables) {
  auto env = DistributedEnvFrom(FakeEnv({{"RANK", "5"},
                                         {"WORLD_SIZE", "8"},
                                         {"LOCAL_RANK", "1"},
                                         {"LOCAL_WORLD_SIZE", "4"},
                                         {"MASTER_ADDR", "10.0.0.1"},
                                         {"MASTER_PORT", "1234"}}));
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(env->rank, 5);
  EXPECT_EQ(env->world_size, 8);
  EXPECT_EQ(env->local_rank, 1);
  EXPECT_EQ(env->local_world_size, 4);
  EXPECT_EQ(env->master_addr, "10.0.0.1");
  EXPECT_EQ(env->master_port, 1234);
  EXPECT_EQ(env->launcher, "env");
}

TEST(DistributedEnvTest, ReadsOpenMpiVariables) {
  auto env = DistributedEnvFrom(FakeEnv({{"OMPI_COMM_WORLD_RANK", "3"},
                                         {"OMPI_COMM_WORLD_SIZE", "4"},
                                         {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                         {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                                         {"MASTER_ADDR", "head"}}));
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(env->rank, 3);
  EXPECT_EQ(env->world_size, 4);
  EXPECT_EQ(env->local_rank, 1);
  EXPECT_EQ(env->local_world_size, 2);
  EXPECT_EQ(env->master_addr, "head");
  EXPECT_EQ(env->master_port, 29500);
  EXPECT_EQ(env->launcher, "mpirun");
}

TEST(DistributedEnvTest, ReadsSlurmVariablesAndTakesTheFirstNodeAsMaster) {
  auto env = DistributedEnvFrom(FakeEnv({{"SLURM_PROCID", "6"},
                                         {"SLURM_NTASKS", "8"},
                                         {"SLURM_LOCALID", "2"},
                                         {"SLURM_NTASKS_PER_NODE", "4"},
                                         {"SLURM_JOB_NODELIST", "gpu[007-008]"},
                                         {"MASTER_PORT", "4000"}}));
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(env->rank, 6);
  EXPECT_EQ(env->local_rank, 2);
  EXPECT_EQ(env->master_addr, "gpu007");
  EXPECT_EQ(env->master_port, 4000);
  EXPECT_EQ(env->launcher, "slurm");
}

TEST(DistributedEnvTest, FirstSlurmHostHandlesListsAndRanges) {
  EXPECT_EQ(FirstSlurmHost("node[03-05,9],gpu1"), "node03");
  EXPECT_EQ(FirstSlurmHost("a1,a2"), "a1");
  EXPECT_EQ(FirstSlurmHost("single"), "single");
}

TEST(DistributedEnvTest, SlurmTasksPerNodeListsGiveEachNodesCount) {
  // Nodes 0-2 run two tasks, node 3 one.
  for (int node = 0; node < 4; ++node) {
    auto tasks = SlurmTasksOnNode("2(x3),1", node);
    ASSERT_TRUE(tasks.ok()) << tasks.status();
    EXPECT_EQ(*tasks, node < 3 ? 2 : 1) << "node " << node;
  }
  EXPECT_EQ(SlurmTasksOnNode("4", 0).value_or(-1), 4);
  EXPECT_EQ(SlurmTasksOnNode("1,3(x2)", 2).value_or(-1), 3);
  EXPECT_THAT(std::string(SlurmTasksOnNode("2(x3),1", 4).status().message()),
              HasSubstr("covers 4 node(s), not node 4"));
  for (const char* bad : {"", "2(3)", "x", "2(x0)", "2(x3", "-1"}) {
    EXPECT_THAT(std::string(SlurmTasksOnNode(bad, 0).status().message()), HasSubstr("is not of the form N or N(xM)"))
        << bad;
  }
}

// srun without --ntasks-per-node sets no SLURM_NTASKS_PER_NODE: the ranks on
// this node come from the step's tasks-per-node list at SLURM_NODEID.
TEST(DistributedEnvTest, SlurmRanksOnANodeComeFromTheStepsTaskList) {
  auto env = DistributedEnvFrom(FakeEnv({{"SLURM_PROCID", "0"},
                                         {"SLURM_NTASKS", "2"},
                                         {"SLURM_LOCALID", "0"},
                                         {"SLURM_TASKS_PER_NODE", "2"},
                                         {"SLURM_JOB_NODELIST", "localhost"}}));
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(env->local_world_size, 2);

  // The step's list wins over the job's; the node id picks the entry.
  env = DistributedEnvFrom(FakeEnv({{"SLURM_PROCID", "5"},
                                    {"SLURM_NTASKS", "7"},
                                    {"SLURM_LOCALID", "0"},
                                    {"SLURM_NODEID", "3"},
                                    {"SLURM_TASKS_PER_NODE", "4(x2)"},
                                    {"SLURM_STEP_TASKS_PER_NODE", "2(x3),1"},
                                    {"SLURM_NTASKS_PER_NODE", "4"}}));
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(env->local_world_size, 1);

  EXPECT_THAT(std::string(DistributedEnvFrom(FakeEnv({{"SLURM_PROCID", "0"},
                                                      {"SLURM_NTASKS", "2"},
                                                      {"SLURM_NODEID", "1"},
                                                      {"SLURM_STEP_TASKS_PER_NODE", "2"}}))
                              .status()
                              .message()),
              HasSubstr("SLURM_STEP_TASKS_PER_NODE: the Slurm tasks-per-node list '2' covers 1 node(s), not node 1"));
  EXPECT_THAT(std::string(DistributedEnvFrom(FakeEnv({{"SLURM_PROCID", "1"},
                                                      {"SLURM_NTASKS", "3"},
                                                      {"SLURM_LOCALID", "2"},
                                                      {"SLURM_TASKS_PER_NODE", "2,1"}}))
                              .status()
                              .message()),
              HasSubstr("SLURM_LOCALID=2 must be below the 2 ranks of this node"));
}

TEST(DistributedEnvTest, ThreadsPerRankShareTheCpusThisProcessMayUse) {
  auto env = DistributedEnvFrom(FakeEnv({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_TASKS_PER_NODE", "2"}}));
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(CpuThreadsPerRank(*env, FakeEnv({{"SLURM_CPUS_PER_TASK", "3"}})), 3);
  EXPECT_EQ(CpuThreadsPerRank(*env, FakeEnv({})), std::max(1, UsableCpus() / 2));

  // The affinity mask: pinned to one CPU, the process may use one.
  cpu_set_t all;
  ASSERT_EQ(sched_getaffinity(0, sizeof(all), &all), 0);
  const int allowed = CPU_COUNT(&all);
  EXPECT_EQ(UsableCpus("/nonexistent"), allowed);
  int first = 0;
  while (!CPU_ISSET(first, &all)) ++first;
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(first, &one);
  ASSERT_EQ(sched_setaffinity(0, sizeof(one), &one), 0);
  EXPECT_EQ(UsableCpus("/nonexistent"), 1);
  ASSERT_EQ(sched_setaffinity(0, sizeof(all), &all), 0);

  // A cgroup's quota caps it, rounded up: v2's cpu.max, v1's cfs quota.
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / "cgroup";
  std::filesystem::create_directories(dir / "cpu");
  auto write = [](const std::filesystem::path& path, const std::string& text) { std::ofstream(path) << text; };
  write(dir / "cpu" / "cpu.cfs_quota_us", "50000\n");
  write(dir / "cpu" / "cpu.cfs_period_us", "100000\n");
  EXPECT_EQ(UsableCpus(dir.string()), 1);
  write(dir / "cpu" / "cpu.cfs_quota_us", "-1\n");
  EXPECT_EQ(UsableCpus(dir.string()), allowed);
  write(dir / "cpu.max", "max 100000\n");
  EXPECT_EQ(UsableCpus(dir.string()), allowed);
  write(dir / "cpu.max", "50000 100000\n");
  EXPECT_EQ(UsableCpus(dir.string()), 1);
  write(dir / "cpu.max", "150000 100000\n");
  EXPECT_EQ(UsableCpus(dir.string()), std::min(allowed, 2));
}

TEST(DistributedEnvTest, TorchrunVariablesTakePrecedenceOverMpi) {
  auto env = DistributedEnvFrom(FakeEnv({{"RANK", "1"},
                                         {"WORLD_SIZE", "2"},
                                         {"MASTER_ADDR", "x"},
                                         {"MASTER_PORT", "5"},
                                         {"OMPI_COMM_WORLD_RANK", "0"},
                                         {"OMPI_COMM_WORLD_SIZE", "2"}}));
  ASSERT_TRUE(env.ok());
  EXPECT_EQ(env->rank, 1);
  EXPECT_EQ(env->launcher, "env");
}

TEST(DistributedEnvTest, ErrorsNameTheVariableAtFault) {
  EXPECT_FALSE(HasDistributedEnv(FakeEnv({})));
  EXPECT_THAT(std::string(DistributedEnvFrom(FakeEnv({})).status().message()),
              HasSubstr("start the program with tools/launch, mpirun or srun"));
  EXPECT_THAT(std::string(DistributedEnvFrom(FakeEnv({{"RANK", "0"}})).status().message()),
              HasSubstr("WORLD_SIZE is not set"));
  EXPECT_THAT(std::string(DistributedEnvFrom(FakeEnv({{"RANK", "x"}, {"WORLD_SIZE", "2"}})).status().message()),
              HasSubstr("RANK='x' is not a non-negative integer"));
  EXPECT_THAT(std::string(DistributedEnvFrom(FakeEnv({{"RANK", "2"}, {"WORLD_SIZE", "2"}})).status().message()),
              HasSubstr("RANK=2 must be below WORLD_SIZE=2"));
  EXPECT_THAT(
      std::string(
          DistributedEnvFrom(FakeEnv({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}})).status().message()),
      HasSubstr("MASTER_ADDR is not set"));
  EXPECT_THAT(
      std::string(DistributedEnvFrom(
                      FakeEnv({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "70000"}}))
                      .status()
                      .message()),
      HasSubstr("MASTER_PORT=70000 is not a TCP port"));
}

}  // namespace
}  // namespace trident
