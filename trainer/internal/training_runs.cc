#include "trainer/internal/training_runs.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include "data/data.h"
#include "testing/multiprocess.h"

namespace trident::testing {
namespace {

namespace fs = std::filesystem;

void WriteLosses(const std::string& path, const std::vector<double>& losses) {
  std::ofstream out(path);
  out.precision(17);
  for (double l : losses) out << l << "\n";
}

std::vector<double> ReadLosses(const std::string& path) {
  std::ifstream in(path);
  std::vector<double> losses;
  double l;
  while (in >> l) losses.push_back(l);
  return losses;
}

}  // namespace

std::string TestDir() {
  const char* dir = std::getenv("TEST_TMPDIR");
  return dir != nullptr ? dir : "/tmp";
}

std::string DataDir() {
  const std::string dir = TestDir() + "/data";
  if (!fs::exists(dir + "/train.bin")) {
    std::ofstream text(TestDir() + "/corpus.txt");
    for (int i = 0; i < 300; ++i) {
      text << "Line " << i << ": the quick brown fox jumps over the lazy dog " << (i * 7919) % 1000 << " times.\n";
    }
    text.close();
    PrepareOptions options;
    options.inputs = {TestDir() + "/corpus.txt"};
    options.output_dir = dir;
    EXPECT_TRUE(PrepareTextCorpus(options).ok());
  }
  return dir;
}

void SetFlag(TrainerConfig* config, const std::string& name, const std::string& value) {
  const absl::Status status = SetConfigFlag(name, value, config);
  ASSERT_TRUE(status.ok()) << status;
}

TrainerConfig SmallConfig(int dp) {
  TrainerConfig c = DefaultTrainerConfig();
  c.mutable_model()->set_type("gpt");
  c.mutable_model()->mutable_args()->insert(
      {{"preset", "gpt-tiny"}, {"n_layer", "2"}, {"n_embd", "64"}, {"n_head", "4"}, {"block_size", "32"}});
  c.mutable_dataset()->set_dir(DataDir());
  c.mutable_plan()->set_dp(dp);
  c.mutable_plan()->set_micro_batch_size(8 / dp);
  c.mutable_loop()->set_global_batch_size(8);
  c.mutable_loop()->set_max_steps(20);
  c.mutable_loop()->set_lr(3e-3);
  c.mutable_loop()->set_warmup_steps(5);
  c.mutable_loop()->set_eval_every(0);
  c.mutable_generation()->set_sample_tokens(0);
  c.mutable_output()->set_log_every(100);
  c.mutable_output()->set_enable_progress_bar(false);
  c.mutable_plan()->set_seed(5);
  return c;
}

void TrainEverywhere(const TrainerConfig& config, const std::function<void(const TrainResult&)>& on_rank0) {
  auto world = ConfigWorldSize(config);
  ASSERT_TRUE(world.ok()) << world.status();
  RunOnRanks(*world, [&](int rank) {
    TrainerConfig resolved = config;
    auto plan = ResolveConfig(&resolved, *world);
    ASSERT_TRUE(plan.ok()) << plan.status();
    TopologyOptions options;
    options.mesh_axes = PlanMeshAxes(*plan);
    options.rank_order = ToVector(plan->rank_order());
    auto topology = JoinTopology(options);
    ASSERT_TRUE(topology.ok()) << topology.status();
    auto trainer = Trainer::Create(resolved, *plan, topology->get());
    ASSERT_TRUE(trainer.ok()) << trainer.status();
    auto result = (*trainer)->Train();
    ASSERT_TRUE(result.ok()) << result.status();
    if (rank == 0) on_rank0(*result);
  });
}

std::vector<double> TrainOnRanks(const TrainerConfig& config, const std::string& tag) {
  const std::string path = TestDir() + "/" + tag + ".txt";
  TrainEverywhere(config, [&](const TrainResult& result) { WriteLosses(path, result.losses); });
  return ReadLosses(path);
}

void ExpectSameLosses(const std::vector<double>& expected, const std::vector<double>& actual, double relative) {
  ASSERT_EQ(expected.size(), actual.size());
  double worst = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    worst = std::max(worst, std::abs(actual[i] - expected[i]) / std::abs(expected[i]));
    EXPECT_NEAR(actual[i], expected[i], relative * std::abs(expected[i])) << "step " << i + 1;
  }
  std::printf("largest relative loss difference over %zu steps: %.3g\n", expected.size(), worst);
}

void ExpectResumeIsBitExact(TrainerConfig config, const std::string& tag) {
  const std::string save_dir = TestDir() + "/" + tag;
  if (!IsRankProcess()) std::filesystem::remove_all(save_dir);
  config.mutable_checkpoint()->set_save_dir(save_dir);
  config.mutable_checkpoint()->set_save_every(10);
  const std::vector<double> losses = TrainOnRanks(config, tag + "_straight");
  TrainerConfig resumed = config;
  resumed.mutable_checkpoint()->set_resume_from(save_dir + "/step_10");
  resumed.mutable_checkpoint()->set_save_dir(save_dir + "_again");
  const std::vector<double> tail = TrainOnRanks(resumed, tag + "_resumed");
  ASSERT_EQ(tail.size(), 10u);
  for (size_t i = 0; i < tail.size(); ++i) EXPECT_EQ(tail[i], losses[10 + i]) << "step " << 11 + i;
}

}  // namespace trident::testing
