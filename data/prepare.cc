#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "data/data.h"

namespace trident {

absl::StatusOr<std::vector<std::string>> DefaultCorpusFiles() {
  const std::filesystem::path directory = "/usr/share/games/fortunes";
  std::vector<std::string> files;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(directory, error)) {
    const std::string extension = entry.path().extension().string();
    if (entry.is_regular_file() && !entry.is_symlink() && extension.empty()) {
      files.push_back(entry.path().string());
    }
  }
  if (error || files.empty()) {
    return absl::NotFoundError(absl::StrCat("the default corpus (Debian's fortunes in ", directory.string(),
                                            ") is missing; run tools/setup.sh or pass --data"));
  }
  std::sort(files.begin(), files.end());
  return files;
}

absl::StatusOr<PreparedData> PrepareTextCorpus(const PrepareOptions& options) {
  std::vector<std::string> inputs = options.inputs;
  if (inputs.empty()) {
    TRIDENT_ASSIGN_OR_RETURN(inputs, DefaultCorpusFiles());
  }
  if (options.val_fraction < 0 || options.val_fraction >= 1) {
    return absl::InvalidArgumentError(absl::StrCat("val_fraction=", options.val_fraction, " must be in [0, 1)"));
  }
  std::string text;
  for (const std::string& path : inputs) {
    std::ifstream in(path, std::ios::binary);
    if (!in) return absl::NotFoundError(absl::StrCat("cannot read text file ", path));
    std::ostringstream content;
    content << in.rdbuf();
    text += content.str();
  }
  TRIDENT_ASSIGN_OR_RETURN(TokenizerKind kind, TokenizerRegistry().Find(options.tokenizer));
  TRIDENT_ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tokenizer, kind.make(text, options.vocab_size));
  std::vector<uint16_t> tokens = tokenizer->Encode(text);
  const size_t val_count = static_cast<size_t>(tokens.size() * options.val_fraction);
  std::error_code error;
  std::filesystem::create_directories(options.output_dir, error);
  if (error) {
    return absl::InternalError(absl::StrCat("cannot create ", options.output_dir, ": ", error.message()));
  }
  PreparedData prepared;
  prepared.train_path = options.output_dir + "/train.bin";
  prepared.val_path = options.output_dir + "/val.bin";
  prepared.tokenizer_path = options.output_dir + "/tokenizer.txt";
  prepared.vocab_size = tokenizer->vocab_size();
  std::vector<uint16_t> train(tokens.begin(), tokens.end() - val_count);
  std::vector<uint16_t> val(tokens.end() - val_count, tokens.end());
  prepared.train_tokens = static_cast<int64_t>(train.size());
  prepared.val_tokens = static_cast<int64_t>(val.size());
  TRIDENT_RETURN_IF_ERROR(WriteTokenFile(prepared.train_path, train));
  TRIDENT_RETURN_IF_ERROR(WriteTokenFile(prepared.val_path, val));
  TRIDENT_RETURN_IF_ERROR(tokenizer->Save(prepared.tokenizer_path));
  return prepared;
}

}  // namespace trident
