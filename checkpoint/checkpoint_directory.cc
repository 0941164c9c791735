#include <zlib.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <google/protobuf/text_format.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "base/status.h"
#include "checkpoint/checkpoint.h"

namespace trident {
namespace {

namespace fs = std::filesystem;

constexpr char kManifest[] = "manifest.pbtxt";

std::string StepName(int64_t step) { return absl::StrCat("step_", step); }

// Step directories of `save_dir`, newest first.
std::vector<std::pair<int64_t, fs::path>> StepDirectories(const std::string& save_dir) {
  std::vector<std::pair<int64_t, fs::path>> steps;
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(save_dir, error)) {
    const std::string filename = entry.path().filename().string();
    absl::string_view name = filename;
    int64_t step;
    if (entry.is_directory() && !entry.is_symlink() && absl::ConsumePrefix(&name, "step_") &&
        absl::SimpleAtoi(name, &step)) {
      steps.emplace_back(step, entry.path());
    }
  }
  std::sort(steps.begin(), steps.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  return steps;
}

// Points symlink `link` at `target` (a name relative to the link's directory) atomically.
absl::Status PointLink(const fs::path& link, const std::string& target) {
  const fs::path temporary = link.string() + ".new";
  std::error_code error;
  fs::remove(temporary, error);
  fs::create_directory_symlink(target, temporary, error);
  if (!error) fs::rename(temporary, link, error);
  if (error) {
    return absl::InternalError(absl::StrCat("cannot point ", link.string(), " at ", target, ": ", error.message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<CheckpointManifest> ReadManifest(const fs::path& directory) {
  std::ifstream in(directory / kManifest);
  if (!in) {
    return absl::DataLossError(
        absl::StrCat("checkpoint ", directory.string(), " has no ", kManifest, ": it was not completely written"));
  }
  std::stringstream text;
  text << in.rdbuf();
  CheckpointManifest manifest;
  if (!google::protobuf::TextFormat::ParseFromString(text.str(), &manifest)) {
    return absl::DataLossError(absl::StrCat("checkpoint manifest ", (directory / kManifest).string(), " is corrupt"));
  }
  return manifest;
}

}  // namespace

absl::StatusOr<Checksum> FileChecksum(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  uLong crc = crc32(0L, Z_NULL, 0);
  int64_t size = 0;
  std::vector<char> buffer(1 << 20);
  while (in) {
    in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
    const std::streamsize n = in.gcount();
    crc = crc32(crc, reinterpret_cast<const Bytef*>(buffer.data()), static_cast<uInt>(n));
    size += n;
  }
  return Checksum{static_cast<uint32_t>(crc), size};
}

absl::StatusOr<std::string> CheckpointDirectory::StagingPath(int64_t step) const {
  const fs::path path = fs::path(save_dir_) / absl::StrCat(".", StepName(step), ".staging");
  std::error_code error;
  fs::create_directories(path, error);
  if (error) {
    return absl::InternalError(
        absl::StrCat("cannot create checkpoint directory ", path.string(), ": ", error.message(), "; check save_dir"));
  }
  return path.string();
}

absl::Status CheckpointDirectory::Commit(int64_t step, int world_size, std::optional<double> val_loss, int keep_last_n,
                                         const std::map<std::string, Checksum>& files) const {
  TRIDENT_ASSIGN_OR_RETURN(const std::string staging, StagingPath(step));
  CheckpointManifest manifest;
  manifest.set_step(step);
  manifest.set_world_size(world_size);
  if (val_loss) manifest.set_val_loss(*val_loss);
  std::error_code error;
  for (const auto& entry : fs::recursive_directory_iterator(staging, error)) {
    if (entry.is_regular_file() && files.count(fs::relative(entry.path(), staging).string()) == 0) {
      fs::remove(entry.path(), error);
    }
  }
  for (const auto& [name, checksum] : files) {  // in name order
    const std::string path = (fs::path(staging) / name).string();
    const uintmax_t size = fs::file_size(path, error);
    if (error || size != static_cast<uintmax_t>(checksum.size)) {
      return absl::DataLossError(absl::StrCat(
          "checkpoint file ", path,
          error ? " was not written" : absl::StrCat(" has ", size, " bytes, its writer wrote ", checksum.size),
          "; step ", step, " is not committed"));
    }
    CheckpointFile* file = manifest.add_files();
    file->set_name(name);
    file->set_crc32(checksum.crc32);
    file->set_size(checksum.size);
  }
  std::string text;
  google::protobuf::TextFormat::PrintToString(manifest, &text);
  {
    std::ofstream out(fs::path(staging) / kManifest);
    out << text;
    if (!out) return absl::InternalError(absl::StrCat("cannot write the manifest in ", staging));
  }
  const fs::path final_path = fs::path(save_dir_) / StepName(step);
  fs::remove_all(final_path, error);
  fs::rename(staging, final_path, error);
  if (error) {
    return absl::InternalError(
        absl::StrCat("cannot rename ", staging, " to ", final_path.string(), ": ", error.message()));
  }
  TRIDENT_RETURN_IF_ERROR(PointLink(fs::path(save_dir_) / "last", StepName(step)));
  if (val_loss) {
    auto best = ReadManifest(fs::path(save_dir_) / "best");
    if (!best.ok() || !best->has_val_loss() || *val_loss <= best->val_loss()) {
      TRIDENT_RETURN_IF_ERROR(PointLink(fs::path(save_dir_) / "best", StepName(step)));
    }
  }
  if (keep_last_n > 0) {
    const fs::path best_target = fs::read_symlink(fs::path(save_dir_) / "best", error);
    auto steps = StepDirectories(save_dir_);
    for (size_t i = keep_last_n; i < steps.size(); ++i) {
      if (steps[i].second.filename() != best_target) fs::remove_all(steps[i].second, error);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<CheckpointManifest> CheckpointDirectory::Validate(const std::string& path, int shard, int shards) {
  TRIDENT_ASSIGN_OR_RETURN(CheckpointManifest manifest, ReadManifest(path));
  for (int i = 0; i < manifest.files_size(); ++i) {
    const CheckpointFile& file = manifest.files(i);
    const std::string file_path = (fs::path(path) / file.name()).string();
    std::error_code error;
    const uintmax_t size = fs::file_size(file_path, error);
    if (error) {
      return absl::DataLossError(absl::StrCat("checkpoint file ", file_path, " listed in the manifest is missing"));
    }
    auto corrupt = [&](const std::string& why) {
      return absl::DataLossError(absl::StrCat("checkpoint file ", file_path, " is corrupt: ", why));
    };
    if (size != static_cast<uintmax_t>(file.size())) {
      return corrupt(absl::StrCat("size ", size, " bytes, manifest says ", file.size()));
    }
    if (i % shards != shard) continue;
    TRIDENT_ASSIGN_OR_RETURN(const Checksum checksum, FileChecksum(file_path));
    if (checksum.crc32 != file.crc32()) {
      return corrupt(absl::StrCat("CRC-32 ", checksum.crc32, ", manifest says ", file.crc32()));
    }
  }
  return manifest;
}

absl::StatusOr<ResolvedCheckpoint> CheckpointDirectory::Resolve(const std::string& which,
                                                                const Validator& given) const {
  const Validator validate = given ? given : [](const std::string& path) { return Validate(path); };
  ResolvedCheckpoint resolved;
  if (which == "last") {
    for (const auto& [step, path] : StepDirectories(save_dir_)) {
      auto manifest = validate(path.string());
      if (manifest.ok()) {
        resolved.path = path.string();
        resolved.manifest = *std::move(manifest);
        return resolved;
      }
      resolved.skipped.push_back(std::string(manifest.status().message()));
    }
    return absl::NotFoundError(
        absl::StrCat("no valid checkpoint in ", save_dir_,
                     resolved.skipped.empty() ? "" : absl::StrCat(" (", absl::StrJoin(resolved.skipped, "; "), ")"),
                     "; start without resume_from or point it at a valid step directory"));
  }
  std::error_code error;
  const fs::path path = which == "best" ? fs::canonical(fs::path(save_dir_) / "best", error) : fs::path(which);
  if (error) return absl::NotFoundError(absl::StrCat("no best checkpoint in ", save_dir_));
  TRIDENT_ASSIGN_OR_RETURN(resolved.manifest, validate(path.string()));
  resolved.path = path.string();
  return resolved;
}

}  // namespace trident
