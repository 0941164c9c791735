// CheckpointReader: every safetensors file of a checkpoint, memory-mapped, read
// slice by slice.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include <ATen/ATen.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/internal/safetensors_header.h"

namespace trident {

namespace fs = std::filesystem;

struct CheckpointReader::File {
  std::string path;
  const char* data = nullptr;  // the whole file, mapped read-only
  size_t size = 0;
  ~File() {
    if (data != nullptr) munmap(const_cast<char*>(data), size);
  }
};

struct CheckpointReader::Stored {
  TensorSlice slice;
  at::ScalarType dtype;
  const File* file;
  uint64_t begin = 0;  // byte offset of the piece's data in the file
};

namespace {

absl::Status Errno(const std::string& what, const std::string& path) {
  return absl::NotFoundError(absl::StrCat("cannot ", what, " checkpoint file ", path, ": ", std::strerror(errno)));
}

}  // namespace

CheckpointReader::~CheckpointReader() = default;

absl::StatusOr<std::unique_ptr<CheckpointReader>> CheckpointReader::Open(const std::string& path) {
  std::unique_ptr<CheckpointReader> reader(new CheckpointReader());
  reader->path_ = path;
  std::vector<std::string> paths;
  std::error_code error;
  if (fs::is_directory(path, error)) {
    for (const auto& entry : fs::directory_iterator(path, error)) {
      if (entry.is_regular_file() && absl::EndsWith(entry.path().string(), ".safetensors")) {
        paths.push_back(entry.path().string());
      }
    }
    std::sort(paths.begin(), paths.end());
    if (paths.empty()) {
      return absl::NotFoundError(absl::StrCat("checkpoint ", path, " holds no .safetensors files"));
    }
  } else if (fs::exists(path, error)) {
    paths.push_back(path);
  } else {
    return absl::NotFoundError(absl::StrCat("checkpoint ", path, " does not exist"));
  }
  for (const std::string& file_path : paths) {
    auto file = std::make_unique<File>();
    file->path = file_path;
    const int fd = open(file_path.c_str(), O_RDONLY);
    if (fd < 0) return Errno("open", file_path);
    struct stat info;
    if (fstat(fd, &info) != 0) {
      close(fd);
      return Errno("stat", file_path);
    }
    file->size = static_cast<size_t>(info.st_size);
    if (file->size > 0) {
      void* mapped = mmap(nullptr, file->size, PROT_READ, MAP_PRIVATE, fd, 0);
      if (mapped == MAP_FAILED) {
        close(fd);
        return Errno("map", file_path);
      }
      file->data = static_cast<const char*>(mapped);
    }
    close(fd);
    TRIDENT_ASSIGN_OR_RETURN(internal::SafetensorsHeader header,
                             internal::ParseSafetensorsHeader(file_path, file->data, file->size));
    const std::string file_name = fs::path(file_path).filename().string();
    for (const internal::SafetensorsEntry& e : header.entries) {
      Stored stored{TensorSlice::Whole(e.shape), e.dtype, file.get(), e.begin};
      auto described = header.metadata.find("slice:" + e.name);
      if (described != header.metadata.end()) {
        auto slice = TensorSlice::Decode(described->second);
        if (!slice.ok()) {
          return absl::DataLossError(
              absl::StrCat("checkpoint file ", file_path, ": tensor '", e.name, "': ", slice.status().message()));
        }
        if (slice->numel() != c10::multiply_integers(e.shape)) {
          return absl::DataLossError(absl::StrCat("checkpoint file ", file_path, ": tensor '", e.name, "' holds ",
                                                  c10::multiply_integers(e.shape), " elements but its slice says ",
                                                  slice->numel()));
        }
        stored.slice = *std::move(slice);
      }
      auto& pieces = reader->stored_[e.name];
      if (!pieces.empty() && pieces.front().slice.full_shape != stored.slice.full_shape) {
        return absl::DataLossError(absl::StrCat("checkpoint ", path, ": tensor '", e.name, "' has full shape [",
                                                absl::StrJoin(pieces.front().slice.full_shape, ", "), "] in ",
                                                pieces.front().file->path, " but [",
                                                absl::StrJoin(stored.slice.full_shape, ", "), "] in ", file_path));
      }
      // Replicas (the same slice in several files) are read from the first.
      const bool copy =
          std::any_of(pieces.begin(), pieces.end(), [&](const Stored& other) { return other.slice == stored.slice; });
      if (!copy) pieces.push_back(std::move(stored));
    }
    reader->metadata_[file_name] = std::move(header.metadata);
    reader->files_.push_back(std::move(file));
  }
  return reader;
}

bool CheckpointReader::Contains(const std::string& name) const { return stored_.count(name) > 0; }

std::map<std::string, std::vector<int64_t>> CheckpointReader::FullShapes() const {
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& [name, pieces] : stored_) shapes[name] = pieces.front().slice.full_shape;
  return shapes;
}

