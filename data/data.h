// data: the Dataset interface and its registry, token files, the batch rule
// every parallel layout shares, tokenizers, and corpus preparation.
//
// A Dataset gives samples by index as a Batch (one tensor per field, samples
// along dimension 0). Datasets register by name like models do; the token
// files register as "tokens" (args: path, block_size, vocab_size):
//
//   TRIDENT_ASSIGN_OR_RETURN(auto data, MakeDataset("tokens", ComponentArgs("dataset 'tokens'",
//       {{"path", "train.bin"}, {"block_size", "128"}, {"vocab_size", "256"}})));
//   TRIDENT_ASSIGN_OR_RETURN(Batch batch, data->Get({0, 1, 2, 3}));  // {inputs, targets} [4, 128]
//
// A token file (.bin) is a flat little-endian uint16 array. Sample k of length T
// is tokens [k*T, k*T + T + 1): T inputs and the T targets shifted by one. Step s
// of a global batch of B samples uses samples (s*B + j) mod num_samples, j < B,
// optionally permuted once per epoch by a seeded shuffle; data-parallel rank r
// takes positions [r*B/dp, (r+1)*B/dp) and cuts them into micro-batches in order.
// Every layout therefore sees exactly the batches one process sees.
//
//   TRIDENT_ASSIGN_OR_RETURN(auto file, TokenFile::Open("train.bin", /*vocab_size=*/256,
//                                                        /*sample_length=*/128));
//   BatchSampler sampler(file->num_samples(), /*global_batch_size=*/16, /*seed=*/1,
//                        /*shuffle=*/true);
//   std::vector<int64_t> samples = sampler.MicroBatch(step, dp, dp_rank, 4, micro);
//   at::Tensor inputs, targets;
//   file->Fill(samples, &inputs, &targets);  // [4, 128] int64 each
#ifndef TRIDENT_DATA_DATA_H_
#define TRIDENT_DATA_DATA_H_

#include <cstdint>
#include <functional>
#include <istream>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/registry.h"
#include "base/tensors.h"

namespace trident {

// Samples by index. Implementations must be deterministic (the same index
// gives the same sample on every rank and every run) and safe to call from
// one thread at a time.
class Dataset {
 public:
  virtual ~Dataset() = default;
  // Number of samples.
  virtual int64_t size() const = 0;
  // The samples at `indices`, stacked: one tensor per field, dimension 0 over
  // the samples. Errors name the dataset and what is wrong.
  virtual absl::StatusOr<Batch> Get(const std::vector<int64_t>& indices) const = 0;
  // The fields' names (what input_names refer to); empty when unnamed.
  virtual std::vector<std::string> field_names() const { return {}; }
  // Tokens in one sample, for throughput figures (0: not a token dataset).
  virtual int64_t tokens_per_sample() const { return 0; }
};

using DatasetFactory = std::function<absl::StatusOr<std::unique_ptr<Dataset>>(const ComponentArgs& args)>;
Registry<DatasetFactory>& DatasetRegistry();
absl::StatusOr<std::unique_ptr<Dataset>> MakeDataset(const std::string& type, const ComponentArgs& args);

// A memory-mapped token file, validated on open.
class TokenFile {
 public:
  // Maps `path` and checks it: an even byte count, at least one sample of
  // `sample_length` (+1) tokens, and every token below `vocab_size`. Errors name
  // the file and what is wrong with it.
  static absl::StatusOr<std::unique_ptr<TokenFile>> Open(const std::string& path, int64_t vocab_size,
                                                         int64_t sample_length);
  ~TokenFile();
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;

  const std::string& path() const { return path_; }
  int64_t num_tokens() const { return num_tokens_; }
  int64_t sample_length() const { return sample_length_; }
  // (num_tokens - 1) / sample_length.
  int64_t num_samples() const { return (num_tokens_ - 1) / sample_length_; }
  const uint16_t* tokens() const { return tokens_; }

  // Inputs and targets ([samples.size(), sample_length], int64) of `samples`.
  void Fill(const std::vector<int64_t>& samples, at::Tensor* inputs, at::Tensor* targets) const;

