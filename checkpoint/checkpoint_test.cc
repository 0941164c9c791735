#include "checkpoint/checkpoint.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace trident {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string TempDir(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  fs::path path = fs::path(dir ? dir : "/tmp") / name;
  fs::remove_all(path);
  fs::create_directories(path);
  return path.string();
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

TEST(SafetensorsTest, LayoutFollowsTheFormat) {
  const std::string path = TempDir("layout") + "/one.safetensors";
  ASSERT_TRUE(WriteSafetensors(path, {{"a", at::tensor({1.0f, 2.0f})}}).ok());
  const std::string bytes = ReadAll(path);
  const std::string header = "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}";
  const size_t padded = (header.size() + 7) / 8 * 8;
  ASSERT_EQ(bytes.size(), 8 + padded + 8);
  EXPECT_EQ(static_cast<unsigned char>(bytes[0]), padded);  // little-endian length
  EXPECT_EQ(bytes.substr(8, header.size()), header);
  float values[2];
  std::memcpy(values, bytes.data() + 8 + padded, 8);
  EXPECT_EQ(values[1], 2.0f);
}

TEST(SafetensorsTest, RoundTripsEveryDtypeShapeAndMetadata) {
  const std::string path = TempDir("roundtrip") + "/all.safetensors";
  NamedTensors tensors = {
      {"f32", at::randn({3, 4})},
      {"f64", at::randn({2}, at::kDouble)},
      {"bf16", at::randn({5}).to(at::kBFloat16)},
      {"f16", at::randn({2, 2}).to(at::kHalf)},
      {"i64", at::arange(6, at::kLong).view({2, 3})},
      {"u8", at::arange(4, at::kByte)},
      {"scalar", at::tensor(7.0f).view({})},
      {"strided", at::randn({4, 3}).t()},
  };
  Checksum written;
  ASSERT_TRUE(WriteSafetensors(path, tensors, {{"format", "pt"}, {"note", "a \"quoted\" value"}}, &written).ok());
  auto reread = FileChecksum(path);  // the checksum computed while writing is the file's
  ASSERT_TRUE(reread.ok()) << reread.status();
  EXPECT_EQ(written.crc32, reread->crc32);
  EXPECT_EQ(written.size, reread->size);
  auto read = ReadSafetensors(path);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_EQ(read->tensors.size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    EXPECT_EQ(read->tensors[i].first, tensors[i].first);
    EXPECT_TRUE(at::equal(read->tensors[i].second, tensors[i].second)) << tensors[i].first;
  }
  EXPECT_EQ(read->metadata.at("note"), "a \"quoted\" value");
  EXPECT_THAT(std::string(read->Get("absent").status().message()), HasSubstr("has no tensor 'absent'"));
}

TEST(SafetensorsTest, MalformedFilesNameTheFile) {
  const std::string dir = TempDir("malformed");
  std::ofstream(dir + "/short.safetensors") << "abc";
  EXPECT_THAT(std::string(ReadSafetensors(dir + "/short.safetensors").status().message()),
              HasSubstr("short.safetensors is malformed"));
  const std::string path = dir + "/cut.safetensors";
  ASSERT_TRUE(WriteSafetensors(path, {{"w", at::randn({16})}}).ok());
  fs::resize_file(path, fs::file_size(path) - 4);
  EXPECT_THAT(std::string(ReadSafetensors(path).status().message()), HasSubstr("tensor 'w' has data offsets"));
}

// The full tensor rebuilt from the pieces each part of a layout holds.
at::Tensor Assemble(const std::vector<std::pair<TensorSlice, at::Tensor>>& pieces, std::vector<int64_t> shape) {
  at::Tensor full = at::full(shape, -1.0f);
  at::Tensor flat = full.view({-1});
  for (const auto& [slice, data] : pieces) {
    at::Tensor source = data.reshape({-1});
    CopyOverlap(slice, source, TensorSlice::Whole(shape), flat);
  }
  return full;
}

