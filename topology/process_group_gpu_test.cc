// ProcessGroup over NCCL (needs a GPU; tagged gpu). One GPU holds one NCCL
// rank, so the group is a world of one, connected anyway
// (connect_one_rank_groups): waiting for a collective orders the GPU's stream
// after it without holding the host, and the results (the native
// reduce-scatter's included) are right once read.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "testing/multiprocess.h"
#include "testing/queued_work.h"
#include "topology/topology.h"

namespace trident {
namespace {

using testing::QueueLongWork;

TEST(ProcessGroupGpuTest, CollectivesQueueBehindTheStreamWithoutHoldingTheHost) {
  ASSERT_TRUE(torch::cuda::is_available()) << "run gpu-tagged tests on a machine with a GPU";
  testing::RunOnRanks(1, [](int) {
    TopologyOptions options;
    options.backend = CommBackend::kNccl;
    options.connect_one_rank_groups = true;
    auto topology = testing::JoinTopology(options);
    ASSERT_TRUE(topology.ok()) << topology.status();
    const ProcessGroup& group = (*topology)->world();
    ASSERT_TRUE(group.device().is_cuda());
    const at::Tensor a = at::randn({4096, 4096}, at::kCUDA);
    const at::Tensor input = at::arange(8, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA)).view({4, 2});
    const int64_t started = group.collectives_started();

    const std::unique_ptr<c10::Event> queued = QueueLongWork(a);
    at::Tensor summed = input.clone();
    ASSERT_TRUE(group.AllReduce(summed).ok());
    at::Tensor pending = input.clone();
    auto all_reduce = group.IAllReduce(pending);
    ASSERT_TRUE(all_reduce.ok()) << all_reduce.status();
    ASSERT_TRUE(all_reduce->Wait().ok());
    auto scattered = group.ReduceScatter(input, /*dim=*/1, ReduceOp::kAvg);
    ASSERT_TRUE(scattered.ok()) << scattered.status();
    at::Tensor chunk = at::empty({8}, input.options());
    auto reduce_scatter = group.IReduceScatter(input.view({-1}), chunk);
    ASSERT_TRUE(reduce_scatter.ok()) << reduce_scatter.status();
    ASSERT_TRUE(reduce_scatter->Wait().ok());
    at::Tensor half = at::empty({8}, input.options().dtype(at::kBFloat16));  // staged in the input's type
    auto to_half = group.IReduceScatter(input.view({-1}), half);
    ASSERT_TRUE(to_half.ok()) << to_half.status();
    ASSERT_TRUE(to_half->Wait().ok());
    EXPECT_FALSE(queued->query()) << "a collective held the host until the GPU reached it";
    EXPECT_EQ(group.collectives_started() - started, 5);

    EXPECT_TRUE(at::equal(summed.cpu(), input.cpu()));
    EXPECT_TRUE(at::equal(pending.cpu(), input.cpu()));
    EXPECT_TRUE(at::equal(scattered->cpu(), input.cpu()));
    EXPECT_TRUE(at::equal(chunk.cpu(), input.view({-1}).cpu()));
    EXPECT_TRUE(at::equal(half.cpu(), input.view({-1}).cpu().to(at::kBFloat16)));
    // A host value goes through the GPU and back.
    at::Tensor host = at::full({1}, 2.5, at::kDouble);
    ASSERT_TRUE(group.AllReduce(host, ReduceOp::kMax).ok());
    EXPECT_EQ(host.item<double>(), 2.5);
  });
}

}  // namespace
}  // namespace trident
