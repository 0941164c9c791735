// Checkpoints through the Trainer: resuming is bit-exact (plain data
// parallelism with dropout, ZeRO, mixed precision with the loss scaler),
// corrupt checkpoints are refused and resume_from=last falls back past them,
// and a failed write keeps the previous checkpoint.
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "checkpoint/checkpoint.h"
#include "testing/multiprocess.h"
#include "trainer/internal/training_runs.h"
#include "trainer/trainer.h"

namespace trident {
namespace {

namespace fs = std::filesystem;
using ::testing::AllOf;
using testing::ExpectResumeIsBitExact;
using ::testing::HasSubstr;
using testing::SetFlag;
using testing::SmallConfig;
using testing::TestDir;
using testing::TrainOnRanks;

// Under ZeRO each rank saves its chunk of the optimizer state; resuming
// continues bit-exactly.
TEST(TrainerCheckpointTest, ZeroResumeIsBitExact) {
  TrainerConfig config = SmallConfig(2);
  config.mutable_plan()->mutable_zero()->set_stage(3);
  SetFlag(&config, "zero_reduce_bucket_size", 4096);
  ExpectResumeIsBitExact(config, "zero_resume");
}

// Checkpoints under ZeRO and mixed precision (with the loss scaler's state)
// resume bit-exactly.
TEST(TrainerCheckpointTest, MixedPrecisionZeroResumeIsBitExact) {
  TrainerConfig config = SmallConfig(2);
  config.mutable_plan()->mutable_precision()->set_mode("bf16");
  SetFlag(&config, "loss_scale", 0);
  config.mutable_plan()->mutable_precision()->mutable_loss_scaler()->set_initial_scale_power(8);
  config.mutable_plan()->mutable_precision()->mutable_loss_scaler()->set_loss_scale_window(
      3);  // the scale changes between the checkpoints
  config.mutable_plan()->mutable_zero()->set_stage(1);
  ExpectResumeIsBitExact(config, "amp_resume");
}

TEST(TrainerCheckpointTest, ResumeIsBitExactAndCorruptCheckpointsAreRefused) {
  const std::string save_dir = TestDir() + "/resume";
  if (!testing::IsRankProcess()) fs::remove_all(save_dir);
  TrainerConfig straight = SmallConfig(2);
  straight.mutable_checkpoint()->set_save_dir(save_dir);
  straight.mutable_checkpoint()->set_save_every(10);
  SetFlag(&straight, "dropout", 0.1);  // dropout masks must resume too
  const std::vector<double> losses = TrainOnRanks(straight, "straight");
  ASSERT_TRUE(fs::exists(save_dir + "/step_10/manifest.pbtxt"));
  ASSERT_TRUE(fs::exists(save_dir + "/step_20/rank_1.safetensors"));

  TrainerConfig resumed = straight;
  resumed.mutable_checkpoint()->set_resume_from(save_dir + "/step_10");
  resumed.mutable_checkpoint()->set_save_dir(TestDir() + "/resume_again");
  const std::vector<double> tail = TrainOnRanks(resumed, "resumed");
  ASSERT_EQ(tail.size(), 10u);
  for (size_t i = 0; i < tail.size(); ++i) EXPECT_EQ(tail[i], losses[10 + i]) << "step " << 11 + i;

  // Flip one byte of step 20: naming it fails; resume_from=last falls back to step 10.
  if (!testing::IsRankProcess()) {
    std::fstream file(save_dir + "/step_20/rank_1.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(-3, std::ios::end);
    file.put('\x7f');
  }
  testing::RunOnRanks(2, [&](int) {
    auto topology = testing::JoinTopology();
    ASSERT_TRUE(topology.ok());
    TrainerConfig bad = straight;
    bad.mutable_checkpoint()->set_resume_from(save_dir + "/step_20");
    auto refused = Trainer::Create(bad, topology->get());
    ASSERT_FALSE(refused.ok());
    EXPECT_THAT(std::string(refused.status().message()), HasSubstr("step_20/rank_1.safetensors is corrupt"));
    TrainerConfig last = straight;
    last.mutable_checkpoint()->set_resume_from("last");
    auto fallback = Trainer::Create(last, topology->get());
    ASSERT_TRUE(fallback.ok()) << fallback.status();
    EXPECT_EQ((*fallback)->step(), 10);
  });
}

// Rank 1 cannot write step 10 (its file is /dev/full: "No space left on
// device"): the save fails on every rank, `last` stays at step 5, and the run
// stops (save_failure=fail) or goes on with a warning (warn).
TEST(TrainerCheckpointTest, WriteFailuresKeepThePreviousCheckpoint) {
  for (const std::string mode : {"fail", "warn"}) {
    const std::string save_dir = TestDir() + "/full_" + mode;
    if (!testing::IsRankProcess()) {
      fs::remove_all(save_dir);
      fs::create_directories(save_dir + "/.step_10.staging");
      fs::create_symlink("/dev/full", save_dir + "/.step_10.staging/rank_1.safetensors");
    }
    TrainerConfig config = SmallConfig(2);
    config.mutable_loop()->set_max_steps(10);
    config.mutable_checkpoint()->set_save_every(5);
    config.mutable_checkpoint()->set_save_dir(save_dir);
    config.mutable_checkpoint()->set_save_failure(mode);
    testing::RunOnRanks(2, [&](int) {
      auto topology = testing::JoinTopology();
      ASSERT_TRUE(topology.ok()) << topology.status();
      auto trainer = Trainer::Create(config, topology->get());
      ASSERT_TRUE(trainer.ok()) << trainer.status();
      auto result = (*trainer)->Train();
      if (mode == "fail") {
        ASSERT_FALSE(result.ok());
        EXPECT_THAT(std::string(result.status().message()),
                    AllOf(HasSubstr("checkpoint step 10 was not saved: rank 1: cannot write safetensors file " +
                                    save_dir + "/.step_10.staging/rank_1.safetensors: No space left on device"),
                          HasSubstr("`last` still points at the previous one")));
      } else {
        ASSERT_TRUE(result.ok()) << result.status();
        EXPECT_EQ(result->losses.size(), 10u);
      }
    });
    if (!testing::IsRankProcess()) {
      EXPECT_EQ(fs::read_symlink(save_dir + "/last"), "step_5") << mode;
      EXPECT_TRUE(CheckpointDirectory::Validate(save_dir + "/step_5").ok()) << mode;
      EXPECT_FALSE(fs::exists(save_dir + "/step_10")) << mode;
    }
  }
}

// The whole configuration (defaults included) is written beside the
// checkpoints and the metrics, and --config reads it back as the same run:
// the config as given, resolving to the same plan.
TEST(TrainerCheckpointTest, TheResolvedConfigurationIsWrittenWhereConfigReadsIt) {
  TrainerConfig config = SmallConfig(2);
  config.mutable_loop()->set_max_steps(2);
  config.mutable_checkpoint()->set_save_dir(TestDir() + "/resolved/checkpoints");
  config.mutable_output()->set_metrics_file(TestDir() + "/resolved/metrics.jsonl");
  TrainOnRanks(config, "resolved");
  TrainerConfig given = config;
  auto plan = ResolveConfig(&given, 2);
  ASSERT_TRUE(plan.ok()) << plan.status();
  for (const std::string& path :
       {TestDir() + "/resolved/checkpoints/config.pbtxt", TestDir() + "/resolved/metrics.config.pbtxt"}) {
    auto written = LoadTrainerConfig(path);
    ASSERT_TRUE(written.ok()) << written.status();
    EXPECT_EQ(ConfigToText(*written), ConfigToText(config)) << path;
    auto again = ResolveConfig(&*written, 2);
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(DescribePlan(*again), DescribePlan(*plan));
    EXPECT_EQ(GlobalBatchSize(*again), 8);
  }
}

}  // namespace
}  // namespace trident
