#include "base/status.h"

#include <stdexcept>

#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace trident {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

absl::StatusOr<int> Half(int x) {
  if (x % 2 != 0) return absl::InvalidArgumentError("odd");
  return x / 2;
}

absl::StatusOr<int> Quarter(int x) {
  TRIDENT_ASSIGN_OR_RETURN(int half, Half(x));
  TRIDENT_ASSIGN_OR_RETURN(int quarter, Half(half));
  return quarter;
}

absl::Status CheckEven(int x) {
  TRIDENT_RETURN_IF_ERROR(Half(x).status());
  return absl::OkStatus();
}

TEST(StatusMacrosTest, AssignOrReturnPropagatesTheFirstError) {
  EXPECT_EQ(*Quarter(8), 2);
  EXPECT_EQ(Quarter(6).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(CheckEven(4).ok());
  EXPECT_EQ(CheckEven(5).message(), "odd");
}

TEST(CatchExceptionsTest, ConvertsC10ErrorWithoutBacktrace) {
  absl::Status status = CatchExceptions("adding tensors", [] { TORCH_CHECK(false, "shape mismatch"); });
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(status.message()), HasSubstr("adding tensors: shape mismatch"));
  EXPECT_THAT(std::string(status.message()), Not(HasSubstr("frame #")));
}

TEST(CatchExceptionsTest, MapsInvalidArgumentAndPassesSuccess) {
  EXPECT_EQ(CatchExceptions("parsing", [] { throw std::invalid_argument("bad"); }).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(CatchExceptions("nothing", [] {}).ok());
}

TEST(ExitCodeForTest, NonOkIsOne) {
  EXPECT_EQ(ExitCodeFor("prog", absl::OkStatus()), 0);
  EXPECT_EQ(ExitCodeFor("prog", absl::NotFoundError("missing file x")), 1);
}

}  // namespace
}  // namespace trident
