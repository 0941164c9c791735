// Checkpoints outlive their layout: 10 steps in layout A, a checkpoint, 10
// more in layout B equal 20 uninterrupted steps of one process; and the three
// save types hold the same tensors.
#include <filesystem>
#include <map>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "checkpoint/checkpoint.h"
#include "testing/multiprocess.h"
#include "trainer/internal/training_runs.h"

namespace trident {
namespace {

namespace fs = std::filesystem;
using testing::ExpectSameLosses;
using testing::SetFlag;
using testing::SmallConfig;
using testing::TestDir;
using testing::TrainOnRanks;

struct Layout {
  int dp = 1, tp = 1, pp = 1;
  int zero_stage = 0;
  int virtual_stages = 1;
  bool sequence_parallel = false;
  std::string Name() const {
    return absl::StrCat("dp", dp, "_tp", tp, sequence_parallel ? "sp" : "", "_pp", pp, "x", virtual_stages, "_zero",
                        zero_stage);
  }
};

TrainerConfig Configure(TrainerConfig config, const Layout& layout) {
  config.mutable_plan()->set_dp(layout.dp);
  config.mutable_plan()->set_tp(layout.tp);
  config.mutable_plan()->set_pp(layout.pp);
  config.mutable_plan()->mutable_zero()->set_stage(layout.zero_stage);
  SetFlag(&config, "zero_reduce_bucket_size", 3000);  // several buckets, parameters cut between chunks
  config.mutable_plan()->set_virtual_stages(layout.virtual_stages);
  if (layout.virtual_stages > 1) config.mutable_plan()->mutable_pipeline()->set_schedule("interleaved_1f1b");
  config.mutable_plan()->mutable_tensor_parallel()->set_sequence_parallel(layout.sequence_parallel);
  config.mutable_plan()->set_micro_batch_size(8 / layout.dp / 2);
  return config;
}

// Layout `a` trains 20 steps saving at step 10 (as `save_type`); layout `b`
// resumes from step 10. Returns a's first 10 losses followed by b's 10.
std::vector<double> TrainAcross(const TrainerConfig& base, const Layout& a, const Layout& b,
                                const std::string& save_type = "sharded") {
  const std::string tag = absl::StrCat(a.Name(), "_to_", b.Name(), "_", save_type);
  const std::string save_dir = TestDir() + "/" + tag;
  if (!::trident::testing::IsRankProcess()) fs::remove_all(save_dir);
  TrainerConfig first = Configure(base, a);
  first.mutable_checkpoint()->set_save_dir(save_dir);
  first.mutable_checkpoint()->set_save_every(10);
  first.mutable_checkpoint()->set_save_type(save_type);
  std::vector<double> losses = TrainOnRanks(first, tag + "_a");
  TrainerConfig second = Configure(base, b);
  second.mutable_checkpoint()->set_save_dir(save_dir + "_b");
  second.mutable_checkpoint()->set_resume_from(save_dir + "/step_10");
  const std::vector<double> tail = TrainOnRanks(second, tag + "_b");
  EXPECT_EQ(tail.size(), 10u);
  losses.resize(10);
  losses.insert(losses.end(), tail.begin(), tail.end());
  return losses;
}

TEST(ReshardingTest, EveryLayoutChangeContinuesTheOneProcessRun) {
  const TrainerConfig base = SmallConfig(1);
  const std::vector<double> single = TrainOnRanks(Configure(base, Layout{}), "single");
  ASSERT_EQ(single.size(), 20u);
  const std::vector<std::pair<Layout, Layout>> changes = {
      {Layout{2, 2, 1}, Layout{1, 1, 2}},                    // dp2 x tp2 -> pp2
      {Layout{2, 1, 1, 2}, Layout{1, 1, 1}},                 // dp2 ZeRO-2 -> dp1
      {Layout{1, 1, 2}, Layout{4, 1, 1, 3}},                 // pp2 -> dp4 ZeRO-3
      {Layout{1, 1, 1}, Layout{2, 2, 2}},                    // dp1 -> dp2 x tp2 x pp2
      {Layout{1, 1, 2, 0, 2}, Layout{1, 2, 1, 0, 1, true}},  // interleaved pp2 x 2 -> tp2 + SP
  };
  for (const auto& [a, b] : changes) {
    SCOPED_TRACE(a.Name() + " -> " + b.Name());
    ExpectSameLosses(single, TrainAcross(base, a, b), 1e-5);
  }
}

// Loss scaling state (scale, hysteresis, clean steps) crosses a layout change:
// bf16 with dynamic loss scaling, dp2 ZeRO-1 -> pp2, against the same run
// uninterrupted in one process (bf16 rounding differs between layouts: 2%).
TEST(ReshardingTest, Bf16LossScalingCrossesALayoutChange) {
  TrainerConfig base = SmallConfig(1);
  base.mutable_plan()->mutable_precision()->set_mode("bf16");
  SetFlag(&base, "loss_scale", 0);
  base.mutable_plan()->mutable_precision()->mutable_loss_scaler()->set_initial_scale_power(8);
  base.mutable_plan()->mutable_precision()->mutable_loss_scaler()->set_loss_scale_window(
      3);  // the scale grows between the checkpoints
  const std::vector<double> single = TrainOnRanks(Configure(base, Layout{}), "bf16_single");
  ExpectSameLosses(single, TrainAcross(base, Layout{2, 1, 1, 1}, Layout{1, 1, 2}), 2e-2);
}

// merged, deduped and sharded saves of one 2 x 2 x 2 run hold the same
// tensors as a one-process checkpoint; deduped stores no tensor twice, merged
// is one set of whole tensors, and each resumes the run.
TEST(ReshardingTest, SaveTypesHoldTheOneProcessTensors) {
  const TrainerConfig base = SmallConfig(1);
  auto save = [&](const Layout& layout, const std::string& save_type) {
    const std::string dir = TestDir() + "/types_" + layout.Name() + "_" + save_type;
    if (!::trident::testing::IsRankProcess()) fs::remove_all(dir);
    TrainerConfig config = Configure(base, layout);
    config.mutable_loop()->set_max_steps(3);
    config.mutable_checkpoint()->set_save_dir(dir);
    config.mutable_checkpoint()->set_save_type(save_type);
    TrainOnRanks(config, "types_" + layout.Name() + "_" + save_type);
    return dir + "/step_3";
  };
  auto reference = CheckpointReader::Open(save(Layout{}, "merged"));
  ASSERT_TRUE(reference.ok()) << reference.status();
  std::map<std::string, int64_t> stored_bytes;
  for (const std::string type : {"sharded", "deduped", "merged"}) {
    SCOPED_TRACE(type);
    auto reader = CheckpointReader::Open(save(Layout{2, 2, 2}, type));
    ASSERT_TRUE(reader.ok()) << reader.status();
    const auto shapes = (*reference)->FullShapes();
    int compared = 0;
    for (const auto& [name, shape] : shapes) {
      if (name.rfind("rng/", 0) == 0) continue;  // per rank
      if (name == "lm_head.weight") continue;    // the tied alias merged model files carry for PyTorch
      auto mine = (*reader)->ReadWhole(name);
      ASSERT_TRUE(mine.ok()) << mine.status();
      auto expected = (*reference)->ReadWhole(name);
      ASSERT_TRUE(expected.ok());
      // Summation order differs between layouts: fp32 rounding only.
      EXPECT_TRUE(at::allclose(*mine, *expected, 1e-4, 1e-6)) << name;
      ++compared;
    }
    EXPECT_GT(compared, 30);
    int64_t file_bytes = 0, duplicates = 0;
    std::map<std::string, std::vector<TensorSlice>> seen;
    for (const auto& entry :
         fs::directory_iterator(TestDir() + "/types_" + Layout{2, 2, 2}.Name() + "_" + type + "/step_3")) {
      if (entry.path().extension() != ".safetensors") continue;
      file_bytes += static_cast<int64_t>(entry.file_size());
      auto file = CheckpointReader::Open(entry.path().string());
      ASSERT_TRUE(file.ok());
      for (const CheckpointReader::Piece& piece : (*file)->Pieces()) {
        for (const TensorSlice& other : seen[piece.name]) duplicates += other == piece.slice;
        seen[piece.name].push_back(piece.slice);
      }
    }
    stored_bytes[type] = file_bytes;
    if (type != "sharded") {
      EXPECT_EQ(duplicates, 0) << "a tensor stored twice";
    } else {
      EXPECT_GT(duplicates, 0) << "sharded: each rank writes what it holds";
    }
    std::printf("%s: %lld bytes in files, %lld duplicated pieces\n", type.c_str(), static_cast<long long>(file_bytes),
                static_cast<long long>(duplicates));
  }
  EXPECT_LT(stored_bytes["deduped"], stored_bytes["sharded"]);
}

}  // namespace
}  // namespace trident
