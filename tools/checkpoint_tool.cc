// checkpoint: look into, check and convert Trident checkpoints of any layout.
//
//   checkpoint inspect STEP_DIR          tensors (full shape, dtype, the slices
//                                        each file holds, bytes), step, layout, config
//   checkpoint verify STEP_DIR           every file against the manifest's CRC-32
//   checkpoint merge STEP_DIR OUT_DIR    one-process checkpoint OUT_DIR/step_N
//                                        (model.safetensors + state.safetensors)
//   checkpoint export STEP_DIR FILE      the weights alone, whole, as safetensors
//   checkpoint compare A B [TOLERANCE]   the largest relative difference between
//                                        the tensors both hold (checkpoints or
//                                        safetensors files); fails above TOLERANCE
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "checkpoint/checkpoint.h"

namespace trident {
namespace {

namespace fs = std::filesystem;

constexpr char kUsage[] =
    "usage: checkpoint inspect STEP_DIR | verify STEP_DIR | merge STEP_DIR OUT_DIR | export STEP_DIR FILE | "
    "compare A B [TOLERANCE]";

std::string Shape(const std::vector<int64_t>& shape) { return absl::StrCat("[", absl::StrJoin(shape, ", "), "]"); }

// Where a piece sits: "whole", or its boxes as [from:to, ...].
std::string Where(const TensorSlice& slice) {
  if (slice.whole()) return "whole";
  std::vector<std::string> boxes;
  for (const SliceSegment& s : slice.segments) {
    std::vector<std::string> ranges;
    for (size_t d = 0; d < s.offsets.size(); ++d)
      ranges.push_back(absl::StrCat(s.offsets[d], ":", s.offsets[d] + s.lengths[d]));
    boxes.push_back(absl::StrCat("[", absl::StrJoin(ranges, ","), "]"));
  }
  if (boxes.size() > 4) {
    const size_t more = boxes.size() - 3;
    boxes.resize(3);
    boxes.push_back(absl::StrCat("... (", more, " more boxes)"));
  }
  return absl::StrJoin(boxes, " ");
}

// Every tensor of the checkpoint, whole: weights (names without '/') and state.
absl::Status ReadAll(const CheckpointReader& reader, NamedTensors* weights, NamedTensors* state) {
  for (const auto& [name, shape] : reader.FullShapes()) {
    TRIDENT_ASSIGN_OR_RETURN(at::Tensor whole, reader.ReadWhole(name));
    (name.find('/') == std::string::npos ? weights : state)->emplace_back(name, whole);
  }
  return absl::OkStatus();
}

absl::Status Inspect(const std::string& path) {
  TRIDENT_ASSIGN_OR_RETURN(CheckpointManifest manifest, CheckpointDirectory::Validate(path));
  TRIDENT_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader, CheckpointReader::Open(path));
  const auto& metadata = reader->metadata().begin()->second;
  auto value = [&](const char* key) { return metadata.count(key) ? metadata.at(key) : std::string("?"); };
  std::printf("checkpoint %s: step %lld, layout %s on %s ranks, %d files\n", path.c_str(),
              static_cast<long long>(manifest.step()), value("layout").c_str(), value("world_size").c_str(),
              manifest.files_size());
  int64_t total = 0;
  for (const CheckpointFile& file : manifest.files()) total += file.size();
  std::map<std::string, std::vector<CheckpointReader::Piece>> by_name;
  for (CheckpointReader::Piece& piece : reader->Pieces()) by_name[piece.name].push_back(std::move(piece));
  for (const auto& [name, pieces] : by_name) {
    int64_t bytes = 0;
    for (const auto& p : pieces) bytes += p.bytes;
    std::printf("%-60s %-16s %-9s %10lld bytes\n", name.c_str(), Shape(pieces.front().slice.full_shape).c_str(),
                c10::toString(pieces.front().dtype), static_cast<long long>(bytes));
    if (pieces.size() > 1 || !pieces.front().slice.whole()) {
      for (const auto& p : pieces) std::printf("    %-24s %s\n", p.file.c_str(), Where(p.slice).c_str());
    }
  }
  std::printf("%zu tensors, %lld bytes in files\n", by_name.size(), static_cast<long long>(total));
  std::ifstream config((fs::path(path) / "config.pbtxt").string());
  if (config) std::cout << "config:\n" << config.rdbuf();
  return absl::OkStatus();
}

absl::Status Merge(const std::string& path, const std::string& out) {
  TRIDENT_ASSIGN_OR_RETURN(CheckpointManifest manifest, CheckpointDirectory::Validate(path));
  TRIDENT_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader, CheckpointReader::Open(path));
  NamedTensors weights, state;
  TRIDENT_RETURN_IF_ERROR(ReadAll(*reader, &weights, &state));
  std::map<std::string, std::string> metadata = reader->metadata().begin()->second;
  metadata.erase("rank");
  CheckpointDirectory directory(out);
  TRIDENT_ASSIGN_OR_RETURN(const std::string staging, directory.StagingPath(manifest.step()));
  std::map<std::string, Checksum> files;
  metadata["format"] = "pt";
  TRIDENT_RETURN_IF_ERROR(
      WriteSafetensors(staging + "/model.safetensors", weights, metadata, &files["model.safetensors"]));
  metadata.erase("format");
  TRIDENT_RETURN_IF_ERROR(
      WriteSafetensors(staging + "/state.safetensors", state, metadata, &files["state.safetensors"]));
  std::error_code error;
  if (fs::copy_file(fs::path(path) / "config.pbtxt", fs::path(staging) / "config.pbtxt", error)) {
    TRIDENT_ASSIGN_OR_RETURN(files["config.pbtxt"], FileChecksum(staging + "/config.pbtxt"));
  }
  std::optional<double> val_loss;
  if (manifest.has_val_loss()) val_loss = manifest.val_loss();
  TRIDENT_RETURN_IF_ERROR(directory.Commit(manifest.step(), 1, val_loss, 0, files));
  std::printf("merged %s into %s/step_%lld (%zu weights, %zu state tensors)\n", path.c_str(), out.c_str(),
              static_cast<long long>(manifest.step()), weights.size(), state.size());
  return absl::OkStatus();
}

