#include "trainer/internal/metrics.h"

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "trainer/internal/tensorboard.pb.h"

namespace trident {
namespace internal {
namespace {

std::string TempDir() {
  const char* dir = std::getenv("TEST_TMPDIR");
  return dir != nullptr ? dir : "/tmp";
}

TEST(Crc32cTest, KnownVectors) {
  EXPECT_EQ(Crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(Crc32c(""), 0u);
}

// Reads back every record: framing, both checksums, and the Event inside.
TEST(TensorBoardWriterTest, RecordsAreFramedAndChecksummedEvents) {
  auto writer = TensorBoardWriter::Open(TempDir() + "/tb");
  ASSERT_TRUE(writer.ok()) << writer.status();
  (*writer)->Write(3, {{"loss", 2.5}, {"lr", 1e-3}});
  (*writer)->Write(4, {{"loss", 2.25}});
  std::ifstream in((*writer)->path(), std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), {});
  std::vector<tensorboard::Event> events;
  size_t pos = 0;
  while (pos < bytes.size()) {
    uint64_t length;
    uint32_t length_crc, data_crc;
    std::memcpy(&length, bytes.data() + pos, 8);
    std::memcpy(&length_crc, bytes.data() + pos + 8, 4);
    ASSERT_EQ(length_crc, MaskedCrc32c(bytes.substr(pos, 8)));
    const std::string data = bytes.substr(pos + 12, length);
    std::memcpy(&data_crc, bytes.data() + pos + 12 + length, 4);
    ASSERT_EQ(data_crc, MaskedCrc32c(data));
    events.emplace_back();
    ASSERT_TRUE(events.back().ParseFromString(data));
    pos += 12 + length + 4;
  }
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[0].file_version(), "brain.Event:2");
  EXPECT_EQ(events[1].step(), 3);
  EXPECT_EQ(events[1].summary().value(0).tag(), "loss");
  EXPECT_EQ(events[1].summary().value(0).simple_value(), 2.5f);
  EXPECT_EQ(events[2].summary().value(0).simple_value(), 2.25f);
}

TEST(JsonLinesWriterTest, OneObjectPerLine) {
  const std::string path = TempDir() + "/metrics/m.jsonl";
  {
    auto writer = JsonLinesWriter::Open(path);
    ASSERT_TRUE(writer.ok());
    (*writer)->Write(1, {{"loss", 2.5}, {"grad_norm", 0.125}});
    (*writer)->Write(2, {{"loss", 1.0 / 0.0}});
  }
  std::ifstream in(path);
  std::string first, second;
  std::getline(in, first);
  std::getline(in, second);
  EXPECT_EQ(first, "{\"step\": 1, \"loss\": 2.5, \"grad_norm\": 0.125}");
  EXPECT_EQ(second, "{\"step\": 2, \"loss\": null}");
}

// A run started again rewrites the file; one resumed after step 2 keeps
// steps 1 and 2 and drops the later lines it will write again.
TEST(JsonLinesWriterTest, KeepsTheStepsBeforeTheRunStarts) {
  const std::string path = TempDir() + "/metrics/again.jsonl";
  auto write_steps = [&](int64_t first_step, int64_t last_step, double loss) {
    auto writer = JsonLinesWriter::Open(path, first_step);
    ASSERT_TRUE(writer.ok()) << writer.status();
    for (int64_t step = first_step + 1; step <= last_step; ++step) (*writer)->Write(step, {{"loss", loss}});
  };
  auto lines = [&] {
    std::ifstream in(path);
    std::vector<std::string> out;
    for (std::string line; std::getline(in, line);) out.push_back(line);
    return out;
  };
  write_steps(0, 3, 1.0);
  write_steps(0, 2, 2.0);  // started again: nothing of the first run stays
  EXPECT_EQ(lines(), (std::vector<std::string>{"{\"step\": 1, \"loss\": 2}", "{\"step\": 2, \"loss\": 2}"}));
  write_steps(0, 12, 3.0);
  write_steps(10, 11, 4.0);  // resumed after step 10: steps 1-10 stay, 11 is new, 12 is gone
  const std::vector<std::string> resumed = lines();
  ASSERT_EQ(resumed.size(), 11u);
  EXPECT_EQ(resumed[9], "{\"step\": 10, \"loss\": 3}");
  EXPECT_EQ(resumed[10], "{\"step\": 11, \"loss\": 4}");
}

TEST(FormatDurationTest, Units) {
  EXPECT_EQ(FormatDuration(12.4), "12s");
  EXPECT_EQ(FormatDuration(200), "3m20s");
  EXPECT_EQ(FormatDuration(3725), "1h02m");
}

}  // namespace
}  // namespace internal
}  // namespace trident
