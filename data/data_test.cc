#include "data/data.h"

#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <set>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace trident {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return std::string(dir ? dir : "/tmp") + "/" + name;
}

std::string Message(const absl::Status& status) { return std::string(status.message()); }

TEST(TokenFileTest, SampleKIsTheSliceStartingAtKTimesT) {
  std::vector<uint16_t> tokens;
  for (int i = 0; i < 23; ++i) tokens.push_back(static_cast<uint16_t>(i));
  const std::string path = TempPath("counting.bin");
  ASSERT_TRUE(WriteTokenFile(path, tokens).ok());
  auto file = TokenFile::Open(path, 64, 4);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->num_tokens(), 23);
  EXPECT_EQ((*file)->num_samples(), 5);  // (23 - 1) / 4
  at::Tensor inputs, targets;
  (*file)->Fill({2, 0}, &inputs, &targets);
  EXPECT_TRUE(at::equal(inputs, at::tensor({8, 9, 10, 11, 0, 1, 2, 3}, at::kLong).view({2, 4})));
  EXPECT_TRUE(at::equal(targets, at::tensor({9, 10, 11, 12, 1, 2, 3, 4}, at::kLong).view({2, 4})));
}

TEST(TokenFileTest, BadFilesAreRefusedWithTheirName) {
  EXPECT_THAT(Message(TokenFile::Open(TempPath("absent.bin"), 256, 4).status()), HasSubstr("cannot open token file"));
  const std::string odd = TempPath("odd.bin");
  std::ofstream(odd, std::ios::binary) << "abc";
  EXPECT_THAT(Message(TokenFile::Open(odd, 256, 1).status()), HasSubstr("odd.bin has 3 bytes, an odd number"));
  const std::string short_file = TempPath("short.bin");
  ASSERT_TRUE(WriteTokenFile(short_file, {1, 2, 3}).ok());
  EXPECT_THAT(Message(TokenFile::Open(short_file, 256, 4).status()),
              HasSubstr("short.bin holds 3 tokens, fewer than one sample of block_size 4"));
  const std::string big = TempPath("big_ids.bin");
  ASSERT_TRUE(WriteTokenFile(big, {1, 2, 300, 4, 5}).ok());
  EXPECT_THAT(Message(TokenFile::Open(big, 256, 2).status()),
              HasSubstr("big_ids.bin has token id 300 at position 2, not below vocab_size 256"));
}

TEST(BatchSamplerTest, StepsWalkTheSamplesInOrderAndWrapAround) {
  BatchSampler sampler(/*num_samples=*/10, /*global_batch_size=*/4, /*seed=*/1, /*shuffle=*/false);
  EXPECT_THAT(sampler.MicroBatch(0, 1, 0, 4, 0), ElementsAre(0, 1, 2, 3));
  EXPECT_THAT(sampler.MicroBatch(2, 1, 0, 4, 0), ElementsAre(8, 9, 0, 1));
  EXPECT_EQ(sampler.Epoch(2), 0);
  EXPECT_EQ(sampler.Epoch(3), 1);
}

TEST(BatchSamplerTest, DataParallelRanksTakeContiguousSlicesCutIntoMicroBatches) {
  BatchSampler sampler(100, 8, 3, /*shuffle=*/true);
  std::vector<int64_t> single;
  for (int64_t micro = 0; micro < 4; ++micro) {
    for (int64_t s : sampler.MicroBatch(5, 1, 0, 2, micro)) single.push_back(s);
  }
  std::vector<int64_t> split;
  for (int rank = 0; rank < 2; ++rank) {
    for (int64_t micro = 0; micro < 2; ++micro) {
      for (int64_t s : sampler.MicroBatch(5, 2, rank, 2, micro)) split.push_back(s);
    }
  }
  EXPECT_EQ(single, split);
}

TEST(BatchSamplerTest, ShuffleIsAPermutationPerEpochFixedBySeed) {
  BatchSampler sampler(12, 4, 7, true);
  std::set<int64_t> epoch0;
  for (int step = 0; step < 3; ++step) {
    for (int64_t s : sampler.MicroBatch(step, 1, 0, 4, 0)) epoch0.insert(s);
  }
  EXPECT_EQ(epoch0.size(), 12u);
  BatchSampler again(12, 4, 7, true), other_seed(12, 4, 8, true);
  EXPECT_EQ(again.MicroBatch(1, 1, 0, 4, 0), sampler.MicroBatch(1, 1, 0, 4, 0));
  EXPECT_NE(other_seed.MicroBatch(0, 1, 0, 4, 0), sampler.MicroBatch(0, 1, 0, 4, 0));
  EXPECT_NE(sampler.MicroBatch(3, 1, 0, 4, 0), sampler.MicroBatch(0, 1, 0, 4, 0));
}

const char kText[] =
    "The quick brown fox jumps over the lazy dog.  The dog sleeps; the fox runs 42 laps.\n"
    "\tA fox, a dog, and the end of the story: the the the.\n";