absl::Status Export(const std::string& path, const std::string& file) {
  TRIDENT_RETURN_IF_ERROR(CheckpointDirectory::Validate(path).status());
  TRIDENT_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader, CheckpointReader::Open(path));
  NamedTensors weights, state;
  TRIDENT_RETURN_IF_ERROR(ReadAll(*reader, &weights, &state));
  TRIDENT_RETURN_IF_ERROR(WriteSafetensors(file, weights, {{"format", "pt"}}));
  std::printf("exported %zu weights of %s to %s\n", weights.size(), path.c_str(), file.c_str());
  return absl::OkStatus();
}

absl::Status Compare(const std::string& a, const std::string& b, double tolerance) {
  TRIDENT_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> first, CheckpointReader::Open(a));
  TRIDENT_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> second, CheckpointReader::Open(b));
  double worst = 0;
  std::string worst_name;
  int compared = 0;
  for (const auto& [name, shape] : first->FullShapes()) {
    if (!second->Contains(name) || name.rfind("rng/", 0) == 0) continue;
    TRIDENT_ASSIGN_OR_RETURN(at::Tensor x, first->ReadWhole(name));
    TRIDENT_ASSIGN_OR_RETURN(at::Tensor y, second->ReadWhole(name));
    if (!x.sizes().equals(y.sizes())) {
      return absl::FailedPreconditionError(absl::StrCat("tensor '", name, "' has shape ", c10::str(x.sizes()), " in ",
                                                        a, " but ", c10::str(y.sizes()), " in ", b));
    }
    const double scale = std::max(1e-12, x.to(at::kDouble).abs().max().item<double>());
    const double difference = (x.to(at::kDouble) - y.to(at::kDouble)).abs().max().item<double>() / scale;
    if (difference >= worst) {
      worst = difference;
      worst_name = name;
    }
    ++compared;
  }
  if (compared == 0) return absl::NotFoundError(absl::StrCat(a, " and ", b, " share no tensor"));
  std::printf("%d tensors compared; largest difference %.3g (relative to the tensor's largest value) in %s\n", compared,
              worst, worst_name.c_str());
  if (worst > tolerance) {
    return absl::OutOfRangeError(absl::StrCat("tensor '", worst_name, "' differs by ", worst, " > ", tolerance));
  }
  return absl::OkStatus();
}

absl::Status Run(int argc, char** argv) {
  const std::string command = argc > 1 ? argv[1] : "";
  if (argc == 2 && (command == "--help" || command == "-h" || command == "--helpshort")) {
    std::printf("%s\n", kUsage);
    return absl::OkStatus();
  }
  if (argc == 3 && command == "inspect") return Inspect(argv[2]);
  if (argc == 3 && command == "verify") {
    TRIDENT_ASSIGN_OR_RETURN(CheckpointManifest manifest, CheckpointDirectory::Validate(argv[2]));
    std::printf("%s: %d files match the manifest's sizes and CRC-32s (step %lld)\n", argv[2], manifest.files_size(),
                static_cast<long long>(manifest.step()));
    return absl::OkStatus();
  }
  if (argc == 4 && command == "merge") return Merge(argv[2], argv[3]);
  if (argc == 4 && command == "export") return Export(argv[2], argv[3]);
  if ((argc == 4 || argc == 5) && command == "compare")
    return Compare(argv[2], argv[3], argc == 5 ? std::atof(argv[4]) : 0);
  return absl::InvalidArgumentError(kUsage);
}

}  // namespace
}  // namespace trident

int main(int argc, char** argv) {
  const absl::Status status = trident::Run(argc, argv);
  if (!status.ok()) {
    std::fprintf(stderr, "checkpoint: %s\n", std::string(status.message()).c_str());
    return 1;
  }
  return 0;
}
