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
//   if (rank == 0) dir.Commit(step, world_size, val_loss, keep_last_n, file_names);
//   ...
//   TRIDENT_ASSIGN_OR_RETURN(ResolvedCheckpoint found, dir.Resolve("last"));
#ifndef TRIDENT_CHECKPOINT_CHECKPOINT_H_
#define TRIDENT_CHECKPOINT_CHECKPOINT_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "base/tensors.h"
#include "checkpoint/manifest.pb.h"

namespace trident {

// A file's zlib CRC-32 and size, as checkpoint manifests record them.
struct Checksum {
  uint32_t crc32 = 0;
  int64_t size = 0;
};

// Writes `tensors` (CPU, any of F64/F32/F16/BF16/I64/I32/I16/I8/U8/BOOL) in the
// safetensors format: an 8-byte little-endian header length, a JSON header with
// dtype, shape and data offsets per tensor (plus string `metadata`), then the data.
// `checksum`, when given, receives the file's, computed while writing. Errors
// say why (disk full, permission denied); a partly written file is removed.
absl::Status WriteSafetensors(const std::string& path, const NamedTensors& tensors,
                              const std::map<std::string, std::string>& metadata = {}, Checksum* checksum = nullptr);

struct SafetensorsContents {
  NamedTensors tensors;  // in file order
  std::map<std::string, std::string> metadata;
  // The tensor called `name`, or an error naming the file.
  absl::StatusOr<at::Tensor> Get(const std::string& name) const;
  std::string path;
};
// Reads a safetensors file; errors name the file and what is malformed.
absl::StatusOr<SafetensorsContents> ReadSafetensors(const std::string& path);

// One box of a single-process tensor that a stored piece holds, and where its
// elements sit in the piece's flat data: element `offsets + i` of the full
// tensor is data[data_offset + sum(i[d] * data_strides[d])].
struct SliceSegment {
  std::vector<int64_t> offsets;  // first index per dimension in the full tensor
  std::vector<int64_t> lengths;
  int64_t data_offset = 0;
  std::vector<int64_t> data_strides;
  bool operator==(const SliceSegment& other) const;
};

// Which elements of a single-process tensor ("the full tensor") one rank's
// piece holds, and where in the piece's data: a whole tensor, a
// tensor-parallel shard, a ZeRO chunk's part of either. Checkpoints record
// every tensor this way, so any layout can read any other's pieces.
struct TensorSlice {
  std::vector<int64_t> full_shape;
  std::vector<SliceSegment> segments;  // disjoint
  // The shape of the piece's data (the shard's shape; [n] for flat parts).
  std::vector<int64_t> local_shape;

  static TensorSlice Whole(std::vector<int64_t> shape);
  // Tensor parallelism: dimension `dim` holds `blocks` equal blocks (fused
  // q, k, v: 3), each cut into `parts`; the piece is part `index` of every
  // block, concatenated along `dim`.
  static TensorSlice BlockShard(std::vector<int64_t> full_shape, int64_t dim, int64_t blocks, int64_t index,
                                int64_t parts);
  // Elements [begin, end) of the row-major flattening of this piece's data
  // (ZeRO's chunk of a parameter). This piece must not be a flat part itself.
  TensorSlice FlatRange(int64_t begin, int64_t end) const;

  int64_t numel() const;  // elements held
  bool whole() const;     // the full tensor, in row-major order
  bool operator==(const TensorSlice& other) const {
    return full_shape == other.full_shape && segments == other.segments;
  }
  // Text form stored in checkpoint files, and its parsing (errors name the text).
  std::string Encode() const;
  static absl::StatusOr<TensorSlice> Decode(const std::string& text);
};

// One piece of a named tensor of the single-process model with its slice;
// `data` holds slice.numel() elements (contiguous).
struct SlicedTensor {
  std::string name;
  TensorSlice slice;
  at::Tensor data;
};

// Writes pieces in the safetensors format: whole tensors under their name and
// shape (any safetensors reader loads them by name), other pieces flat, their
// slices in the metadata.
absl::Status WriteSlicedSafetensors(const std::string& path, const std::vector<SlicedTensor>& pieces,
                                    std::map<std::string, std::string> metadata = {}, Checksum* checksum = nullptr);

// Copies the elements that `source` (its data at `source_data`) and `target`
// (its data `target_data`) both hold, marking them in `covered` (a byte
// tensor of target_data's size) when given. Returns the elements copied.
int64_t CopyOverlap(const TensorSlice& source, const at::Tensor& source_data, const TensorSlice& target,
                    at::Tensor& target_data, at::Tensor* covered = nullptr);

// Reads named tensors from every safetensors file of a checkpoint directory
// (or one file) in any layout: files are memory-mapped and each read copies
// only the byte ranges of the pieces that overlap the slice asked for.
class CheckpointReader {
 public:
  static absl::StatusOr<std::unique_ptr<CheckpointReader>> Open(const std::string& path);
  ~CheckpointReader();
  CheckpointReader(const CheckpointReader&) = delete;
  CheckpointReader& operator=(const CheckpointReader&) = delete;