 private:
  TokenFile() = default;
  std::string path_;
  const uint16_t* tokens_ = nullptr;
  int64_t num_tokens_ = 0;
  int64_t sample_length_ = 0;
  size_t mapped_bytes_ = 0;
};

// A token file as a Dataset: fields "input_ids" [n, T] and "labels" [n, T]
// (the inputs shifted by one), int64.
class TokenDataset : public Dataset {
 public:
  explicit TokenDataset(std::unique_ptr<TokenFile> file) : file_(std::move(file)) {}
  int64_t size() const override { return file_->num_samples(); }
  absl::StatusOr<Batch> Get(const std::vector<int64_t>& indices) const override;
  std::vector<std::string> field_names() const override { return {"input_ids", "labels"}; }
  int64_t tokens_per_sample() const override { return file_->sample_length(); }
  const TokenFile& file() const { return *file_; }

 private:
  std::unique_ptr<TokenFile> file_;
};

// Writes `tokens` as a token file.
absl::Status WriteTokenFile(const std::string& path, const std::vector<uint16_t>& tokens);

// Which samples each step uses (see the rule at the top of this file).
class BatchSampler {
 public:
  BatchSampler(int64_t num_samples, int64_t global_batch_size, uint64_t seed, bool shuffle);

  // Sample used at position `j` (0 <= j < global_batch_size) of step `step`.
  int64_t SampleIndex(int64_t step, int64_t j) const;
  // Samples of micro-batch `micro` (of `micro_batch_size`) of data-parallel rank
  // `dp_rank` of `dp` at step `step`.
  std::vector<int64_t> MicroBatch(int64_t step, int dp, int dp_rank, int64_t micro_batch_size, int64_t micro) const;
  // Epoch of the first sample of `step`.
  int64_t Epoch(int64_t step) const;

 private:
  int64_t num_samples_, global_batch_size_;
  uint64_t seed_;
  bool shuffle_;
  mutable int64_t cached_epoch_ = -1;
  mutable std::vector<int64_t> permutation_;
};

// Byte-level (vocab 256) or byte-pair-encoding tokenizer.
class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::vector<uint16_t> Encode(absl::string_view text) const = 0;
  virtual std::string Decode(const std::vector<int64_t>& tokens) const = 0;
  virtual int vocab_size() const = 0;
  // Writes the tokenizer to `path` (text: "byte", or "bpe N" and N-256 merges).
  virtual absl::Status Save(const std::string& path) const = 0;
};

std::unique_ptr<Tokenizer> MakeByteTokenizer();
// Learns vocab_size - 256 merges from `text` (vocab_size in [256, 65536]).
absl::StatusOr<std::unique_ptr<Tokenizer>> TrainBpeTokenizer(absl::string_view text, int vocab_size);
// A tokenizer file starts with its kind's name (the word Save writes first);
// LoadTokenizer reads that word and the kind's `load` reads the rest.
absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizer(const std::string& path);

// Tokenizer kinds by name (PrepareOptions::tokenizer and the first word of a
// tokenizer file): how one is made for a corpus (`vocab_size`: the target,
// for kinds that learn one) and read back. Built in: byte, bpe.
struct TokenizerKind {
  std::function<absl::StatusOr<std::unique_ptr<Tokenizer>>(absl::string_view text, int vocab_size)> make;
  // Reads the rest of the file at `path` from `in` (its first word consumed).
  std::function<absl::StatusOr<std::unique_ptr<Tokenizer>>(std::istream& in, const std::string& path)> load;
};
Registry<TokenizerKind>& TokenizerRegistry();

// Turns text files into `output_dir`/{train.bin, val.bin, tokenizer.txt}: the
// concatenated text is tokenized and its last `val_fraction` becomes val.bin.
struct PrepareOptions {
  std::vector<std::string> inputs;  // text files; empty: DefaultCorpusFiles()
  std::string output_dir;
  std::string tokenizer = "byte";  // a TokenizerRegistry name: "byte" or "bpe"
  int vocab_size = 512;            // bpe only
  double val_fraction = 0.1;
};
struct PreparedData {
  std::string train_path, val_path, tokenizer_path;
  int vocab_size = 0;
  int64_t train_tokens = 0, val_tokens = 0;
};
absl::StatusOr<PreparedData> PrepareTextCorpus(const PrepareOptions& options);

// The text files of Debian's fortunes package (installed by tools/setup.sh).
absl::StatusOr<std::vector<std::string>> DefaultCorpusFiles();

// Entropy in nats of the token frequencies of `file`: the loss of a model that
// knows only how often each token occurs.
double UnigramEntropy(const TokenFile& file);

}  // namespace trident

#endif  // TRIDENT_DATA_DATA_H_
