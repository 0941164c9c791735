// Where training metrics go: a JSON-lines file, TensorBoard event files, and
// the console (a progress bar on a terminal, log lines otherwise).
#ifndef TRIDENT_TRAINER_INTERNAL_METRICS_H_
#define TRIDENT_TRAINER_INTERNAL_METRICS_H_

#include <cstdint>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace trident {
namespace internal {

// Appends one JSON object per call: {"step": 10, "loss": 2.5, ...}. Open
// keeps the file's lines of steps up to `first_step` (a resumed run's
// history) and drops the rest, so a run started again, or resumed from an
// earlier checkpoint, does not leave two lines for one step.
class JsonLinesWriter {
 public:
  static absl::StatusOr<std::unique_ptr<JsonLinesWriter>> Open(const std::string& path, int64_t first_step = 0);
  void Write(int64_t step, const std::vector<std::pair<std::string, double>>& values);

 private:
  std::ofstream out_;
};

// Writes scalars as TensorBoard event records (length, masked CRC-32C, Event
// protobuf, masked CRC-32C) to `dir`/events.out.tfevents.<time>.<host>.
class TensorBoardWriter {
 public:
  static absl::StatusOr<std::unique_ptr<TensorBoardWriter>> Open(const std::string& dir);
  void Write(int64_t step, const std::vector<std::pair<std::string, double>>& values);
  const std::string& path() const { return path_; }

 private:
  void WriteRecord(const std::string& data);
  std::string path_;
  std::ofstream out_;
};

// CRC-32C (Castagnoli), as TFRecord framing uses, and its masked form.
uint32_t Crc32c(absl::string_view data);
uint32_t MaskedCrc32c(absl::string_view data);

// "1h02m", "3m20s", "12s".
std::string FormatDuration(double seconds);

}  // namespace internal
}  // namespace trident

#endif  // TRIDENT_TRAINER_INTERNAL_METRICS_H_