absl::Status CheckpointReader::Read(const std::string& name, const TensorSlice& slice, at::Tensor& target) const {
  auto found = stored_.find(name);
  if (found == stored_.end()) {
    return absl::NotFoundError(absl::StrCat("checkpoint ", path_, " has no tensor '", name, "'"));
  }
  const std::vector<Stored>& pieces = found->second;
  if (pieces.front().slice.full_shape != slice.full_shape) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint ", path_, ": tensor '", name, "' has shape [",
                                                   absl::StrJoin(pieces.front().slice.full_shape, ", "),
                                                   "] but the model's is [", absl::StrJoin(slice.full_shape, ", "),
                                                   "]; the checkpoint is for another model size"));
  }
  if (!target.is_contiguous() || target.numel() != slice.numel()) {
    return absl::InternalError(absl::StrCat("reading '", name, "': the target holds ", target.numel(),
                                            " elements, its slice ", slice.numel()));
  }
  at::Tensor flat = target.view({-1});
  at::Tensor covered = at::zeros({slice.numel()}, at::kByte);
  TRIDENT_RETURN_IF_ERROR(CatchExceptions(absl::StrCat("reading tensor '", name, "'"), [&] {
    for (const Stored& piece : pieces) {
      const int64_t numel = piece.slice.numel();
      // The mapping is read-only; the tensor is only ever read from.
      at::Tensor data = at::from_blob(const_cast<char*>(piece.file->data + piece.begin), {numel},
                                      at::TensorOptions().dtype(piece.dtype));
      const int64_t copied = CopyOverlap(piece.slice, data, slice, flat, &covered);
      bytes_read_ += copied * static_cast<int64_t>(c10::elementSize(piece.dtype));
    }
  }));
  const int64_t missing = slice.numel() - covered.sum().item<int64_t>();
  if (missing > 0) {
    return absl::DataLossError(
        absl::StrCat("checkpoint ", path_, " lacks ", missing, " of the ", slice.numel(), " elements of tensor '", name,
                     "' this rank needs: a file of the checkpoint is missing; resume from another checkpoint"));
  }
  return absl::OkStatus();
}

absl::StatusOr<at::Tensor> CheckpointReader::ReadWhole(const std::string& name) const {
  auto found = stored_.find(name);
  if (found == stored_.end()) {
    return absl::NotFoundError(absl::StrCat("checkpoint ", path_, " has no tensor '", name, "'"));
  }
  at::Tensor whole =
      at::empty(found->second.front().slice.full_shape, at::TensorOptions().dtype(found->second.front().dtype));
  TRIDENT_RETURN_IF_ERROR(Read(name, TensorSlice::Whole(whole.sizes().vec()), whole));
  return whole;
}

std::vector<CheckpointReader::Piece> CheckpointReader::Pieces() const {
  std::vector<Piece> pieces;
  for (const auto& [name, stored] : stored_) {
    for (const Stored& s : stored) {
      pieces.push_back({name, s.slice, s.dtype, fs::path(s.file->path).filename().string(),
                        s.slice.numel() * static_cast<int64_t>(c10::elementSize(s.dtype))});
    }
  }
  return pieces;
}

}  // namespace trident
