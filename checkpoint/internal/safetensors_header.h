// The parsed header of a safetensors file. Private to //checkpoint.
#ifndef TRIDENT_CHECKPOINT_INTERNAL_SAFETENSORS_HEADER_H_
#define TRIDENT_CHECKPOINT_INTERNAL_SAFETENSORS_HEADER_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>

#include "absl/status/statusor.h"

namespace trident::internal {

struct SafetensorsEntry {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets into the file (header included)
  uint64_t end = 0;
};

struct SafetensorsHeader {
  std::vector<SafetensorsEntry> entries;  // in file order
  std::map<std::string, std::string> metadata;
};

// Parses the header of the file `path` whose `size` bytes are at `data` (read
// or memory-mapped; only the header is touched). Errors name the file and what
// is malformed.
absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(const std::string& path, const char* data, uint64_t size);

}  // namespace trident::internal

#endif  // TRIDENT_CHECKPOINT_INTERNAL_SAFETENSORS_HEADER_H_
