#include "base/flags_help.h"

#include <gflags/gflags.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

DEFINE_int32(help_test_ranks, 4, "ranks to start");

namespace trident::internal {
extern const unsigned char kHelpTestDescriptor[];
extern const size_t kHelpTestDescriptorSize;
}  // namespace trident::internal

namespace trident {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(FlagsHelpTest, MessageFieldsBecomeFlagsWithTypesDefaultsAndComments) {
  auto help =
      MessageFlagsHelp(internal::kHelpTestDescriptor, internal::kHelpTestDescriptorSize, "trident.help_test.Config");
  ASSERT_TRUE(help.ok()) << help.status();
  EXPECT_EQ(*help,
            "Config (base/testdata/help_test.proto):\n"
            "  --steps (int64, default: 300)\n"
            "      Steps to train.\n"
            "  --name (string, default: \"run\")\n"
            "      printed first\n"
            "  --model.FIELD (Model, below)\n"
            "  --tags (list of string, one per flag)\n"
            "  --rate (double, default: unset)\n"
            "\n"
            "--model.FIELD (Model):\n"
            "  --model.type (string, default: unset)\n"
            "      a registered model\n"
            "  --model.args.KEY (string, one entry per flag)\n"
            "      the model's arguments\n");
  EXPECT_FALSE(
      MessageFlagsHelp(internal::kHelpTestDescriptor, internal::kHelpTestDescriptorSize, "trident.help_test.Other")
          .ok());
  const unsigned char garbage[] = {0xff, 0xff, 0xff};
  EXPECT_THAT(std::string(MessageFlagsHelp(garbage, sizeof(garbage), "x").status().message()),
              HasSubstr("does not parse"));
}

TEST(FlagsHelpTest, OwnFlagsAreThoseOfTheDefiningFile) {
  const std::string help = OwnFlagsHelp(__FILE__);
  EXPECT_THAT(help, HasSubstr("  --help_test_ranks (int32, default: 4)\n      ranks to start\n"));
  EXPECT_THAT(help, Not(HasSubstr("--helpfull")));  // gflags' own
  EXPECT_THAT(help, Not(HasSubstr("caffe2")));
}

TEST(FlagsHelpTest, HelpIsRequestedByHelpHOrHelpshortButNotHelpfull) {
  auto requested = [](std::vector<std::string> args) {
    std::vector<char*> argv = {const_cast<char*>("program")};
    for (std::string& arg : args) argv.push_back(arg.data());
    return HelpRequested(static_cast<int>(argv.size()), argv.data());
  };
  EXPECT_TRUE(requested({"--lr=1", "--help"}));
  EXPECT_TRUE(requested({"-h"}));
  EXPECT_TRUE(requested({"--helpshort"}));
  EXPECT_FALSE(requested({"--helpfull"}));
  EXPECT_FALSE(requested({"--", "train", "--help"}));  // the launched program's
}

}  // namespace
}  // namespace trident
