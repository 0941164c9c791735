// ZeRO for models larger than a rank's share: hybrid sharding (shard groups
// replicated across the data-parallel ranks), the bounded working set
// (prefetch depth, reduce-scatters in flight) and the optimizer state and
// parameters offloaded to disk train the single process's losses, and resume
// bit-exactly.
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "testing/multiprocess.h"
#include "trainer/config.h"
#include "trainer/internal/training_runs.h"
#include "trainer/trainer.h"

namespace trident {
namespace {

using testing::ExpectResumeIsBitExact;
using testing::ExpectSameLosses;
using testing::SetFlag;
using testing::SmallConfig;
using testing::TestDir;
using testing::TrainOnRanks;

TrainerConfig ZeroConfig(int dp, int stage) {
  TrainerConfig config = SmallConfig(dp);
  config.mutable_plan()->mutable_zero()->set_stage(stage);
  SetFlag(&config, "zero_reduce_bucket_size", 4096);  // several buckets
  return config;
}

// dp=4 sharded in groups of 1 (every rank holds everything: data parallelism
// through ZeRO's buckets) and 2 (two replicated pairs); the second run of a
// layout repeats the first bit for bit (a race would show first there).
TEST(ZeroParityTest, HybridShardGroupsTrainTheSameLosses) {
  const std::vector<double> single = TrainOnRanks(SmallConfig(1), "hybrid_reference");
  for (int stage : {1, 3}) {
    for (int group : {1, 2}) {
      TrainerConfig config = ZeroConfig(4, stage);
      SetFlag(&config, "zero_shard_group_size", group);
      const std::string tag = absl::StrCat("hybrid_zero", stage, "_group", group);
      SCOPED_TRACE(tag);
      const std::vector<double> losses = TrainOnRanks(config, tag);
      ExpectSameLosses(single, losses, 1e-5);
      if (stage == 3 && group == 2) ExpectSameLosses(losses, TrainOnRanks(config, tag + "_again"), 0);
    }
  }
  // nnScaler's spelling: two groups of two.
  TrainerConfig groups = ZeroConfig(4, 2);
  SetFlag(&groups, "zero_ngroups", 2);
  ExpectSameLosses(single, TrainOnRanks(groups, "hybrid_ngroups"), 1e-5);
}

// A block kept whole (ATorch's atorch_ignored_cls) beside sharded ones.
TEST(ZeroParityTest, IgnoredModulesStayWholeAndTrainTheSameLosses) {
  const std::vector<double> single = TrainOnRanks(SmallConfig(1), "ignored_reference");
  TrainerConfig config = ZeroConfig(2, 3);
  SetFlag(&config, "atorch_ignored_cls", "transformer.h.0");
  ExpectSameLosses(single, TrainOnRanks(config, "zero3_ignored"), 1e-5);
}

// Gather units wider than a layer: every block in one (ATorch's
// atorch_wrap_cls), and layers merged up to a parameter count
// (atorch_size_based_min_num_params) under limit_all_gathers; each run twice.
TEST(ZeroParityTest, WrappedGatherUnitsTrainTheSameLosses) {
  const std::vector<double> single = TrainOnRanks(SmallConfig(1), "wrap_reference");
  for (const char* policy : {"wrap", "size"}) {
    TrainerConfig config = ZeroConfig(2, 3);
    if (std::string(policy) == "wrap") {
      SetFlag(&config, "atorch_wrap_cls", "transformer.h");
    } else {
      SetFlag(&config, "atorch_size_based_min_num_params", 50000);
      SetFlag(&config, "limit_all_gathers", true);
    }
    const std::string tag = absl::StrCat("zero3_", policy, "_units");
    SCOPED_TRACE(tag);
    const std::vector<double> losses = TrainOnRanks(config, tag);
    ExpectSameLosses(single, losses, 1e-5);
    ExpectSameLosses(losses, TrainOnRanks(config, tag + "_again"), 0);
  }
}

// A deeper prefetch and more reduce-scatters in flight change when
// collectives run, not what they compute.
TEST(ZeroParityTest, PrefetchDepthAndReductionsInFlightKeepTheLosses) {
  const std::vector<double> reference = TrainOnRanks(ZeroConfig(2, 3), "zero3_default_working_set");
  for (auto [prefetch, in_flight] : {std::pair{0, 1}, std::pair{2, 3}}) {
    TrainerConfig config = ZeroConfig(2, 3);
    SetFlag(&config, "zero_prefetch_layers", prefetch);
    SetFlag(&config, "zero_max_inflight_reduce_scatters", in_flight);
    const std::string tag = absl::StrCat("zero3_prefetch", prefetch, "_inflight", in_flight);
    SCOPED_TRACE(tag);
    ExpectSameLosses(reference, TrainOnRanks(config, tag), 0);
  }
}

// bf16 compute (autocast casts each weight; the casts sit between a bucket's
// parameters and the nodes that read them in backward): ZeRO-3, gathering
// bucket by bucket, trains plain data parallelism's bf16 losses, and the same
// again on a second run.
TEST(ZeroParityTest, Bf16StageThreeTrainsPlainDataParallelismsLosses) {
  TrainerConfig plain = ZeroConfig(2, 0);
  SetFlag(&plain, "precision", "bf16");
  const std::vector<double> reference = TrainOnRanks(plain, "bf16_zero0");
  TrainerConfig config = ZeroConfig(2, 3);
  SetFlag(&config, "precision", "bf16");
  const std::vector<double> losses = TrainOnRanks(config, "bf16_zero3");
  ExpectSameLosses(reference, losses, 1e-3);  // measured: 1.2e-4
  ExpectSameLosses(losses, TrainOnRanks(config, "bf16_zero3_again"), 0);
}

// The update streams each bucket's state through the same fused loop: the
// losses equal those without offload bit for bit.
TEST(ZeroOffloadTest, DiskOffloadedOptimizerStateTrainsBitIdentically) {
  for (int stage : {1, 3}) {
    const std::vector<double> in_memory = TrainOnRanks(ZeroConfig(2, stage), absl::StrCat("zero", stage, "_memory"));
    TrainerConfig config = ZeroConfig(2, stage);
    SetFlag(&config, "offload_optimizer", "disk");
    SetFlag(&config, "offload_dir", TestDir());
    SCOPED_TRACE(absl::StrCat("zero_stage ", stage));
    ExpectSameLosses(in_memory, TrainOnRanks(config, absl::StrCat("zero", stage, "_disk")), 0);
  }
}

// ZeRO-3's parameter chunks on disk (ZeRO-Infinity), alone and with the
// optimizer state: read for each gather and around the update, the same
// values: the losses of the in-memory run bit for bit, the single process's
// to 1e-5, and the same again on a second run.
TEST(ZeroOffloadTest, DiskOffloadedParametersTrainBitIdentically) {
  const std::vector<double> single = TrainOnRanks(SmallConfig(1), "offload_params_reference");
  const std::vector<double> in_memory = TrainOnRanks(ZeroConfig(2, 3), "offload_params_memory");
  ExpectSameLosses(single, in_memory, 1e-5);
  for (bool state_too : {false, true}) {
    TrainerConfig config = ZeroConfig(2, 3);
    SetFlag(&config, "offload_params", "disk");
    if (state_too) SetFlag(&config, "offload_optimizer", "disk");
    SetFlag(&config, "offload_dir", TestDir());
    const std::string tag = state_too ? "offload_params_and_state" : "offload_params";
    SCOPED_TRACE(tag);
    const std::vector<double> losses = TrainOnRanks(config, tag);
    ExpectSameLosses(in_memory, losses, 0);
    if (state_too) ExpectSameLosses(losses, TrainOnRanks(config, tag + "_again"), 0);
  }
}

// Checkpoints read offloaded state and parameter chunks where they lie and
// put loaded ones back there; hybrid replicas write their chunks once.
TEST(ZeroOffloadTest, OffloadedAndHybridRunsResumeBitExactly) {
  TrainerConfig offloaded = ZeroConfig(2, 3);
  SetFlag(&offloaded, "offload_optimizer", "disk");
  SetFlag(&offloaded, "offload_params", "disk");
  SetFlag(&offloaded, "offload_dir", TestDir());
  ExpectResumeIsBitExact(offloaded, "offload_resume");
  TrainerConfig hybrid = ZeroConfig(4, 3);
  SetFlag(&hybrid, "zero_shard_group_size", 2);
  ExpectResumeIsBitExact(hybrid, "hybrid_resume");
}

TEST(ZeroOffloadTest, BadShardGroupsAndOffloadDirectoriesAreRefusedByName) {
  TrainerConfig config = ZeroConfig(4, 3);
  SetFlag(&config, "zero_shard_group_size", 3);
  EXPECT_THAT(std::string(ResolveConfig(&config, 4).status().message()),
              ::testing::HasSubstr("the group size must divide the data-parallel ranks"));
  config = ZeroConfig(2, 0);
  SetFlag(&config, "offload_optimizer", "disk");
  EXPECT_THAT(std::string(ResolveConfig(&config, 2).status().message()), ::testing::HasSubstr("zero_stage=0"));
  config = ZeroConfig(2, 2);
  SetFlag(&config, "offload_params", "disk");
  EXPECT_THAT(std::string(ResolveConfig(&config, 2).status().message()),
              ::testing::HasSubstr("offload_params=disk moves ZeRO-3's parameter shards"));
}

}  // namespace
}  // namespace trident
