#include "topology/distributed_env.h"

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
