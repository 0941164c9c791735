#include "topology/topology.h"

#include <unistd.h>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/time/clock.h"
#include "testing/multiprocess.h"

namespace trident {
namespace {

using ::testing::AllOf;
using ::testing::AnyOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(TopologyTest, EightRanksGetTheirMeshGroupsByNameAndAlias) {
  testing::RunOnRanks(8, [](int rank) {
    auto created = testing::JoinTopology({{"tensor", 2}, {"pipeline", 2}, {"data", 2}});
    ASSERT_TRUE(created.ok()) << created.status();
    Topology& topology = **created;
    EXPECT_EQ(topology.rank(), rank);
    EXPECT_EQ(topology.world_size(), 8);
    EXPECT_EQ(topology.backend_name(), "gloo");
    EXPECT_EQ(topology.world().size(), 8);

    for (const char* axis : {"tensor", "pipeline", "data"}) {
      auto group = topology.Group(axis);
      ASSERT_TRUE(group.ok()) << group.status();
      EXPECT_EQ(*topology.Group(AxisAlias(axis)), *group);
      EXPECT_EQ(*FindProcessGroup(AxisAlias(axis)), *group);
      EXPECT_EQ((*group)->global_ranks(), topology.mesh().GroupRanks(axis, rank));
      // The sum of the members' global ranks proves the group connects exactly them.
      at::Tensor value = at::full({1}, static_cast<double>(rank), at::kDouble);
      ASSERT_TRUE((*group)->AllReduce(value).ok());
      double expected = 0;
      for (int member : (*group)->global_ranks()) expected += member;
      EXPECT_EQ(value.item<double>(), expected) << axis;
    }
    EXPECT_THAT((*topology.Group("tp"))->global_ranks(), ElementsAre(rank / 2 * 2, rank / 2 * 2 + 1));

    auto tensor_data = topology.GroupSpanning({"tensor", "data"});
    ASSERT_TRUE(tensor_data.ok()) << tensor_data.status();
    EXPECT_EQ((*tensor_data)->name(), "tensor+data");
    EXPECT_EQ((*tensor_data)->size(), 4);
    at::Tensor ones = at::ones({2});
    ASSERT_TRUE((*tensor_data)->AllReduce(ones).ok());
    EXPECT_EQ(ones[0].item<float>(), 4.0f);
    EXPECT_EQ(*topology.GroupSpanning({"tensor", "data"}), *tensor_data);

    auto missing = topology.Group("expert");
    EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
    EXPECT_THAT(std::string(missing.status().message()), HasSubstr("has data, dp, pipeline, pp, tensor"));
    EXPECT_FALSE(topology.GroupSpanning({"expert"}).ok());
  });
}

// A group of one rank does its collectives in place, without the backend
// (on a GPU each would wait for the queued work), unless asked to connect it.
TEST(TopologyTest, OneRankGroupsCollectInPlaceUnlessAskedToConnect) {
  for (const bool connect : {false, true}) {
    testing::RunOnRanks(1, [&](int) {
      TopologyOptions options;
      options.connect_one_rank_groups = connect;
      auto created = testing::JoinTopology(options);
      ASSERT_TRUE(created.ok()) << created.status();
      const ProcessGroup& world = (*created)->world();
      const int64_t started = world.collectives_started();
      at::Tensor value = at::full({2}, 3.0);
      ASSERT_TRUE(world.AllReduce(value).ok());
      ASSERT_TRUE(world.Broadcast(value, 0).ok());
      EXPECT_TRUE(at::equal(value, at::full({2}, 3.0)));
      EXPECT_EQ(world.collectives_started() - started, connect ? 2 : 0);
    });
  }
}

TEST(TopologyTest, ReshapeReplacesTheGroupsOnTheSameRanks) {
  testing::RunOnRanks(4, [](int rank) {
    auto created = testing::JoinTopology({{"data", 4}});
    ASSERT_TRUE(created.ok()) << created.status();
    Topology& topology = **created;
    for (int round = 0; round < 2; ++round) {  // back and forth: old store keys never collide
      ASSERT_TRUE(topology.Reshape({{"tensor", 2}, {"pipeline", 2}}).ok());
      EXPECT_FALSE(topology.Group("data").ok());
      ProcessGroup* tp = *topology.Group("tp");
      EXPECT_EQ(*FindProcessGroup("tp"), tp);
      EXPECT_THAT(tp->global_ranks(), ElementsAre(rank / 2 * 2, rank / 2 * 2 + 1));
      at::Tensor value = at::full({1}, static_cast<double>(rank), at::kDouble);
      ASSERT_TRUE(tp->AllReduce(value).ok());
      EXPECT_EQ(value.item<double>(), 2 * (rank / 2 * 2) + 1);

      ASSERT_TRUE(topology.Reshape({}).ok());  // one data axis over all ranks
      ProcessGroup* dp = *topology.Group("dp");
      EXPECT_EQ(dp->size(), 4);
      at::Tensor ones = at::ones({1});
      ASSERT_TRUE(dp->AllReduce(ones).ok());
      EXPECT_EQ(ones.item<float>(), 4.0f);
    }
    auto bad = topology.Reshape({{"tensor", 3}});
    ASSERT_FALSE(bad.ok());
    EXPECT_THAT(std::string(bad.message()), HasSubstr("world size is 4"));
  });
}

// A rank order (ATorch's parallel_mode's second item) places ranks on the
// mesh: axis groups list their members in mesh order (group rank = mesh
// coordinate), the world keeps the global ranks.
TEST(TopologyTest, ARankOrderLaysTheGroupsOutAndKeepsTheWorldInRankOrder) {
  testing::RunOnRanks(4, [](int rank) {
    TopologyOptions options;
    options.mesh_axes = {{"data", 2}, {"pipeline", 2}};
    options.rank_order = {3, 1, 2, 0};
    auto created = testing::JoinTopology(options);
    ASSERT_TRUE(created.ok()) << created.status();
    Topology& topology = **created;
    ProcessGroup* pp = *topology.Group("pipeline");
    const std::vector<std::vector<int>> pipelines = {{3, 2}, {1, 0}};
    EXPECT_EQ(pp->global_ranks(), pipelines[rank == 3 || rank == 2 ? 0 : 1]);
    EXPECT_EQ(pp->rank(), rank == 3 || rank == 1 ? 0 : 1);
    EXPECT_EQ(topology.world().rank(), rank);
    EXPECT_THAT(topology.world().global_ranks(), ElementsAre(0, 1, 2, 3));
    at::Tensor value = at::full({1}, static_cast<double>(rank), at::kDouble);
    ASSERT_TRUE(pp->Broadcast(value, 0).ok());  // from stage 0
    EXPECT_EQ(value.item<double>(), rank == 3 || rank == 2 ? 3 : 1);
  });
}

TEST(TopologyTest, MeshThatDoesNotFitTheWorldFailsBeforeConnecting) {
  testing::RunOnRanks(2, [](int) {
    auto created = testing::JoinTopology({{"tensor", 4}});
    ASSERT_FALSE(created.ok());
    EXPECT_THAT(std::string(created.status().message()), HasSubstr("has 4 ranks but the world size is 2"));
  });
}

TEST(TopologyTest, RankThatNeverArrivesIsNamedWithinTheRendezvousTimeout) {
  testing::RunOnRanks(3, [](int rank) {
    if (rank == 2) {
      absl::SleepFor(absl::Seconds(4));  // never joins
      return;
    }
    TopologyOptions options;
    options.rendezvous_timeout = absl::Seconds(2);
    const absl::Time start = absl::Now();
    auto created = testing::JoinTopology(options);
    EXPECT_LT(absl::Now() - start, absl::Seconds(6));
    ASSERT_FALSE(created.ok());
    EXPECT_EQ(created.status().code(), absl::StatusCode::kDeadlineExceeded);
    EXPECT_THAT(std::string(created.status().message()), HasSubstr("rank 2 of 3 never arrived"));
  });
}

TEST(TopologyTest, RankThatExitsEarlyIsNamedInItsPeersErrorsFast) {
  testing::MultiProcessResult result = testing::SpawnRanks(3, [](int rank) {
    auto created = testing::JoinTopology();
    ASSERT_TRUE(created.ok()) << created.status();
    if (rank == 1) _exit(9);
    absl::SleepFor(absl::Milliseconds(300));
    const absl::Time start = absl::Now();
    at::Tensor value = at::ones({1024});
    absl::Status status = (*created)->world().AllReduce(value);
    // Far below the 60 s operation timeout: the dead peer is detected, not waited for.
    EXPECT_LT(absl::Now() - start, absl::Seconds(15));
    ASSERT_FALSE(status.ok());
    EXPECT_THAT(std::string(status.message()), HasSubstr("all_reduce on process group"));
    // Shared memory sees the process gone; over sockets the heartbeats stop.
    EXPECT_THAT(std::string(status.message()),
                AnyOf(HasSubstr("rank 1 (pid"), HasSubstr("rank 1 has stopped sending heartbeats")));
  });
  EXPECT_EQ(result.ranks[1].exit_code, 9);
  EXPECT_EQ(result.ranks[0].exit_code, 0) << result.ranks[0].output;
  EXPECT_EQ(result.ranks[2].exit_code, 0) << result.ranks[2].output;
}

TEST(TopologyTest, RankBlockedElsewhereIsNamedWhenACollectiveTimesOut) {
  testing::RunOnRanks(3, [](int rank) {
    TopologyOptions options;
    options.timeout = absl::Seconds(2);
    auto created = testing::JoinTopology(options);
    ASSERT_TRUE(created.ok()) << created.status();
    at::Tensor value = at::ones({4});
    ASSERT_TRUE((*created)->world().AllReduce(value).ok());
    if (rank == 2) {  // alive (beating) but never arrives at the second all-reduce
      absl::SleepFor(absl::Seconds(8));
      return;
    }
    const absl::Time start = absl::Now();
    absl::Status status = (*created)->world().AllReduce(value);
    EXPECT_LT(absl::Now() - start, absl::Seconds(6));
    ASSERT_FALSE(status.ok());
    EXPECT_THAT(std::string(status.message()),
                AllOf(HasSubstr("all_reduce on process group 'data' (global ranks 0,1,2) failed"),
                      // setting up shared memory (two string gathers of two gathers each), the
                      // connection's barrier, the first all-reduce, and this one
                      HasSubstr("rank 2 (it started 6) did not arrive at this group's collective #7: alive but "
                                "blocked elsewhere")));
  });
}

TEST(TopologyTest, LossOfRankZeroIsNamedByTheOthers) {
  testing::MultiProcessResult result = testing::SpawnRanks(3, [](int rank) {
    auto created = testing::JoinTopology();
    ASSERT_TRUE(created.ok()) << created.status();
    if (rank == 0) _exit(4);
    absl::SleepFor(absl::Milliseconds(300));
    at::Tensor value = at::ones({16});
    absl::Status status = (*created)->world().AllReduce(value);
    ASSERT_FALSE(status.ok());
    EXPECT_THAT(std::string(status.message()), HasSubstr("rank 0"));
  });
  EXPECT_EQ(result.ranks[0].exit_code, 4);
  EXPECT_EQ(result.ranks[1].exit_code, 0) << result.ranks[1].output;
  EXPECT_EQ(result.ranks[2].exit_code, 0) << result.ranks[2].output;
}

TEST(TopologyTest, StoreClientsExchangeMessagesBesideTheProcessGroups) {
  testing::RunOnRanks(2, [](int rank) {
    auto topology = testing::JoinTopology();
    ASSERT_TRUE(topology.ok()) << topology.status();
    auto client = (*topology)->ConnectStoreClient();
    ASSERT_TRUE(client.ok()) << client.status();
    StoreClient& store = **client;
    if (rank == 1) {
      ASSERT_TRUE(store.Set("test/message", "from rank 1").ok());
    }
    ASSERT_TRUE(store.Add("test/arrived", 1).ok());
    for (int i = 0; i < 2000 && *store.Add("test/arrived", 0) < 2; ++i) absl::SleepFor(absl::Milliseconds(5));
    EXPECT_EQ(*store.Add("test/arrived", 0), 2);
    EXPECT_TRUE(*store.Contains("test/message"));
    EXPECT_EQ(*store.Get("test/message"), "from rank 1");
    EXPECT_FALSE(*store.Contains("test/nothing"));
  });
}

TEST(TopologyTest, FindProcessGroupWithoutATopologyExplains) {
  auto group = FindProcessGroup("tp");
  EXPECT_EQ(group.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(group.status().message()), HasSubstr("has no Topology"));
}

}  // namespace
}  // namespace trident
