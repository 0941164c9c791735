// checkpoint: the safetensors format and checkpoint directories with manifests.
//
// A checkpoint is `save_dir/step_N/`: files written by the ranks plus a
// `manifest.pbtxt` listing every file with its size and CRC-32. Directories are
// written under a temporary name and renamed only when complete; `last` and
// `best` are symbolic links; `keep_last_n` prunes old steps (never `best`).
//
//   CheckpointDirectory dir(save_dir);
//   std::string staging = dir.StagingPath(step);     // every rank writes here
//   ... barrier ...
//   if (rank == 0) dir.Commit(step, world_size, val_loss, keep_last_n);
//   ...
//   TRIDENT_ASSIGN_OR_RETURN(ResolvedCheckpoint found, dir.Resolve("last"));
#ifndef TRIDENT_CHECKPOINT_CHECKPOINT_H_
#define TRIDENT_CHECKPOINT_CHECKPOINT_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "base/tensors.h"
#include "checkpoint/manifest.pb.h"

namespace trident {

// Writes `tensors` (CPU, any of F64/F32/F16/BF16/I64/I32/I16/I8/U8/BOOL) in the
// safetensors format: an 8-byte little-endian header length, a JSON header with
// dtype, shape and data offsets per tensor (plus string `metadata`), then the data.
absl::Status WriteSafetensors(const std::string& path, const NamedTensors& tensors,
                              const std::map<std::string, std::string>& metadata = {});

struct SafetensorsContents {
  NamedTensors tensors;  // in file order
  std::map<std::string, std::string> metadata;
  // The tensor called `name`, or an error naming the file.
  absl::StatusOr<at::Tensor> Get(const std::string& name) const;
  std::string path;
};
// Reads a safetensors file; errors name the file and what is malformed.
absl::StatusOr<SafetensorsContents> ReadSafetensors(const std::string& path);

// zlib CRC-32 of the file at `path`, and its size.
absl::StatusOr<std::pair<uint32_t, int64_t>> FileChecksum(const std::string& path);

struct ResolvedCheckpoint {
  std::string path;                // the step_N directory
  CheckpointManifest manifest;
  std::vector<std::string> skipped;  // newer checkpoints refused, each with the reason
};

class CheckpointDirectory {
 public:
  explicit CheckpointDirectory(std::string save_dir) : save_dir_(std::move(save_dir)) {}

  // Where the ranks write step `step` before it is committed (created if needed).
  absl::StatusOr<std::string> StagingPath(int64_t step) const;
  // Rank 0, after every rank wrote its files: writes the manifest, renames the
  // staging directory to step_N, points `last` (and `best` when `val_loss` is the
  // lowest so far) at it, and deletes the oldest steps beyond `keep_last_n` (0: keep all).
  absl::Status Commit(int64_t step, int world_size, std::optional<double> val_loss,
                      int keep_last_n) const;
  // Checks a step directory against its manifest; errors name the file at fault.
  static absl::StatusOr<CheckpointManifest> Validate(const std::string& checkpoint_path);
  // `which`: "last" (the newest valid step, listing the newer ones refused), "best",
  // or a path to a step directory (refused when invalid).
  absl::StatusOr<ResolvedCheckpoint> Resolve(const std::string& which) const;

  const std::string& save_dir() const { return save_dir_; }

 private:
  std::string save_dir_;
};

}  // namespace trident

#endif  // TRIDENT_CHECKPOINT_CHECKPOINT_H_
