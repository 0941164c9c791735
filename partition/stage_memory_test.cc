// Building one pipeline stage of a model 8 times its size stays near the
// stage's memory: the model is profiled one layer at a time, partitioned, and
// only the stage's layers are materialised. Its own binary, so the process's
// peak resident memory belongs to this test alone.
#include <sys/resource.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "partition/partition.h"
#include "testing/tiny_model.h"

namespace trident {
namespace {

int64_t PeakResidentBytes() {
  struct rusage usage;
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;
}

int64_t ParameterBytes(const torch::nn::Module& module) {
  int64_t bytes = 0;
  for (const auto& p : module.parameters()) bytes += p.numel() * p.element_size();
  return bytes;
}

TEST(StageMemoryTest, BuildingOneStageOfEightNeedsAboutOneStageOfMemory) {
  testing::TinyModelOptions config;
  config.n_layer = 16;
  config.n_embd = 512;
  config.vocab_size = 256;
  const int64_t layers = config.n_layer + 2;
  auto tokens = torch::randint(config.vocab_size, {1, 8}, torch::kLong);
  const int64_t before = PeakResidentBytes();

  auto profile = ProfileLayersOneByOne(
      layers,
      [&](int64_t i) -> absl::StatusOr<std::shared_ptr<LayerSequence>> {
        return std::shared_ptr<LayerSequence>(std::make_shared<testing::TinyModel>(config, 1, LayerRanges{{i, i + 1}}));
      },
      {tokens});
  ASSERT_TRUE(profile.ok()) << profile.status();
  PartitionOptions options;
  options.num_stages = 8;
  options.partition_method = "parameters";
  auto plan = PlanStages(*profile, options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const StagePlan& stage = plan->stages(4);
  testing::TinyModel part(config, 1, LayerRanges{{stage.first_layer(), stage.end_layer()}});
  const int64_t stage_bytes = ParameterBytes(part);
  const int64_t stage_peak = PeakResidentBytes() - before;

  testing::TinyModel whole(config, 1);
  const int64_t model_bytes = ParameterBytes(whole);
  const int64_t whole_peak = PeakResidentBytes() - before;
  std::printf(
      "model %.1f MB, stage %.1f MB (%.1fx); peak growth building the stage %.1f MB, "
      "then the whole model %.1f MB\n",
      model_bytes / 1e6, stage_bytes / 1e6, double(model_bytes) / stage_bytes, stage_peak / 1e6, whole_peak / 1e6);
  EXPECT_GE(model_bytes, 7.5 * stage_bytes);
  EXPECT_LE(stage_peak, 2 * stage_bytes);
  // The measurement sees whole models: building one grows the peak by about its size.
  EXPECT_GE(whole_peak, model_bytes * 0.8);
}

}  // namespace
}  // namespace trident
