// SkipNet, a model Trident has never seen, trains the losses of one process
// over 20 steps (1e-5 relative) at dp=2, pp=2 (its skip connection crossing
// the stage boundary), pp=4 with zb_h1, dp=2 x pp=2, ZeRO-2, ZeRO-3, and tp=2
// (its two linear layers split by the automatic tensor-parallel pass).
#include <cstdio>
#include <cstdlib>
#include <fstream>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "skipnet/skipnet.h"
#include "testing/multiprocess.h"
#include "trainer/trainer.h"

namespace skipnet {
namespace {

struct Layout {
  int dp = 1, pp = 1;
  const char* schedule = "1f1b";
  int zero_stage = 0;
  // The default, farthest_min_deps, balances parameters: SkipNet's first
  // layer holds most of them, so four stages need the cuts nearest_min_deps makes.
  const char* split_method = "";
  int tp = 1;
};

std::string TestDir() {
  const char* dir = std::getenv("TEST_TMPDIR");
  return dir != nullptr ? dir : "/tmp";
}

// 20 steps of `layout`; rank 0's per-step losses (through a file), and on the
// first stage what its model says about the stage boundaries.
std::vector<double> Train(const Layout& layout, const std::string& tag, std::string* stages = nullptr) {
  const std::string losses_path = TestDir() + "/" + tag + ".losses";
  const std::string stages_path = TestDir() + "/" + tag + ".stages";
  trident::testing::RunOnRanks(layout.dp * layout.tp * layout.pp, [&](int rank) {
    auto topology =
        trident::testing::JoinTopology({{"tensor", layout.tp}, {"pipeline", layout.pp}, {"data", layout.dp}});
    ASSERT_TRUE(topology.ok()) << topology.status();
    auto train = std::make_unique<ShapesDataset>(256, 1);
    trident::ParallelPlan plan;
    plan.set_dp(layout.dp);
    plan.set_pp(layout.pp);
    plan.set_tp(layout.tp);
    plan.mutable_tensor_parallel()->set_split_all(
        true);  // SkipNet is too small for tensor parallelism to pay: split it anyway
    plan.mutable_pipeline()->set_schedule(layout.schedule);
    plan.mutable_zero()->set_stage(layout.zero_stage);
    plan.mutable_trace()->set_split_method(layout.split_method);
    plan.mutable_zero()->set_reduce_bucket_bytes(16 << 10);  // several buckets
    plan.set_micro_batch_size(4);
    plan.set_num_micro_batches(16 / (4 * layout.dp));
    for (const std::string& field : train->field_names()) plan.mutable_trace()->add_batch_fields(field);
    auto example = train->Get({0, 1, 2, 3});
    ASSERT_TRUE(example.ok());
    auto adamw = trident::MakeOptimizerFactory("adamw", trident::ComponentArgs());
    ASSERT_TRUE(adamw.ok());
    auto model = trident::Parallelize(Source(7), plan, topology->get(), *example, *adamw);
    ASSERT_TRUE(model.ok()) << model.status();
    if (rank == 0) std::ofstream(stages_path) << (*model)->Describe();
    trident::TrainerConfig config = trident::DefaultTrainerConfig();
    config.mutable_loop()->set_max_steps(20);
    config.mutable_loop()->set_lr(3e-3);
    config.mutable_loop()->set_warmup_steps(5);
    config.mutable_loop()->set_eval_every(0);
    config.mutable_generation()->set_sample_tokens(0);
    config.mutable_output()->set_log_every(100);
    config.mutable_output()->set_enable_progress_bar(false);
    auto trainer = trident::Trainer::Create(config, {std::move(*model), std::move(train)});
    ASSERT_TRUE(trainer.ok()) << trainer.status();
    auto result = (*trainer)->Train();
    ASSERT_TRUE(result.ok()) << result.status();
    if (rank != 0) return;
    std::ofstream out(losses_path);
    out.precision(17);
    for (double loss : result->losses) out << loss << "\n";
  });
  if (stages != nullptr) {
    std::ifstream in(stages_path);
    *stages = std::string(std::istreambuf_iterator<char>(in), {});
  }
  std::ifstream in(losses_path);
  std::vector<double> losses;
  for (double loss; in >> loss;) losses.push_back(loss);
  return losses;
}

TEST(SkipNetParityTest, EveryLayoutTrainsTheLossesOfOneProcess) {
  const std::vector<double> single = Train({}, "single");
  ASSERT_EQ(single.size(), 20u);
  EXPECT_LT(single.back(), single.front() * 0.9) << "SkipNet should learn";
  for (const auto& [layout, tag] :
       std::vector<std::pair<Layout, std::string>>{{{2, 1}, "dp2"},
                                                   {{1, 2}, "pp2"},
                                                   {{1, 4, "zb_h1", 0, "nearest_min_deps"}, "pp4_zb_h1"},
                                                   {{2, 2}, "dp2_pp2"},
                                                   {{2, 1, "1f1b", 2}, "zero2"},
                                                   {{2, 1, "1f1b", 3}, "zero3"},
                                                   {{1, 1, "1f1b", 0, "", 2}, "tp2"}}) {
    SCOPED_TRACE(tag);
    std::string stages;
    const std::vector<double> losses = Train(layout, tag, &stages);
    ASSERT_EQ(losses.size(), single.size());
    double worst = 0;
    for (size_t i = 0; i < losses.size(); ++i) {
      const double relative = std::abs(losses[i] - single[i]) / std::abs(single[i]);
      worst = std::max(worst, relative);
      EXPECT_LE(relative, 1e-5) << "step " << i + 1;
    }
    std::printf("%s: largest relative loss difference against one process over 20 steps: %.3g\n", tag.c_str(), worst);
    if (tag == "pp2") {
      // The skip connection crosses the cut: stage 0 sends two tensors.
      EXPECT_THAT(stages, ::testing::HasSubstr("sends 2 tensors")) << stages;
    }
    if (tag == "tp2") {  // hidden splits its outputs, classes its inputs; the convolutions stay whole
      EXPECT_THAT(stages, ::testing::ContainsRegex("hidden.weight +column")) << stages;
      EXPECT_THAT(stages, ::testing::ContainsRegex("classes.weight +row")) << stages;
      EXPECT_THAT(stages, ::testing::ContainsRegex("stem.weight +replicated")) << stages;
    }
  }
}

}  // namespace
}  // namespace skipnet
