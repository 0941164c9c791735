#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "data/data.h"

namespace trident {

absl::StatusOr<std::unique_ptr<TokenFile>> TokenFile::Open(const std::string& path, int64_t vocab_size,
                                                           int64_t sample_length) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::NotFoundError(absl::StrCat("cannot open token file ", path, ": ", std::strerror(errno),
                                            "; prepare one with tools/prepare_data"));
  }
  struct stat info;
  fstat(fd, &info);
  const size_t bytes = static_cast<size_t>(info.st_size);
  if (bytes % 2 != 0) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat("token file ", path, " has ", bytes,
                                                   " bytes, an odd number: it is not a uint16 token "
                                                   "array (truncated or not a .bin written by tools/prepare_data)"));
  }
  const int64_t count = static_cast<int64_t>(bytes / 2);
  if (count < sample_length + 1) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat("token file ", path, " holds ", count,
                                                   " tokens, fewer than one sample of block_size ", sample_length,
                                                   " + 1; use more text or a smaller block_size"));
  }
  void* mapped = mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
  close(fd);
  if (mapped == MAP_FAILED) {
    return absl::InternalError(absl::StrCat("cannot map token file ", path, ": ", std::strerror(errno)));
  }
  std::unique_ptr<TokenFile> file(new TokenFile());
  file->path_ = path;
  file->tokens_ = static_cast<const uint16_t*>(mapped);
  file->num_tokens_ = count;
  file->sample_length_ = sample_length;
  file->mapped_bytes_ = bytes;
  for (int64_t i = 0; i < count; ++i) {
    if (file->tokens_[i] >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "token file ", path, " has token id ", file->tokens_[i], " at position ", i, ", not below vocab_size ",
          vocab_size, "; the file was made with another tokenizer or vocab_size is too small"));
    }
  }
  return file;
}

TokenFile::~TokenFile() {
  if (tokens_ != nullptr) munmap(const_cast<uint16_t*>(tokens_), mapped_bytes_);
}

void TokenFile::Fill(const std::vector<int64_t>& samples, at::Tensor* inputs, at::Tensor* targets) const {
  const int64_t n = static_cast<int64_t>(samples.size()), T = sample_length_;
  *inputs = at::empty({n, T}, at::kLong);
  *targets = at::empty({n, T}, at::kLong);
  int64_t* in = inputs->data_ptr<int64_t>();
  int64_t* out = targets->data_ptr<int64_t>();
  for (int64_t row = 0; row < n; ++row) {
    const uint16_t* source = tokens_ + samples[row] * T;
    for (int64_t t = 0; t < T; ++t) {
      in[row * T + t] = source[t];
      out[row * T + t] = source[t + 1];
    }
  }
}

absl::StatusOr<Batch> TokenDataset::Get(const std::vector<int64_t>& indices) const {
  for (int64_t i : indices) {
    if (i < 0 || i >= size()) {
      return absl::OutOfRangeError(
          absl::StrCat("sample ", i, " of ", file_->path(), ", which has ", size(), " samples"));
    }
  }
  at::Tensor inputs, targets;
  file_->Fill(indices, &inputs, &targets);
  return Batch{inputs, targets};
}

Registry<DatasetFactory>& DatasetRegistry() {
  static auto* registry = new Registry<DatasetFactory>("dataset");
  return *registry;
}

absl::StatusOr<std::unique_ptr<Dataset>> MakeDataset(const std::string& type, const ComponentArgs& args) {
  TRIDENT_ASSIGN_OR_RETURN(DatasetFactory make, DatasetRegistry().Find(type));
  return make(args);
}

namespace {

TRIDENT_REGISTER(DatasetRegistry, "tokens", [](const ComponentArgs& args) -> absl::StatusOr<std::unique_ptr<Dataset>> {
  TRIDENT_RETURN_IF_ERROR(args.CheckKnown({"path", "block_size", "vocab_size"}));
  const std::string path = args.GetString("path", "");
  if (path.empty()) return absl::InvalidArgumentError(absl::StrCat(args.owner(), " needs a path"));
  TRIDENT_ASSIGN_OR_RETURN(const int64_t block_size, args.GetInt("block_size", 0));
  TRIDENT_ASSIGN_OR_RETURN(const int64_t vocab_size, args.GetInt("vocab_size", 65536));
  if (block_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat(args.owner(), " needs block_size (tokens per sample)"));
  }
  TRIDENT_ASSIGN_OR_RETURN(auto file, TokenFile::Open(path, vocab_size, block_size));
  return std::unique_ptr<Dataset>(new TokenDataset(std::move(file)));
});

}  // namespace

absl::Status WriteTokenFile(const std::string& path, const std::vector<uint16_t>& tokens) {
  static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "token files are little-endian");
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(tokens.data()),
            static_cast<std::streamsize>(tokens.size() * sizeof(uint16_t)));
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("cannot write token file ", path));
  return absl::OkStatus();
}

double UnigramEntropy(const TokenFile& file) {
  std::vector<double> counts(65536, 0.0);
  for (int64_t i = 0; i < file.num_tokens(); ++i) counts[file.tokens()[i]] += 1;
  double entropy = 0;
  for (double c : counts) {
    if (c > 0) {
      const double p = c / file.num_tokens();
      entropy -= p * std::log(p);
    }
  }
  return entropy;
}

}  // namespace trident
