#include "topology/device_mesh.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace trident {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

using Groups = std::vector<std::vector<int>>;

TEST(DeviceMeshTest, TensorPipelineDataOverSixteenRanksGivesTheReferenceTable) {
  auto mesh = DeviceMesh::Create({{"tensor", 4}, {"pipeline", 2}, {"data", 2}}, 16);
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  EXPECT_EQ(mesh->AllGroups({"tensor"}), (Groups{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}}));
  EXPECT_EQ(mesh->AllGroups({"pipeline"}),
            (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}, {8, 12}, {9, 13}, {10, 14}, {11, 15}}));
  EXPECT_EQ(mesh->AllGroups({"data"}), (Groups{{0, 8}, {1, 9}, {2, 10}, {3, 11}, {4, 12}, {5, 13}, {6, 14}, {7, 15}}));
  EXPECT_THAT(mesh->GroupRanks("data", 13), ElementsAre(5, 13));
  EXPECT_THAT(mesh->Coordinates(13), ElementsAre(1, 1, 1));
  EXPECT_EQ(mesh->RankAt({3, 0, 1}), 11);
  EXPECT_EQ(mesh->AxisIndex("pipeline", 6), 1);
  EXPECT_EQ(mesh->ToString(), "tensor=4 x pipeline=2 x data=2 (16 ranks)");
}

TEST(DeviceMeshTest, GroupsSpanningSeveralAxes) {
  auto mesh = DeviceMesh::Create({{"tensor", 2}, {"pipeline", 2}, {"data", 2}}, 8);
  ASSERT_TRUE(mesh.ok());
  EXPECT_THAT(mesh->GroupRanks({"tensor", "data"}, 2), ElementsAre(2, 3, 6, 7));
  EXPECT_THAT(mesh->GroupRanks({"tensor", "pipeline", "data"}, 5), ElementsAre(0, 1, 2, 3, 4, 5, 6, 7));
  EXPECT_EQ(mesh->AllGroups({"pipeline", "data"}), (Groups{{0, 2, 4, 6}, {1, 3, 5, 7}}));
}

TEST(DeviceMeshTest, ARankOrderPlacesRanksAtMeshPositions) {
  // Positions 0..3 hold ranks 3, 2, 1, 0: pipeline groups of positions {0, 2} and {1, 3}.
  auto mesh = DeviceMesh::Create({{"data", 2}, {"pipeline", 2}}, 4, {3, 2, 1, 0});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  EXPECT_THAT(mesh->GroupRanks("pipeline", 3), ElementsAre(3, 1));  // stage 0 first
  EXPECT_THAT(mesh->GroupRanks("data", 0), ElementsAre(1, 0));
  EXPECT_THAT(mesh->Coordinates(3), ElementsAre(0, 0));
  EXPECT_THAT(mesh->Coordinates(0), ElementsAre(1, 1));
  EXPECT_EQ(mesh->RankAt({1, 0}), 2);
  EXPECT_EQ(mesh->AxisIndex("pipeline", 1), 1);
  EXPECT_EQ(mesh->AllGroups({"data"}), (Groups{{3, 2}, {1, 0}}));
  EXPECT_EQ(mesh->ToString(), "data=2 x pipeline=2 (4 ranks, rank order 3,2,1,0)");
  auto identity = DeviceMesh::Create({{"data", 4}}, 4, {0, 1, 2, 3});
  ASSERT_TRUE(identity.ok());
  EXPECT_TRUE(identity->rank_order().empty());
}

TEST(DeviceMeshTest, ARankOrderThatIsNotAPermutationIsAClearError) {
  for (const std::vector<int>& order : std::vector<std::vector<int>>{{0, 1, 1, 2}, {0, 1, 2}, {1, 2, 3, 4}}) {
    auto mesh = DeviceMesh::Create({{"data", 4}}, 4, order);
    ASSERT_FALSE(mesh.ok());
    EXPECT_THAT(std::string(mesh.status().message()), HasSubstr("is not a permutation of the ranks 0 to 3"));
  }
}

TEST(DeviceMeshTest, InfersTheOneAxisLeftOpen) {
  auto mesh = DeviceMesh::Create({{"tensor", 2}, {"pipeline", 2}, {"data", DeviceMesh::kInferSize}}, 12);
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  EXPECT_EQ(mesh->AxisSize("data"), 3);
  EXPECT_EQ(mesh->AxisSize("expert"), 1);  // an axis the mesh lacks is not split
  EXPECT_FALSE(mesh->HasAxis("expert"));
  EXPECT_THAT(mesh->GroupRanks("expert", 5), ElementsAre(5));
}

TEST(DeviceMeshTest, ExtraAxesNeedNoSpecialCase) {
  auto mesh = DeviceMesh::Create({{"tensor", 2}, {"sequence", 2}, {"expert", 2}, {"pipeline", 1}, {"data", 2}}, 16);
  ASSERT_TRUE(mesh.ok());
  EXPECT_THAT(mesh->GroupRanks("expert", 1), ElementsAre(1, 5));
  EXPECT_THAT(mesh->GroupRanks("data", 1), ElementsAre(1, 9));
  EXPECT_THAT(mesh->GroupRanks("pipeline", 7), ElementsAre(7));
}

TEST(DeviceMeshTest, SizesThatDoNotMultiplyToTheWorldAreAClearError) {
  auto mesh = DeviceMesh::Create({{"tensor", 4}, {"pipeline", 2}, {"data", 2}}, 12);
  ASSERT_FALSE(mesh.ok());
  EXPECT_EQ(mesh.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(mesh.status().message()),
              HasSubstr("tensor=4 x pipeline=2 x data=2 has 16 ranks but the world size is 12"));

  auto uninferable = DeviceMesh::Create({{"tensor", 4}, {"data", DeviceMesh::kInferSize}}, 6);
  ASSERT_FALSE(uninferable.ok());
  EXPECT_THAT(std::string(uninferable.status().message()),
              HasSubstr("cannot infer mesh axis 'data': world size 6 is not divisible by"));
}

TEST(DeviceMeshTest, RejectsRepeatedEmptyOrDoublyInferredAxes) {
  EXPECT_THAT(std::string(DeviceMesh::Create({{"data", 2}, {"data", 2}}, 4).status().message()),
              HasSubstr("'data' appears twice"));
  EXPECT_THAT(std::string(DeviceMesh::Create({{"", 2}}, 2).status().message()), HasSubstr("has no name"));
  EXPECT_THAT(std::string(DeviceMesh::Create({{"tensor", DeviceMesh::kInferSize}, {"data", DeviceMesh::kInferSize}}, 4)
                              .status()
                              .message()),
              HasSubstr("both ask to be inferred"));
  EXPECT_THAT(std::string(DeviceMesh::Create({{"tensor", 0}}, 4).status().message()),
              HasSubstr("sizes must be positive"));
}

}  // namespace
}  // namespace trident