TEST(TensorSliceTest, BlockShardsAreTheTensorParallelSlices) {
  const at::Tensor full = at::arange(6 * 4, at::kFloat).view({6, 4});
  // Fused q, k, v (3 blocks of 2 rows) over 2 ranks: rank 1 holds rows 1, 3, 5.
  TensorSlice shard = TensorSlice::BlockShard({6, 4}, 0, 3, 1, 2);
  EXPECT_EQ(shard.local_shape, (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(shard.numel(), 12);
  at::Tensor local = at::empty({3, 4});
  at::Tensor flat = local.view({-1});
  EXPECT_EQ(CopyOverlap(TensorSlice::Whole({6, 4}), full.view({-1}), shard, flat), 12);
  EXPECT_TRUE(at::equal(local, full.index_select(0, at::tensor({1, 3, 5}, at::kLong))));
  // Columns (dimension 1) of two ranks put back together.
  std::vector<std::pair<TensorSlice, at::Tensor>> pieces;
  for (int rank = 0; rank < 2; ++rank)
    pieces.emplace_back(TensorSlice::BlockShard({6, 4}, 1, 1, rank, 2), full.chunk(2, 1)[rank].contiguous());
  EXPECT_TRUE(at::equal(Assemble(pieces, {6, 4}), full));
}

TEST(TensorSliceTest, FlatRangesOfShardsCoverTheirElementsOnce) {
  // ZeRO over 3 ranks of a tp shard of a [6, 5] weight with 3 blocks on
  // dimension 1... and chunks that start and end mid-row.
  const at::Tensor full = at::randn({4, 6, 5});
  for (int64_t tp_rank = 0; tp_rank < 2; ++tp_rank) {
    TensorSlice shard = TensorSlice::BlockShard({4, 6, 5}, 1, 3, tp_rank, 2);
    at::Tensor local = at::empty(shard.local_shape);
    at::Tensor local_flat = local.view({-1});
    CopyOverlap(TensorSlice::Whole({4, 6, 5}), full.view({-1}), shard, local_flat);
    std::vector<std::pair<TensorSlice, at::Tensor>> chunks;
    const std::vector<int64_t> cuts = {0, 7, 23, 24, 41, 60};
    for (size_t i = 0; i + 1 < cuts.size(); ++i) {
      TensorSlice part = shard.FlatRange(cuts[i], cuts[i + 1]);
      EXPECT_EQ(part.numel(), cuts[i + 1] - cuts[i]);
      // Encoded and decoded as a checkpoint file stores it.
      auto decoded = TensorSlice::Decode(part.Encode());
      ASSERT_TRUE(decoded.ok()) << decoded.status();
      EXPECT_TRUE(*decoded == part);
      chunks.emplace_back(*decoded, local_flat.narrow(0, cuts[i], cuts[i + 1] - cuts[i]).clone());
    }
    at::Tensor rebuilt = at::empty(shard.local_shape);
    at::Tensor rebuilt_flat = rebuilt.view({-1});
    at::Tensor covered = at::zeros({shard.numel()}, at::kByte);
    int64_t copied = 0;
    for (const auto& [slice, data] : chunks) copied += CopyOverlap(slice, data, shard, rebuilt_flat, &covered);
    EXPECT_EQ(copied, shard.numel());
    EXPECT_EQ(covered.sum().item<int64_t>(), shard.numel());
    EXPECT_TRUE(at::equal(rebuilt, local));
  }
  // Scalars (Adam's step) are whole or a flat range of one element.
  TensorSlice scalar = TensorSlice::Whole({});
  EXPECT_EQ(scalar.numel(), 1);
  EXPECT_EQ(scalar.FlatRange(0, 1).numel(), 1);
  EXPECT_FALSE(TensorSlice::Decode("1,2|x").ok());
}

TEST(CheckpointReaderTest, ReadsAnySliceFromPiecesOfAnotherLayout) {
  const std::string dir = TempDir("reader");
  const at::Tensor w = at::randn({6, 4}), b = at::randn({6});
  // Written by tp=2 (rows, one block) with a ZeRO-like split of the bias.
  for (int rank = 0; rank < 2; ++rank) {
    TensorSlice shard = TensorSlice::BlockShard({6, 4}, 0, 1, rank, 2);
    std::vector<SlicedTensor> pieces = {
        {"w", shard, w.chunk(2, 0)[rank].contiguous()},
        {"b", TensorSlice::Whole({6}).FlatRange(rank * 2, rank * 2 + 4), b.narrow(0, rank * 2, 4).clone()},
        {"step", TensorSlice::Whole({}), at::tensor(5, at::kLong)}};
    ASSERT_TRUE(WriteSlicedSafetensors(dir + "/rank_" + std::to_string(rank) + ".safetensors", pieces,
                                       {{"rank", std::to_string(rank)}})
                    .ok());
  }
  auto reader = CheckpointReader::Open(dir);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_THAT((*reader)->FullShapes()["w"], ElementsAre(6, 4));
  // Read by a layout that splits columns in 2 blocks over 2 ranks: rank 1
  // holds columns 1 and 3, from both files.
  TensorSlice mine = TensorSlice::BlockShard({6, 4}, 1, 2, 1, 2);
  at::Tensor target = at::empty(mine.local_shape, at::kDouble);
  ASSERT_TRUE((*reader)->Read("w", mine, target).ok());
  EXPECT_TRUE(at::allclose(target, w.index_select(1, at::tensor({1, 3}, at::kLong)).to(at::kDouble)));
  EXPECT_EQ((*reader)->bytes_read(), 12 * 4);  // only the 12 elements asked for
  auto bias = (*reader)->ReadWhole("b");
  ASSERT_TRUE(bias.ok()) << bias.status();
  EXPECT_TRUE(at::equal(*bias, b));
  EXPECT_EQ((*reader)->ReadWhole("step")->item<int64_t>(), 5);
  EXPECT_EQ((*reader)->metadata().at("rank_1.safetensors").at("rank"), "1");
  // Missing pieces, other shapes and absent names are errors that say so.
  fs::remove(dir + "/rank_1.safetensors");
  reader = CheckpointReader::Open(dir);
  ASSERT_TRUE(reader.ok());
  EXPECT_THAT(std::string((*reader)->ReadWhole("w").status().message()),
              HasSubstr("lacks 12 of the 24 elements of tensor 'w'"));
  at::Tensor other = at::empty({8, 4});
  EXPECT_THAT(std::string((*reader)->Read("w", TensorSlice::Whole({8, 4}), other).message()),
              HasSubstr("has shape [6, 4] but the model's is [8, 4]"));
  EXPECT_THAT(std::string((*reader)->ReadWhole("v").status().message()), HasSubstr("has no tensor 'v'"));
  // Whole tensors are plain safetensors entries: the reader of any tool loads them by name.
  auto plain = ReadSafetensors(dir + "/rank_0.safetensors");
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->Get("step")->item<int64_t>(), 5);
}

// Writes step `step` with one file per rank and commits it.
void SaveStep(const CheckpointDirectory& dir, int64_t step, double val_loss, int keep) {
  auto staging = dir.StagingPath(step);
  ASSERT_TRUE(staging.ok()) << staging.status();
  std::map<std::string, Checksum> files;
  for (int rank = 0; rank < 2; ++rank) {
    const std::string name = "rank_" + std::to_string(rank) + ".bin";
    std::ofstream(*staging + "/" + name) << "step " << step << " rank " << rank;
    files[name] = *FileChecksum(*staging + "/" + name);
  }
  ASSERT_TRUE(dir.Commit(step, 2, val_loss, keep, files).ok());
}

std::vector<std::string> Entries(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

TEST(CheckpointDirectoryTest, CommitWritesManifestLinksAndPrunes) {
  const std::string root = TempDir("commit");
  CheckpointDirectory dir(root);
  SaveStep(dir, 10, 2.0, 2);
  SaveStep(dir, 20, 1.5, 2);  // best
  SaveStep(dir, 30, 1.8, 2);
  SaveStep(dir, 40, 1.9, 2);  // prunes step_10; step_20 survives as best
  EXPECT_THAT(Entries(root), ElementsAre("best", "last", "step_20", "step_30", "step_40"));
  EXPECT_EQ(fs::read_symlink(root + "/last").string(), "step_40");
  EXPECT_EQ(fs::read_symlink(root + "/best").string(), "step_20");
  auto manifest = CheckpointDirectory::Validate(root + "/step_40");
  ASSERT_TRUE(manifest.ok()) << manifest.status();
  EXPECT_EQ(manifest->step(), 40);
  ASSERT_EQ(manifest->files_size(), 2);
  EXPECT_EQ(manifest->files(1).name(), "rank_1.bin");
  auto best = dir.Resolve("best");
  ASSERT_TRUE(best.ok()) << best.status();
  EXPECT_EQ(best->manifest.step(), 20);
}

TEST(CheckpointDirectoryTest, CommitKeepsTheListedFilesAndRefusesMissingOnes) {
  const std::string root = TempDir("listed");
  CheckpointDirectory dir(root);
  auto staging = dir.StagingPath(7);
  ASSERT_TRUE(staging.ok()) << staging.status();
  std::ofstream(*staging + "/rank_0.bin") << "rank 0";
  std::ofstream(*staging + "/rank_3.bin") << "left by an attempt with more ranks";
  std::map<std::string, Checksum> files = {{"rank_0.bin", *FileChecksum(*staging + "/rank_0.bin")},
                                           {"rank_1.bin", {0, 6}}};
  EXPECT_THAT(std::string(dir.Commit(7, 2, std::nullopt, 0, files).message()),
              HasSubstr(".step_7.staging/rank_1.bin was not written; step 7 is not committed"));
  std::ofstream(*staging + "/rank_1.bin") << "rank 1 and more";
  EXPECT_THAT(std::string(dir.Commit(7, 2, std::nullopt, 0, files).message()),
              HasSubstr("rank_1.bin has 15 bytes, its writer wrote 6"));
  EXPECT_FALSE(fs::exists(root + "/step_7"));
  std::ofstream(*staging + "/rank_1.bin") << "rank 1";
  files["rank_1.bin"] = *FileChecksum(*staging + "/rank_1.bin");
  ASSERT_TRUE(dir.Commit(7, 2, std::nullopt, 0, files).ok());
  EXPECT_THAT(Entries(root + "/step_7"), ElementsAre("manifest.pbtxt", "rank_0.bin", "rank_1.bin"));
  EXPECT_TRUE(CheckpointDirectory::Validate(root + "/step_7").ok());
}

TEST(CheckpointDirectoryTest, CorruptOrIncompleteCheckpointsAreRefusedByName) {
  const std::string root = TempDir("corrupt");
  CheckpointDirectory dir(root);
  SaveStep(dir, 1, 3.0, 0);
  SaveStep(dir, 2, 3.0, 0);
  SaveStep(dir, 3, 3.0, 0);
  // Flip one byte of step 3, delete a file of step 2.
  {
    std::fstream file(root + "/step_3/rank_1.bin", std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(2);
    file.put('X');
  }
  fs::remove(root + "/step_2/rank_0.bin");
  std::ofstream(root + "/step_1/stale.bin") << "left by an earlier attempt";  // not in the manifest: ignored
  EXPECT_THAT(std::string(dir.Resolve(root + "/step_3").status().message()),
              HasSubstr("step_3/rank_1.bin is corrupt: CRC-32"));
  // Split between two readers, only the one whose share holds rank_1.bin (the second file) sees it.
  EXPECT_TRUE(CheckpointDirectory::Validate(root + "/step_3", 0, 2).ok());
  EXPECT_THAT(std::string(CheckpointDirectory::Validate(root + "/step_3", 1, 2).status().message()),
              HasSubstr("step_3/rank_1.bin is corrupt: CRC-32"));
  EXPECT_THAT(std::string(CheckpointDirectory::Validate(root + "/step_2").status().message()),
              HasSubstr("step_2/rank_0.bin listed in the manifest is missing"));
  auto last = dir.Resolve("last");
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_EQ(last->manifest.step(), 1);
  ASSERT_EQ(last->skipped.size(), 2u);
  EXPECT_THAT(last->skipped[0], HasSubstr("rank_1.bin is corrupt"));
  // A staging directory never committed has no manifest.
  ASSERT_TRUE(dir.StagingPath(4).ok());
  fs::rename(root + "/.step_4.staging", root + "/step_4");
  EXPECT_THAT(std::string(CheckpointDirectory::Validate(root + "/step_4").status().message()),
              HasSubstr("has no manifest.pbtxt: it was not completely written"));
  EXPECT_THAT(std::string(CheckpointDirectory(TempDir("empty")).Resolve("last").status().message()),
              HasSubstr("no valid checkpoint"));
}

}  // namespace
}  // namespace trident
