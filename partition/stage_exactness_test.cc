// Running a plan's stages one after another, each as its own autograd segment
// joined at the boundary tensor (as pipeline stages are), gives the unsplit
// model's loss and every parameter's gradient.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "partition/partition.h"
#include "testing/tiny_model.h"

namespace trident {
namespace {

struct Case {
  bool tied;  // the head reads the token embedding
  const char* method;
  int stages;
};

class StageExactnessTest : public ::testing::TestWithParam<Case> {};

TEST_P(StageExactnessTest, StagesInSequenceEqualTheUnsplitModel) {
  const Case c = GetParam();
  testing::TinyModelOptions config;
  config.n_layer = 3;
  config.tie_embeddings = c.tied;
  auto split = std::make_shared<testing::TinyModel>(config, 11);
  auto whole = std::make_shared<testing::TinyModel>(config, 11);
  torch::manual_seed(3);
  auto tokens = torch::randint(config.vocab_size, {2, 16}, torch::kLong);
  auto targets = torch::randint(config.vocab_size, {2, 16}, torch::kLong);

  auto profile = ProfileLayers(*split, {tokens, targets});
  ASSERT_TRUE(profile.ok()) << profile.status();
  PartitionOptions options;
  options.num_stages = c.stages;
  options.partition_method = c.method;
  if (options.partition_method == "custom") {
    options.custom_boundaries = {0};
    for (int s = 1; s < c.stages; ++s) options.custom_boundaries.push_back(s);
    options.custom_boundaries.push_back(split->NumLayers());
  }
  auto plan = PlanStages(*profile, options);
  ASSERT_TRUE(plan.ok()) << plan.status();

  // Forward stage by stage; each stage's input is a fresh leaf, as after a receive.
  std::vector<at::Tensor> inputs, outputs;
  at::Tensor x = tokens;
  for (const StagePlan& stage : plan->stages()) {
    at::Tensor input = stage.stage() == 0 ? x : x.detach().requires_grad_(true);
    at::Tensor y = input;
    for (int64_t i = stage.first_layer(); i < stage.end_layer(); ++i) y = split->ForwardLayer(i, y);
    inputs.push_back(input);
    outputs.push_back(y);
    x = y;
  }
  at::Tensor loss = split->SequenceLoss(outputs.back(), targets);
  loss.backward();
  for (int s = c.stages - 2; s >= 0; --s) outputs[s].backward(inputs[s + 1].grad());

  at::Tensor reference = whole->Loss(tokens, targets);
  reference.backward();
  EXPECT_EQ(loss.item<double>(), reference.item<double>());
  auto expected = whole->named_parameters();
  for (const auto& item : split->named_parameters()) {
    EXPECT_TRUE(torch::allclose(item.value().grad(), expected[item.key()].grad(), 1e-5, 1e-7)) << item.key();
  }
}

std::vector<Case> AllCases() {
  std::vector<Case> cases;
  for (bool tied : {false, true}) {
    for (const char* method : {"uniform", "uniform_floor", "parameters", "cost", "custom"}) {
      for (int stages = 1; stages <= 4; ++stages) cases.push_back({tied, method, stages});
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(MethodsStages, StageExactnessTest, ::testing::ValuesIn(AllCases()), [](const auto& info) {
  return std::string(info.param.tied ? "tied_" : "") + info.param.method + "_" + std::to_string(info.param.stages);
});

TEST(BalanceTest, ParametersKeepTwelveBlocksWithinFifteenPercentOnFourStages) {
  testing::TinyModelOptions config;
  config.n_layer = 12;
  config.vocab_size = 256;
  config.tie_embeddings = true;
  auto model = std::make_shared<testing::TinyModel>(config, 1);
  auto profile = ProfileLayers(*model, {torch::randint(256, {1, 8}, torch::kLong)});
  ASSERT_TRUE(profile.ok());
  PartitionOptions options;
  options.num_stages = 4;
  options.partition_method = "parameters";
  auto plan = PlanStages(*profile, options);
  ASSERT_TRUE(plan.ok());
  // Embeddings aside: count only the transformer blocks' parameters per stage.
  std::vector<double> stage_parameters;
  double total = 0;
  for (const StagePlan& stage : plan->stages()) {
    double sum = 0;
    for (int64_t i = stage.first_layer(); i < stage.end_layer(); ++i) {
      if ((*profile)[i].name.rfind("blocks.", 0) == 0) sum += (*profile)[i].parameters;
    }
    stage_parameters.push_back(sum);
    total += sum;
  }
  for (double p : stage_parameters) EXPECT_LE(p, 1.15 * total / 4);
}

// The cost method evens out the stages' estimated forward FLOPs (the measured
// times are reported by //benchmarks:partition_benchmark, BM_CostBalance).
TEST(BalanceTest, CostKeepsTheSlowestOfFourStagesWithinTwentyPercentOfTheMean) {
  testing::TinyModelOptions config;
  config.n_layer = 12;
  config.vocab_size = 512;  // the head costs two blocks: 14 blocks' worth over 4 stages
  config.tie_embeddings = true;
  auto model = std::make_shared<testing::TinyModel>(config, 1);
  auto profile = ProfileLayers(*model, {torch::randint(256, {2, 64}, torch::kLong)});
  ASSERT_TRUE(profile.ok());
  PartitionOptions options;
  options.num_stages = 4;
  options.partition_method = "cost";
  auto plan = PlanStages(*profile, options);
  ASSERT_TRUE(plan.ok());
  double total = 0, slowest = 0;
  for (const StagePlan& stage : plan->stages()) {
    total += stage.forward_flops();
    slowest = std::max(slowest, stage.forward_flops());
  }
  EXPECT_LE(slowest, 1.2 * total / 4) << plan->DebugString();
}

}  // namespace
}  // namespace trident
