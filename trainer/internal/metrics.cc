#include "trainer/internal/metrics.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "trainer/internal/tensorboard.pb.h"

namespace trident {
namespace internal {
namespace {

double WallTime() { return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count(); }

}  // namespace

absl::StatusOr<std::unique_ptr<JsonLinesWriter>> JsonLinesWriter::Open(const std::string& path, int64_t first_step) {
  auto writer = std::unique_ptr<JsonLinesWriter>(new JsonLinesWriter());
  const auto parent = std::filesystem::path(path).parent_path();
  std::error_code error;
  if (!parent.empty()) std::filesystem::create_directories(parent, error);
  std::string kept;  // the lines this file keeps: {"step": N, ...} with N <= first_step
  if (first_step > 0) {
    std::ifstream in(path);
    constexpr absl::string_view kPrefix = "{\"step\": ";
    int64_t step = 0;
    for (std::string line; std::getline(in, line);) {
      if (absl::StartsWith(line, kPrefix) &&
          absl::SimpleAtoi(line.substr(kPrefix.size(), line.find_first_of(",}") - kPrefix.size()), &step) &&
          step <= first_step) {
        absl::StrAppend(&kept, line, "\n");
      }
    }
  }
  writer->out_.open(path, std::ios::trunc);
  writer->out_ << kept;
  if (!writer->out_) return absl::InternalError(absl::StrCat("cannot open metrics_file ", path));
  return writer;
}

void JsonLinesWriter::Write(int64_t step, const std::vector<std::pair<std::string, double>>& values) {
  std::string line = absl::StrCat("{\"step\": ", step);
  for (const auto& [key, value] : values) {
    absl::StrAppend(&line, ", \"", key, "\": ", std::isfinite(value) ? absl::StrFormat("%.9g", value) : "null");
  }
  out_ << line << "}\n";
  out_.flush();
}

absl::StatusOr<std::unique_ptr<TensorBoardWriter>> TensorBoardWriter::Open(const std::string& dir) {
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  char host[256] = "localhost";
  gethostname(host, sizeof(host) - 1);
  auto writer = std::unique_ptr<TensorBoardWriter>(new TensorBoardWriter());
  writer->path_ =
      absl::StrCat(dir, "/events.out.tfevents.", static_cast<int64_t>(WallTime()), ".", host, ".", getpid());
  writer->out_.open(writer->path_, std::ios::binary | std::ios::trunc);
  if (!writer->out_) {
    return absl::InternalError(absl::StrCat("cannot write TensorBoard events in ", dir));
  }
  tensorboard::Event event;
  event.set_wall_time(WallTime());
  event.set_file_version("brain.Event:2");
  writer->WriteRecord(event.SerializeAsString());
  return writer;
}

void TensorBoardWriter::Write(int64_t step, const std::vector<std::pair<std::string, double>>& values) {
  tensorboard::Event event;
  event.set_wall_time(WallTime());
  event.set_step(step);
  for (const auto& [tag, value] : values) {
    auto* entry = event.mutable_summary()->add_value();
    entry->set_tag(tag);
    entry->set_simple_value(static_cast<float>(value));
  }
  WriteRecord(event.SerializeAsString());
  out_.flush();
}

void TensorBoardWriter::WriteRecord(const std::string& data) {
  const uint64_t length = data.size();
  const std::string length_bytes(reinterpret_cast<const char*>(&length), sizeof(length));
  const uint32_t length_crc = MaskedCrc32c(length_bytes);
  const uint32_t data_crc = MaskedCrc32c(data);
  out_.write(length_bytes.data(), length_bytes.size());
  out_.write(reinterpret_cast<const char*>(&length_crc), sizeof(length_crc));
  out_.write(data.data(), static_cast<std::streamsize>(data.size()));
  out_.write(reinterpret_cast<const char*>(&data_crc), sizeof(data_crc));
}

uint32_t Crc32c(absl::string_view data) {
  static const auto* table = [] {
    auto* t = new uint32_t[256];
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0x82F63B78u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  uint32_t crc = 0xFFFFFFFFu;
  for (unsigned char byte : data) crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFu;
}

uint32_t MaskedCrc32c(absl::string_view data) {
  const uint32_t crc = Crc32c(data);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

std::string FormatDuration(double seconds) {
  const int64_t s = static_cast<int64_t>(std::llround(std::max(0.0, seconds)));
  if (s >= 3600) return absl::StrFormat("%dh%02dm", s / 3600, (s % 3600) / 60);
  if (s >= 60) return absl::StrFormat("%dm%02ds", s / 60, s % 60);
  return absl::StrCat(s, "s");
}

}  // namespace internal
}  // namespace trident