TEST(TokenizerTest, ByteTokenizerIsTheIdentityOnBytes) {
  auto tokenizer = MakeByteTokenizer();
  std::vector<uint16_t> ids = tokenizer->Encode("Hi\xff");
  EXPECT_THAT(ids, ElementsAre('H', 'i', 255));
  EXPECT_EQ(tokenizer->Decode({'H', 'i', 255}), "Hi\xff");
}

TEST(TokenizerTest, BpeRoundTripsCompressesAndReloads) {
  auto tokenizer = TrainBpeTokenizer(kText, 300);
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  EXPECT_EQ((*tokenizer)->vocab_size(), 300);
  std::vector<uint16_t> ids = (*tokenizer)->Encode(kText);
  EXPECT_LT(ids.size(), sizeof(kText) / 2);
  EXPECT_EQ((*tokenizer)->Decode(std::vector<int64_t>(ids.begin(), ids.end())), kText);
  const std::string path = TempPath("tokenizer.txt");
  ASSERT_TRUE((*tokenizer)->Save(path).ok());
  auto loaded = LoadTokenizer(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ((*loaded)->Encode(kText), ids);
  EXPECT_THAT(Message(TrainBpeTokenizer(kText, 100).status()), HasSubstr("must be in [256, 65536]"));
}

TEST(PrepareTest, WritesTrainValAndTokenizer) {
  const std::string input = TempPath("corpus.txt");
  std::ofstream(input) << kText << kText << kText;
  PrepareOptions options;
  options.inputs = {input};
  options.output_dir = TempPath("prepared");
  options.tokenizer = "bpe";
  options.vocab_size = 280;
  options.val_fraction = 0.25;
  auto prepared = PrepareTextCorpus(options);
  ASSERT_TRUE(prepared.ok()) << prepared.status();
  EXPECT_EQ(prepared->vocab_size, 280);
  EXPECT_NEAR(prepared->val_tokens, (prepared->train_tokens + prepared->val_tokens) / 4.0, 1.0);
  auto train = TokenFile::Open(prepared->train_path, 280, 8);
  ASSERT_TRUE(train.ok()) << train.status();
  auto tokenizer = LoadTokenizer(prepared->tokenizer_path);
  ASSERT_TRUE(tokenizer.ok());
  std::vector<int64_t> head((*train)->tokens(), (*train)->tokens() + 6);
  EXPECT_EQ((*tokenizer)->Decode(head).substr(0, 9), "The quick");
  EXPECT_GT(UnigramEntropy(**train), 2.0);
  options.tokenizer = "wordpiece";
  EXPECT_THAT(Message(PrepareTextCorpus(options).status()), HasSubstr("unknown tokenizer"));
}

// A user's tokenizer kind, registered as the built-ins are: bytes shifted up by one.
class ShiftTokenizer : public Tokenizer {
 public:
  std::vector<uint16_t> Encode(absl::string_view text) const override {
    std::vector<uint16_t> ids;
    for (unsigned char c : text) ids.push_back(c + 1);
    return ids;
  }
  std::string Decode(const std::vector<int64_t>& tokens) const override {
    std::string text;
    for (int64_t t : tokens) text.push_back(static_cast<char>(t - 1));
    return text;
  }
  int vocab_size() const override { return 257; }
  absl::Status Save(const std::string& path) const override {
    std::ofstream(path) << "test_shift\n";
    return absl::OkStatus();
  }
};

absl::StatusOr<std::unique_ptr<Tokenizer>> MakeShift() { return std::unique_ptr<Tokenizer>(new ShiftTokenizer()); }

TRIDENT_REGISTER(TokenizerRegistry, "test_shift",
                 TokenizerKind{[](absl::string_view, int) { return MakeShift(); },
                               [](std::istream&, const std::string&) { return MakeShift(); }});

TEST(PrepareTest, AUserTokenizerKindPreparesAndReloadsByName) {
  const std::string input = TempPath("shift_corpus.txt");
  std::ofstream(input) << kText;
  PrepareOptions options;
  options.inputs = {input};
  options.output_dir = TempPath("shift_prepared");
  options.tokenizer = "test_shift";
  auto prepared = PrepareTextCorpus(options);
  ASSERT_TRUE(prepared.ok()) << prepared.status();
  EXPECT_EQ(prepared->vocab_size, 257);
  auto train = TokenFile::Open(prepared->train_path, 257, 4);
  ASSERT_TRUE(train.ok()) << train.status();
  EXPECT_EQ((*train)->tokens()[0], 'T' + 1);
  auto loaded = LoadTokenizer(prepared->tokenizer_path);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_THAT((*loaded)->Encode("ab"), ElementsAre('a' + 1, 'b' + 1));
  const std::string unknown = TempPath("unknown_tokenizer.txt");
  std::ofstream(unknown) << "wordpiece 30000\n";
  EXPECT_THAT(Message(LoadTokenizer(unknown).status()),
              HasSubstr("starts with 'wordpiece', which is not a tokenizer kind; it should start with one of bpe, "
                        "byte, test_shift"));
}

TEST(PrepareTest, DefaultCorpusIsDebiansFortunes) {
  auto files = DefaultCorpusFiles();
  ASSERT_TRUE(files.ok()) << files.status();
  EXPECT_GT(files->size(), 10u);
}

}  // namespace
}  // namespace trident
