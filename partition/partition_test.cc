#include "partition/partition.h"

#include <cstdlib>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace trident {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::vector<int64_t> Cut(const char* method, std::vector<double> weights, int stages) {
  auto bounds = PartitionLayers(method, weights, stages);
  EXPECT_TRUE(bounds.ok()) << bounds.status();
  return bounds.ok() ? *bounds : std::vector<int64_t>{};
}

TEST(PartitionLayersTest, UniformSpreadsTheRemainderUniformFloorLeavesItLast) {
  const std::vector<double> ten(10, 1.0);
  EXPECT_THAT(Cut("uniform", ten, 4), ElementsAre(0, 3, 6, 8, 10));
  EXPECT_THAT(Cut("uniform_floor", ten, 4), ElementsAre(0, 2, 4, 6, 10));
  EXPECT_THAT(Cut("uniform", ten, 1), ElementsAre(0, 10));
  EXPECT_THAT(Cut("uniform", ten, 10), ElementsAre(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10));
}

TEST(PartitionLayersTest, ParametersAndCostMinimiseTheLargestStage) {
  // Hand-checked: the best 3-way cut of 5 1 1 1 1 1 5 is [5][1 1 1 1 1][5] (bottleneck 5).
  const std::vector<double> w = {5, 1, 1, 1, 1, 1, 5};
  EXPECT_THAT(Cut("parameters", w, 3), ElementsAre(0, 1, 6, 7));
  EXPECT_THAT(Cut("cost", w, 3), ElementsAre(0, 1, 6, 7));
  // 4 3 2 1 1 2 3 4 in 3: [4 3][2 1 1 2][3 4], bottleneck 7.
  EXPECT_THAT(Cut("parameters", {4, 3, 2, 1, 1, 2, 3, 4}, 3), ElementsAre(0, 2, 6, 8));
  EXPECT_THAT(Cut("cost", {4, 3, 2, 1, 1, 2, 3, 4}, 3), ElementsAre(0, 2, 6, 8));
  // One heavy layer: it gets a stage of its own.
  EXPECT_THAT(Cut("parameters", {1, 1, 10, 1, 1}, 3), ElementsAre(0, 2, 3, 5));
  EXPECT_THAT(Cut("cost", {1, 1, 10, 1, 1}, 3), ElementsAre(0, 2, 3, 5));
  // Every stage gets at least one layer even when the bottleneck allows fewer stages.
  EXPECT_THAT(Cut("parameters", {100, 1, 1, 1}, 4), ElementsAre(0, 1, 2, 3, 4));
}

TEST(PartitionLayersTest, ImpossibleRequestsAreClearErrors) {
  EXPECT_THAT(std::string(PartitionLayers("uniform", {1, 1}, 3).status().message()),
              HasSubstr("cannot cut 2 layers into 3 stages"));
  EXPECT_THAT(std::string(PartitionLayers("greedy", {1, 1}, 1).status().message()),
              HasSubstr("unknown partition_method 'greedy'"));
}

std::vector<LayerProfile> Profile(std::vector<int64_t> parameters) {
  std::vector<LayerProfile> profile;
  for (size_t i = 0; i < parameters.size(); ++i) {
    LayerProfile p;
    p.name = i == 0 ? "embedding" : "h." + std::to_string(i - 1);
    p.parameter_names = {p.name + ".weight", "shared.weight"};
    p.parameters = parameters[i];
    p.parameter_bytes = 4 * parameters[i];
    p.forward_flops = 2.0 * parameters[i];
    p.activation_bytes = 100 + static_cast<int64_t>(i);
    profile.push_back(p);
  }
  return profile;
}

TEST(PlanStagesTest, PlansCarryLayersParametersAndCosts) {
  PartitionOptions options;
  options.num_stages = 2;
  options.partition_method = "parameters";
  auto plan = PlanStages(Profile({10, 10, 10, 30}), options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_THAT(plan->boundaries(), ElementsAre(0, 3, 4));
  EXPECT_THAT(plan->stages(0).layer_names(), ElementsAre("embedding", "h.0", "h.1"));
  EXPECT_THAT(plan->stages(0).parameter_names(),
              ElementsAre("embedding.weight", "shared.weight", "h.0.weight", "h.1.weight"));
  EXPECT_EQ(plan->stages(0).parameter_bytes(), 120);
  EXPECT_EQ(plan->stages(1).forward_flops(), 60);
  EXPECT_EQ(plan->stages(0).activation_bytes(), 102);

  const char* dir = std::getenv("TEST_TMPDIR");
  const std::string path = std::string(dir ? dir : "/tmp") + "/plan.pbtxt";
  ASSERT_TRUE(SavePlan(*plan, path).ok());
  auto loaded = LoadPlan(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->SerializeAsString(), plan->SerializeAsString());
}

TEST(PlanStagesTest, LayerSplitAtNamedPointsAndCustomBoundaries) {
  PartitionOptions options;
  options.num_stages = 3;
  options.custom_split_points = {"h.0", "h.2"};
  auto plan = PlanStages(Profile({1, 1, 1, 1, 1}), options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_THAT(plan->boundaries(), ElementsAre(0, 1, 3, 5));
  EXPECT_EQ(plan->partition_method(), "custom");
  options.custom_split_points = {"h.0", "h.9"};
  EXPECT_THAT(std::string(PlanStages(Profile({1, 1, 1, 1, 1}), options).status().message()),
              HasSubstr("custom split point 'h.9' is not a layer"));
  options.custom_split_points.clear();
  options.partition_method = "custom";
  options.custom_boundaries = {0, 2, 2, 5};
  EXPECT_THAT(std::string(PlanStages(Profile({1, 1, 1, 1, 1}), options).status().message()),
              HasSubstr("do not cut 5 layers into 3 stages"));
}

}  // namespace
}  // namespace trident
