// OffloadedTensors: tensors written to the offload file give their memory
// back, are read back exactly, can be read and written in place (mapped), and a bad
// directory is named in the error.
#include "zero/internal/offload.h"

#include <cstdlib>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

namespace trident::zero_internal {
namespace {

std::string Dir() {
  const char* dir = std::getenv("TEST_TMPDIR");
  return dir != nullptr ? dir : "/tmp";
}

TEST(OffloadedTensorsTest, WrittenTensorsFreeTheirMemoryAndReadBackExactly) {
  auto file = OffloadedTensors::Create(Dir(), 0, "test");
  ASSERT_TRUE(file.ok()) << file.status();
  torch::manual_seed(3);
  const at::Tensor a = torch::randn({1000}), b = torch::randn({7, 3});
  const at::Tensor a0 = a.clone(), b0 = b.clone();
  EXPECT_FALSE((*file)->InFile(4));
  (*file)->StartWrite(4, {a, b});
  ASSERT_TRUE((*file)->Wait(4).ok());
  EXPECT_TRUE((*file)->InFile(4));
  EXPECT_EQ(a.storage().nbytes(), 0u);  // the memory is gone, the tensor keeps its shape
  EXPECT_EQ(b.sizes(), (std::vector<int64_t>{7, 3}));
  auto mapped = (*file)->Mapped(4, 1);
  ASSERT_TRUE(mapped.ok()) << mapped.status();
  EXPECT_TRUE(at::equal(*mapped, b0));
  (*file)->StartRead(4, {a, b});
  ASSERT_TRUE((*file)->WaitAll().ok());
  EXPECT_TRUE(at::equal(a, a0));
  EXPECT_TRUE(at::equal(b, b0));
  EXPECT_EQ((*file)->bytes_written(), (1000 + 21) * 4);
  EXPECT_EQ((*file)->bytes_read(), (1000 + 21) * 4);
  // A second slot lies elsewhere in the file: the first keeps its values.
  const at::Tensor c = torch::full({10}, 2.5);
  (*file)->StartWrite(5, {c});
  (*file)->StartWrite(4, {a, b});
  ASSERT_TRUE((*file)->WaitAll().ok());
  (*file)->StartRead(4, {a, b});
  (*file)->StartRead(5, {c});
  ASSERT_TRUE((*file)->WaitAll().ok());
  EXPECT_TRUE(at::equal(a, a0));
  EXPECT_TRUE(at::equal(c, torch::full({10}, 2.5)));
}

TEST(OffloadedTensorsTest, AWritableMappingChangesWhatTheNextReadSees) {
  auto file = OffloadedTensors::Create(Dir(), 0, "test");
  ASSERT_TRUE(file.ok()) << file.status();
  const at::Tensor a = torch::zeros({5000});
  (*file)->StartWrite(0, {a});
  ASSERT_TRUE((*file)->WaitAll().ok());
  {
    auto mapped = (*file)->Mapped(0, 0, /*writable=*/true);
    ASSERT_TRUE(mapped.ok()) << mapped.status();
    mapped->narrow(0, 4990, 10).fill_(7.0);
  }
  (*file)->StartRead(0, {a});
  ASSERT_TRUE((*file)->WaitAll().ok());
  EXPECT_EQ(a.sum().item<float>(), 70.0f);
}

TEST(OffloadedTensorsTest, AMissingDirectoryIsNamed) {
  auto file = OffloadedTensors::Create("/nonexistent/offload", 1, "test");
  ASSERT_FALSE(file.ok());
  EXPECT_THAT(std::string(file.status().message()), ::testing::HasSubstr("offload_dir '/nonexistent/offload'"));
}

}  // namespace
}  // namespace trident::zero_internal
