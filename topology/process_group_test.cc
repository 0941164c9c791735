#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "testing/multiprocess.h"
#include "topology/topology.h"

namespace trident {
namespace {

using ::testing::HasSubstr;

testing::MultiProcessOptions TransportOptions(bool shared_memory) {
  testing::MultiProcessOptions options;
  options.env["TRIDENT_SHARED_MEMORY"] = shared_memory ? "1" : "0";
  return options;
}

// Parameters: the number of ranks, and whether the ranks reduce through
// shared memory (the default on one host) or through Gloo's sockets.
class CollectivesTest : public ::testing::TestWithParam<std::tuple<int, bool>> {
 protected:
  int World() const { return std::get<0>(GetParam()); }
  bool Shared() const { return std::get<1>(GetParam()); }
  testing::MultiProcessOptions Transport() const { return TransportOptions(Shared()); }
};

// Parameter: whether messages go through shared memory or Gloo's sockets.
class MessagesTest : public ::testing::TestWithParam<bool> {};

// Rank r holds [r+1, 2(r+1), 3(r+1)]; every answer below is computed by hand from that.
at::Tensor RankTensor(int rank) { return at::tensor({1.0f, 2.0f, 3.0f}) * static_cast<float>(rank + 1); }

TEST_P(CollectivesTest, AllReduceMatchesHandComputedAnswers) {
  const int world = World();
  testing::RunOnRanks(
      world,
      [world, shared = Shared()](int rank) {
        auto topology = testing::JoinTopology();
        ASSERT_TRUE(topology.ok()) << topology.status();
        const ProcessGroup& group = (*topology)->world();
        ASSERT_EQ(group.shares_memory(), shared);
        ASSERT_EQ(group.size(), world);
        ASSERT_EQ(group.rank(), rank);
        const float sum_of_factors = world * (world + 1) / 2.0f;  // 1 + 2 + ... + world
        float product_of_factors = 1;
        for (int k = 1; k <= world; ++k) product_of_factors *= k;

        at::Tensor sum = RankTensor(rank);
        ASSERT_TRUE(group.AllReduce(sum).ok());
        EXPECT_TRUE(at::equal(sum, at::tensor({1.0f, 2.0f, 3.0f}) * sum_of_factors)) << sum;

        at::Tensor avg = RankTensor(rank);
        ASSERT_TRUE(group.AllReduce(avg, ReduceOp::kAvg).ok());
        EXPECT_TRUE(at::allclose(avg, at::tensor({1.0f, 2.0f, 3.0f}) * (sum_of_factors / world)));

        at::Tensor max = RankTensor(rank);
        ASSERT_TRUE(group.AllReduce(max, ReduceOp::kMax).ok());
        EXPECT_TRUE(at::equal(max, RankTensor(world - 1)));

        at::Tensor min = RankTensor(rank);
        ASSERT_TRUE(group.AllReduce(min, ReduceOp::kMin).ok());
        EXPECT_TRUE(at::equal(min, RankTensor(0)));

        at::Tensor product = at::full({2}, static_cast<double>(rank + 1), at::kDouble);
        ASSERT_TRUE(group.AllReduce(product, ReduceOp::kProduct).ok());
        EXPECT_EQ(product[1].item<double>(), product_of_factors);

        at::Tensor counts = at::full({4}, rank, at::kLong);
        ASSERT_TRUE(group.AllReduce(counts).ok());
        EXPECT_EQ(counts[3].item<int64_t>(), world * (world - 1) / 2);

        // A non-contiguous view is reduced in place too.
        at::Tensor matrix = at::arange(6, at::kFloat).view({2, 3}).mul(rank + 1);
        at::Tensor transposed = matrix.t();
        ASSERT_TRUE(group.AllReduce(transposed).ok());
        EXPECT_TRUE(at::equal(matrix, at::arange(6, at::kFloat).view({2, 3}).mul(sum_of_factors)));

        at::Tensor started = at::full({3}, static_cast<float>(rank));
        auto pending = group.IAllReduce(started);
        ASSERT_TRUE(pending.ok()) << pending.status();
        ASSERT_TRUE(pending->Wait().ok());
        EXPECT_EQ(started[2].item<float>(), world * (world - 1) / 2.0f);

        // bf16, which Gloo cannot reduce itself: staged through fp32, in place and started.
        at::Tensor half_precision = RankTensor(rank).to(at::kBFloat16);
        ASSERT_TRUE(group.AllReduce(half_precision).ok());
        EXPECT_EQ(half_precision.scalar_type(), at::kBFloat16);
        EXPECT_TRUE(at::equal(half_precision, (at::tensor({1.0f, 2.0f, 3.0f}) * sum_of_factors).to(at::kBFloat16)));
        at::Tensor half_started = at::full({3}, static_cast<float>(rank)).to(at::kBFloat16);
        auto half_pending = group.IAllReduce(half_started);
        ASSERT_TRUE(half_pending.ok()) << half_pending.status();
        ASSERT_TRUE(half_pending->Wait().ok());
        EXPECT_EQ(half_started[2].item<float>(), world * (world - 1) / 2.0f);

        absl::Status bad = group.AllReduce(counts, ReduceOp::kAvg);
        EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
        EXPECT_THAT(std::string(bad.message()), HasSubstr("kAvg needs a floating-point tensor"));
      },
      Transport());
}

TEST_P(CollectivesTest, BroadcastAllGatherReduceScatterAndBarrier) {
  const int world = World();
  testing::RunOnRanks(
      world,
      [world](int rank) {
        auto topology = testing::JoinTopology();
        ASSERT_TRUE(topology.ok()) << topology.status();
        const ProcessGroup& group = (*topology)->world();

        at::Tensor broadcast = RankTensor(rank);
        ASSERT_TRUE(group.Broadcast(broadcast, /*root=*/1).ok());
        EXPECT_TRUE(at::equal(broadcast, RankTensor(1)));

        // Gathering [r+1, 2(r+1), 3(r+1)] along dim 0 gives the ranks' vectors in order.
        auto gathered = group.AllGather(RankTensor(rank));
        ASSERT_TRUE(gathered.ok()) << gathered.status();
        ASSERT_EQ(gathered->numel(), 3 * world);
        for (int r = 0; r < world; ++r) {
          EXPECT_TRUE(at::equal(gathered->slice(0, 3 * r, 3 * r + 3), RankTensor(r)));
        }
        // Along dim 1 a [2, 1] column per rank becomes a [2, world] matrix whose column r is r.
        auto columns = group.AllGather(at::full({2, 1}, static_cast<float>(rank)), /*dim=*/1);
        ASSERT_TRUE(columns.ok());
        EXPECT_TRUE(at::equal(*columns, at::arange(world, at::kFloat).expand({2, world})));

        // Every rank holds 0..2*world-1 times (rank+1); rank r receives chunk r of the sum.
        at::Tensor input = at::arange(2 * world, at::kFloat) * static_cast<float>(rank + 1);
        auto scattered = group.ReduceScatter(input);
        ASSERT_TRUE(scattered.ok()) << scattered.status();
        const float sum_of_factors = world * (world + 1) / 2.0f;
        EXPECT_TRUE(at::equal(*scattered, at::tensor({2.0f * rank, 2.0f * rank + 1}) * sum_of_factors)) << *scattered;
        // Started and finished later, into a given tensor: the same chunk.
        at::Tensor chunk = at::zeros({2});
        auto scattering = group.IReduceScatter(input, chunk);
        ASSERT_TRUE(scattering.ok()) << scattering.status();
        ASSERT_TRUE(scattering->Wait().ok());
        EXPECT_TRUE(at::equal(chunk, *scattered)) << chunk;
        at::Tensor wrong = at::zeros({3});
        EXPECT_EQ(group.IReduceScatter(input, wrong).status().code(), absl::StatusCode::kInvalidArgument);
        // Along dim 1 of a [2, world] matrix: rank r gets column r of the maximum.
        at::Tensor matrix = at::arange(2 * world, at::kFloat).view({2, world}) + rank;
        auto column = group.ReduceScatter(matrix, /*dim=*/1, ReduceOp::kMax);
        ASSERT_TRUE(column.ok()) << column.status();
        EXPECT_TRUE(
            at::equal(*column, at::tensor({float(rank + world - 1), float(world + rank + world - 1)}).view({2, 1})))
            << *column;

        // bf16 gathers and reductions keep their dtype (staged through fp32 on Gloo).
        auto half_gathered = group.AllGather(RankTensor(rank).to(at::kBFloat16));
        ASSERT_TRUE(half_gathered.ok()) << half_gathered.status();
        EXPECT_EQ(half_gathered->scalar_type(), at::kBFloat16);
        EXPECT_TRUE(at::equal(half_gathered->slice(0, 3 * (world - 1)), RankTensor(world - 1).to(at::kBFloat16)));
        auto half_scattered = group.ReduceScatter(input.to(at::kBFloat16));
        ASSERT_TRUE(half_scattered.ok()) << half_scattered.status();
        EXPECT_TRUE(at::equal(*half_scattered, scattered->to(at::kBFloat16))) << *half_scattered;

        auto uneven = group.ReduceScatter(at::ones({2 * world + 1}));
        EXPECT_EQ(uneven.status().code(), absl::StatusCode::kInvalidArgument);
        EXPECT_THAT(std::string(uneven.status().message()), HasSubstr("is not divisible by the group size"));

        EXPECT_TRUE(group.Barrier().ok());
      },
      Transport());
}

TEST_P(CollectivesTest, SendRecvCarriesEveryDtypeAndShape) {
  const int world = World();
  testing::RunOnRanks(
      world,
      [world](int rank) {
        auto topology = testing::JoinTopology();
        ASSERT_TRUE(topology.ok()) << topology.status();
        const ProcessGroup& group = (*topology)->world();
        const int next = (rank + 1) % world;
        const int previous = (rank + world - 1) % world;
        const std::vector<at::ScalarType> dtypes = {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16,
                                                    at::kLong,  at::kInt,    at::kByte, at::kBool};
        const std::vector<std::vector<int64_t>> shapes = {{}, {5}, {2, 3, 4}};
        int tag = 0;
        for (at::ScalarType dtype : dtypes) {
          for (const auto& shape : shapes) {
            // What rank `r` sends for this dtype and shape.
            auto payload = [&](int r) {
              return (at::arange(at::IntArrayRef(shape).empty() ? 1 : c10::multiply_integers(shape), at::kDouble) +
                      7 * r)
                  .remainder(2 + r)
                  .reshape(shape)
                  .to(dtype);
            };
            at::Tensor received = at::empty(shape, at::TensorOptions().dtype(dtype));
            auto recv = group.IRecv(received, previous, tag);
            ASSERT_TRUE(recv.ok()) << recv.status();
            auto send = group.ISend(payload(rank), next, tag);
            ASSERT_TRUE(send.ok()) << send.status();
            ASSERT_TRUE(send->Wait().ok());
            ASSERT_TRUE(recv->Wait().ok());
            EXPECT_TRUE(at::equal(received, payload(previous)))
                << "dtype " << dtype << " shape " << at::IntArrayRef(shape);
            ++tag;
          }
        }
        // Blocking forms, rank 0 to the last rank.
        if (rank == 0) {
          EXPECT_TRUE(group.Send(at::full({3}, 42.0, at::kDouble), world - 1).ok());
        } else if (rank == world - 1) {
          at::Tensor t = at::zeros({3}, at::kDouble);
          EXPECT_TRUE(group.Recv(t, 0).ok());
          EXPECT_EQ(t[2].item<double>(), 42.0);
        }
        EXPECT_EQ(group.Send(at::ones({1}), world).code(), absl::StatusCode::kInvalidArgument);
        at::Tensor strided = at::zeros({4, 4}).t();
        EXPECT_THAT(std::string(group.IRecv(strided, previous).status().message()),
                    HasSubstr("needs a contiguous tensor"));
      },
      Transport());
}

// Tensors of several rounds of shared memory (1 MiB per rank each) and of odd
// sizes, operations started together and finished later, and a blocking one
// issued while they are in flight: all give the sums computed here, in rank
// order, bit for bit on shared memory (every rank reduces the same way).
TEST_P(CollectivesTest, LargeAndStartedOperationsMatchTheSumsInRankOrder) {
  const int world = World();
  testing::RunOnRanks(
      world,
      [world, shared = Shared()](int rank) {
        auto topology = testing::JoinTopology();
        ASSERT_TRUE(topology.ok()) << topology.status();
        const ProcessGroup& group = (*topology)->world();
        auto data = [](int r, int64_t n, int salt) {
          return at::sin(at::arange(n, at::kDouble) * (0.37 + r + 0.11 * salt)).to(at::kFloat);  // rank r's values
        };
        auto sum = [&](int64_t n, int salt) {
          at::Tensor total = data(0, n, salt);
          for (int r = 1; r < world; ++r) total = total + data(r, n, salt);
          return total;
        };
        auto expect_sum = [&](const at::Tensor& got, const at::Tensor& want, const char* what) {
          if (shared) {
            EXPECT_TRUE(at::equal(got, want)) << what;
          } else {
            EXPECT_TRUE(at::allclose(got, want, 1e-5, 1e-5)) << what;
          }
        };
        const std::vector<int64_t> sizes = {1, 262144 * 3 + 17, 1000003};  // 1, 3 rounds and a bit, 4 rounds
        std::vector<at::Tensor> started_tensors;
        std::vector<PendingWork> started;
        for (size_t i = 0; i < sizes.size(); ++i) {
          started_tensors.push_back(data(rank, sizes[i], static_cast<int>(i)));
          auto pending = group.IAllReduce(started_tensors.back());
          ASSERT_TRUE(pending.ok()) << pending.status();
          started.push_back(*std::move(pending));
        }
        at::Tensor blocking = data(rank, 524289, 7);
        ASSERT_TRUE(group.AllReduce(blocking).ok());
        expect_sum(blocking, sum(524289, 7), "blocking all-reduce behind started ones");
        for (size_t i = 0; i < sizes.size(); ++i) {
          ASSERT_TRUE(started[i].Wait().ok());
          expect_sum(started_tensors[i], sum(sizes[i], static_cast<int>(i)), "started all-reduce");
        }

        const int64_t chunk = 300007;  // reduce-scatter and all-gather across rounds
        at::Tensor input = data(rank, chunk * world, 11);
        at::Tensor mine = at::empty({chunk});
        auto scattering = group.IReduceScatter(input, mine);
        ASSERT_TRUE(scattering.ok()) << scattering.status();
        at::Tensor gathered = at::empty({chunk * world});
        auto gathering = group.IAllGather(data(rank, chunk, 12), gathered);
        ASSERT_TRUE(gathering.ok()) << gathering.status();
        ASSERT_TRUE(scattering->Wait().ok());
        ASSERT_TRUE(gathering->Wait().ok());
        expect_sum(mine, sum(chunk * world, 11).narrow(0, rank * chunk, chunk), "started reduce-scatter");
        for (int r = 0; r < world; ++r) {
          EXPECT_TRUE(at::equal(gathered.narrow(0, r * chunk, chunk), data(r, chunk, 12))) << "rank " << r << "'s part";
        }
        auto scattered = group.ReduceScatter(input.view({world, chunk}).t(), /*dim=*/1);
        ASSERT_TRUE(scattered.ok()) << scattered.status();
        expect_sum(scattered->view({-1}), sum(chunk * world, 11).narrow(0, rank * chunk, chunk), "reduce-scatter");
      },
      Transport());
}

// Rank 0 sends rank 1 more than a mailbox holds (8 MiB) before rank 1
// receives anything, in messages of up to 1.5 MiB and one larger than a
// mailbox message (which takes the sockets); rank 1 receives them in another
// order than sent, some through receives posted earlier and waited for last,
// and two messages with one tag in the order sent. At the same time rank 1
// sends rank 0 as much, so both rings fill at once: nothing may wait for the
// other side's receives while that side is itself sending.
TEST_P(MessagesTest, OutOfOrderAndBeyondTheMailboxArriveWhole) {
  testing::RunOnRanks(
      2,
      [shared = GetParam()](int rank) {
        auto topology = testing::JoinTopology();
        ASSERT_TRUE(topology.ok()) << topology.status();
        const ProcessGroup& group = (*topology)->world();
        const int peer = 1 - rank;
        // Message i of rank r: its tag and values (3 MiB for the last, over the mailbox's 2 MiB limit).
        constexpr int kMessages = 12;
        auto tag = [](int i) { return i == 5 || i == kMessages - 1 ? 5 : 100 + i; };  // messages 5 and 11 share one
        auto values = [](int r, int i) {
          const int64_t n = i == kMessages - 1 ? (int64_t{3} << 20) / 4 : (int64_t{3} << 19) / 4 - 16 * i;
          return at::arange(n, at::kFloat) * (r + 1) + 1000 * i;
        };
        std::vector<PendingWork> sends;
        for (int i = 0; i < kMessages; ++i) {
          auto send = group.ISend(values(rank, i), peer, tag(i));
          ASSERT_TRUE(send.ok()) << send.status();
          sends.push_back(*std::move(send));
        }
        // Posted first, waited for last: messages 0 and 1.
        std::vector<at::Tensor> early = {at::empty_like(values(peer, 0)), at::empty_like(values(peer, 1))};
        std::vector<PendingWork> posted;
        for (int i = 0; i < 2; ++i) {
          auto recv = group.IRecv(early[i], peer, tag(i));
          ASSERT_TRUE(recv.ok()) << recv.status();
          posted.push_back(*std::move(recv));
        }
        // Then backwards from the last, except message 11, which shares message
        // 5's tag and so comes after it.
        for (int i = kMessages - 2; i >= 2; --i) {
          at::Tensor got = at::empty_like(values(peer, i));
          ASSERT_TRUE(group.Recv(got, peer, tag(i)).ok()) << "message " << i;
          EXPECT_TRUE(at::equal(got, values(peer, i))) << "message " << i;
        }
        at::Tensor last = at::empty_like(values(peer, kMessages - 1));
        ASSERT_TRUE(group.Recv(last, peer, 5).ok());
        EXPECT_TRUE(at::equal(last, values(peer, kMessages - 1))) << "the large message, tag 5's second";
        for (int i = 0; i < 2; ++i) {
          ASSERT_TRUE(posted[i].Wait().ok());
          EXPECT_TRUE(at::equal(early[i], values(peer, i))) << "posted message " << i;
        }
        for (PendingWork& send : sends) ASSERT_TRUE(send.Wait().ok());
        // A receive of another size than the message is an error that says so.
        if (shared && rank == 0) {
          ASSERT_TRUE(group.Send(at::ones({4}), 1, 7).ok());
        } else if (shared) {
          at::Tensor wrong = at::empty({5});
          EXPECT_THAT(std::string(group.Recv(wrong, 0, 7).message()),
                      HasSubstr("the message with tag 7 has 16 bytes where the receive expected 20"));
        }
      },
      TransportOptions(GetParam()));
}

// A receive from a rank that exited fails at once and names it, whether the
// rank exited before its first message (no mailbox yet) or after one. One run
// per test: a rank process would return at once from the runs before its own.
void ExpectReceiveFromExitedRankFails(bool sent_first) {
  testing::MultiProcessResult result = testing::SpawnRanks(
      2,
      [sent_first](int rank) {
        auto topology = testing::JoinTopology();
        ASSERT_TRUE(topology.ok()) << topology.status();
        const ProcessGroup& group = (*topology)->world();
        ASSERT_TRUE(group.shares_memory());
        at::Tensor got = at::empty({8});
        if (rank == 1) {
          if (sent_first) {
            ASSERT_TRUE(group.Send(at::ones({8}), 0, 1).ok());
          }
          _exit(3);
        }
        if (sent_first) {
          ASSERT_TRUE(group.Recv(got, 1, 1).ok());
        }
        const absl::Time start = absl::Now();
        const absl::Status status = group.Recv(got, 1, 2);
        EXPECT_LT(absl::Now() - start, absl::Seconds(15));  // far below the 60 s timeout
        EXPECT_THAT(std::string(status.message()), HasSubstr("recv on process group"));
        EXPECT_THAT(std::string(status.message()), HasSubstr("rank 1 (pid"));
        EXPECT_THAT(std::string(status.message()), HasSubstr("exited"));
      },
      TransportOptions(true));
  EXPECT_EQ(result.ranks[1].exit_code, 3);
  EXPECT_EQ(result.ranks[0].exit_code, 0) << result.ranks[0].output;
}

TEST(SharedMemoryMessagesTest, ReceiveFromARankThatExitedBeforeSendingNamesIt) {
  ExpectReceiveFromExitedRankFails(/*sent_first=*/false);
}

TEST(SharedMemoryMessagesTest, ReceiveFromARankThatExitedAfterSendingNamesIt) {
  ExpectReceiveFromExitedRankFails(/*sent_first=*/true);
}

// A rank that sent and then went (its group torn down, its process ended)
// leaves its messages behind: a receive posted after that still gets them.
TEST(SharedMemoryMessagesTest, MessagesOfARankThatWentAwayStillArrive) {
  testing::MultiProcessResult result = testing::SpawnRanks(
      2,
      [](int rank) {
        auto topology = testing::JoinTopology();
        ASSERT_TRUE(topology.ok()) << topology.status();
        const ProcessGroup& group = (*topology)->world();
        ASSERT_TRUE(group.shares_memory());
        if (rank == 1) {
          ASSERT_TRUE(group.Send(at::full({8}, 7.0f), 0, 1).ok());
          topology->reset();
          return;
        }
        absl::SleepFor(absl::Seconds(1));  // rank 1 has gone by now
        at::Tensor got = at::empty({8});
        ASSERT_TRUE(group.Recv(got, 1, 1).ok());
        EXPECT_TRUE(at::equal(got, at::full({8}, 7.0f)));
      },
      TransportOptions(true));
  EXPECT_EQ(result.ranks[1].exit_code, 0) << result.ranks[1].output;
  EXPECT_EQ(result.ranks[0].exit_code, 0) << result.ranks[0].output;
}

// Strings travel whole: newlines, colons and empty strings included.
TEST_P(CollectivesTest, AllGatherStringsKeepsEveryByte) {
  const int world = World();
  testing::RunOnRanks(
      world,
      [world](int rank) {
        auto topology = testing::JoinTopology();
        ASSERT_TRUE(topology.ok()) << topology.status();
        std::vector<std::string> mine = {absl::StrCat("rank ", rank, "\nline: 2\n"), ""};
        if (rank == 0) mine.clear();
        auto gathered = AllGatherStrings((*topology)->world(), mine);
        ASSERT_TRUE(gathered.ok()) << gathered.status();
        ASSERT_EQ(gathered->size(), static_cast<size_t>(world));
        EXPECT_TRUE((*gathered)[0].empty());
        for (int r = 1; r < world; ++r) {
          EXPECT_EQ((*gathered)[r], std::vector<std::string>({absl::StrCat("rank ", r, "\nline: 2\n"), ""}));
        }
      },
      Transport());
}

// A group of one rank has no c10d backend: every collective is a local copy or
// nothing, with the same results (and fresh tensors) a backend would give.
TEST(OneRankGroupTest, CollectivesAreLocal) {
  testing::RunOnRanks(1, [](int) {
    auto topology = testing::JoinTopology();
    ASSERT_TRUE(topology.ok()) << topology.status();
    const ProcessGroup& group = (*topology)->world();
    ASSERT_EQ(group.size(), 1);
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
      at::Tensor t = RankTensor(0);
      ASSERT_TRUE(group.AllReduce(t, op).ok());
      EXPECT_TRUE(at::equal(t, RankTensor(0)));
    }
    at::Tensor pending_sum = RankTensor(0);
    auto started = group.IAllReduce(pending_sum);
    ASSERT_TRUE(started.ok()) << started.status();
    EXPECT_TRUE(started->IsCompleted());
    EXPECT_TRUE(started->Wait().ok());
    EXPECT_FALSE(started->Wait().ok()) << "a handle waits once";

    at::Tensor input = at::arange(6, at::kFloat).view({2, 3});
    auto gathered = group.AllGather(input, /*dim=*/1);
    ASSERT_TRUE(gathered.ok());
    EXPECT_TRUE(at::equal(*gathered, input));
    gathered->zero_();
    EXPECT_EQ(input.sum().item<float>(), 15.0f) << "the result is a copy";
    at::Tensor output = at::zeros({6});
    auto gathering = group.IAllGather(input, output);
    ASSERT_TRUE(gathering.ok() && gathering->Wait().ok());
    EXPECT_TRUE(at::equal(output, at::arange(6, at::kFloat)));
    at::Tensor reduced = at::zeros({6});
    auto scattering = group.IReduceScatter(output, reduced);
    ASSERT_TRUE(scattering.ok() && scattering->Wait().ok());
    EXPECT_TRUE(at::equal(reduced, output));

    auto scattered = group.ReduceScatter(input, /*dim=*/1, ReduceOp::kAvg);
    ASSERT_TRUE(scattered.ok());
    EXPECT_TRUE(at::equal(*scattered, input));
    EXPECT_FALSE(scattered->is_same(input));
    at::Tensor broadcast = RankTensor(0);
    EXPECT_TRUE(group.Broadcast(broadcast, 0).ok());
    EXPECT_EQ(group.Broadcast(broadcast, 1).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(group.Barrier().ok());
    EXPECT_THAT(std::string(group.Send(input, 0).message()), HasSubstr("a group of one rank has no peer"));
  });
}

INSTANTIATE_TEST_SUITE_P(TwoAndFourRanks, CollectivesTest,
                         ::testing::Combine(::testing::Values(2, 4), ::testing::Bool()), [](const auto& info) {
                           return "world" + std::to_string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "_shared_memory" : "_sockets");
                         });
INSTANTIATE_TEST_SUITE_P(SharedMemoryAndSockets, MessagesTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "shared_memory" : "sockets"; });

}  // namespace
}  // namespace trident