  bool Contains(const std::string& name) const;
  // Every tensor's name with its full shape, in name order.
  std::map<std::string, std::vector<int64_t>> FullShapes() const;
  // Fills `target` (contiguous, slice.numel() elements, any dtype) with the
  // elements `slice` of tensor `name` holds. Errors name the tensor and what
  // is missing or mismatched.
  absl::Status Read(const std::string& name, const TensorSlice& slice, at::Tensor& target) const;
  // The whole tensor, in its stored dtype.
  absl::StatusOr<at::Tensor> ReadWhole(const std::string& name) const;
  // The stored pieces: for `inspect`, with the file each comes from.
  struct Piece {
    std::string name;
    TensorSlice slice;
    at::ScalarType dtype;
    std::string file;
    int64_t bytes = 0;
  };
  std::vector<Piece> Pieces() const;
  // The metadata of each file, by file name.
  const std::map<std::string, std::map<std::string, std::string>>& metadata() const { return metadata_; }
  // Bytes of stored data copied by reads so far.
  int64_t bytes_read() const { return bytes_read_; }
  const std::string& path() const { return path_; }

 private:
  struct File;
  struct Stored;
  CheckpointReader() = default;
  std::string path_;
  std::vector<std::unique_ptr<File>> files_;
  std::map<std::string, std::vector<Stored>> stored_;
  std::map<std::string, std::map<std::string, std::string>> metadata_;
  mutable int64_t bytes_read_ = 0;
};

// The checksum of the file at `path`, read whole.
absl::StatusOr<Checksum> FileChecksum(const std::string& path);

struct ResolvedCheckpoint {
  std::string path;  // the step_N directory
  CheckpointManifest manifest;
  std::vector<std::string> skipped;  // newer checkpoints refused, each with the reason
};

class CheckpointDirectory {
 public:
  explicit CheckpointDirectory(std::string save_dir) : save_dir_(std::move(save_dir)) {}

  // Where the ranks write step `step` before it is committed (created if needed).
  absl::StatusOr<std::string> StagingPath(int64_t step) const;
  // Rank 0, after every rank wrote its files: writes the manifest of `files`
  // (names in the staging directory with the checksums their writers computed;
  // any other file there, left by an earlier attempt, is removed), renames the
  // staging directory to step_N, points `last` (and `best` when `val_loss` is
  // the lowest so far) at it, and deletes the oldest steps beyond `keep_last_n`
  // (0: keep all). Errors name a file that is missing or of another size.
  absl::Status Commit(int64_t step, int world_size, std::optional<double> val_loss, int keep_last_n,
                      const std::map<std::string, Checksum>& files) const;
  // Checks a step directory against its manifest: every file's size, and the
  // CRC-32 of the files numbered shard, shard + shards, ... in the manifest (so
  // that ranks split the reading); errors name the file at fault.
  static absl::StatusOr<CheckpointManifest> Validate(const std::string& checkpoint_path, int shard = 0, int shards = 1);
  using Validator = std::function<absl::StatusOr<CheckpointManifest>(const std::string& checkpoint_path)>;
  // `which`: "last" (the newest valid step, listing the newer ones refused), "best",
  // or a path to a step directory (refused when invalid). `validate` (default:
  // Validate of every file) judges each candidate.
  absl::StatusOr<ResolvedCheckpoint> Resolve(const std::string& which, const Validator& validate = nullptr) const;

  const std::string& save_dir() const { return save_dir_; }

 private:
  std::string save_dir_;
};

}  // namespace trident

#endif  // TRIDENT_CHECKPOINT_CHECKPOINT_H_
