#include <algorithm>
#include <fstream>
#include <map>
#include <sstream>
#include <unordered_map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "data/data.h"

namespace trident {
namespace {

class ByteTokenizer : public Tokenizer {
 public:
  std::vector<uint16_t> Encode(absl::string_view text) const override {
    return std::vector<uint16_t>(reinterpret_cast<const unsigned char*>(text.data()),
                                 reinterpret_cast<const unsigned char*>(text.data()) + text.size());
  }
  std::string Decode(const std::vector<int64_t>& tokens) const override {
    std::string text;
    for (int64_t t : tokens) text.push_back(static_cast<char>(t));
    return text;
  }
  int vocab_size() const override { return 256; }
  absl::Status Save(const std::string& path) const override {
    std::ofstream out(path);
    out << "byte\n";
    return out ? absl::OkStatus() : absl::InternalError(absl::StrCat("cannot write ", path));
  }
};

enum class CharClass { kLetter, kDigit, kSpace, kOther };

CharClass Classify(unsigned char c) {
  if (std::isalpha(c) || c >= 0x80) return CharClass::kLetter;
  if (std::isdigit(c)) return CharClass::kDigit;
  if (std::isspace(c)) return CharClass::kSpace;
  return CharClass::kOther;
}

// Splits text into chunks that merges never cross: runs of one character class,
// with a single space joining the run after it (" word"), as GPT-2's pre-tokenizer does.
std::vector<absl::string_view> Chunks(absl::string_view text) {
  std::vector<absl::string_view> chunks;
  const size_t n = text.size();
  size_t start = 0;
  while (start < n) {
    size_t end = start;
    if (text[end] == ' ' && end + 1 < n && Classify(text[end + 1]) != CharClass::kSpace) ++end;
    const CharClass kind = Classify(text[end]);
    while (end < n && Classify(text[end]) == kind) ++end;
    // A whitespace run leaves its last space to the word that follows it.
    if (kind == CharClass::kSpace && end < n && end - start > 1 && text[end - 1] == ' ') --end;
    chunks.push_back(text.substr(start, end - start));
    start = end;
  }
  return chunks;
}

using Pair = std::pair<int, int>;

class BpeTokenizer : public Tokenizer {
 public:
  explicit BpeTokenizer(std::vector<Pair> merges) : merges_(std::move(merges)) {
    for (int i = 0; i < 256; ++i) pieces_.push_back(std::string(1, static_cast<char>(i)));
    for (size_t i = 0; i < merges_.size(); ++i) {
      rank_[merges_[i]] = static_cast<int>(i);
      pieces_.push_back(pieces_[merges_[i].first] + pieces_[merges_[i].second]);
    }
  }

  std::vector<uint16_t> Encode(absl::string_view text) const override {
    std::vector<uint16_t> out;
    std::unordered_map<std::string, std::vector<int>> cache;
    for (absl::string_view chunk : Chunks(text)) {
      auto [it, inserted] = cache.try_emplace(std::string(chunk));
      if (inserted) it->second = EncodeChunk(chunk);
      out.insert(out.end(), it->second.begin(), it->second.end());
    }
    return out;
  }

  std::string Decode(const std::vector<int64_t>& tokens) const override {
    std::string text;
    for (int64_t t : tokens) {
      if (t >= 0 && t < static_cast<int64_t>(pieces_.size())) text += pieces_[t];
    }
    return text;
  }

  int vocab_size() const override { return 256 + static_cast<int>(merges_.size()); }

  absl::Status Save(const std::string& path) const override {
    std::ofstream out(path);
    out << "bpe " << vocab_size() << "\n";
    for (const Pair& m : merges_) out << m.first << " " << m.second << "\n";
    return out ? absl::OkStatus() : absl::InternalError(absl::StrCat("cannot write ", path));
  }

 private:
  std::vector<int> EncodeChunk(absl::string_view chunk) const {
    std::vector<int> ids(reinterpret_cast<const unsigned char*>(chunk.data()),
                         reinterpret_cast<const unsigned char*>(chunk.data()) + chunk.size());
    while (ids.size() > 1) {
      int best = -1;
      size_t at = 0;
      for (size_t i = 0; i + 1 < ids.size(); ++i) {
        auto it = rank_.find({ids[i], ids[i + 1]});
        if (it != rank_.end() && (best < 0 || it->second < best)) {
          best = it->second;
          at = i;
        }
      }
      if (best < 0) break;
      ids[at] = 256 + best;
      ids.erase(ids.begin() + at + 1);
    }
    return ids;
  }

  std::vector<Pair> merges_;
  std::map<Pair, int> rank_;
  std::vector<std::string> pieces_;
};

}  // namespace

std::unique_ptr<Tokenizer> MakeByteTokenizer() { return std::make_unique<ByteTokenizer>(); }

absl::StatusOr<std::unique_ptr<Tokenizer>> TrainBpeTokenizer(absl::string_view text, int vocab_size) {
  if (vocab_size < 256 || vocab_size > 65536) {
    return absl::InvalidArgumentError(absl::StrCat("BPE vocab_size=", vocab_size, " must be in [256, 65536]"));
  }
  std::unordered_map<std::string, int64_t> frequency;
  for (absl::string_view chunk : Chunks(text)) ++frequency[std::string(chunk)];
  std::vector<std::vector<int>> words;
  std::vector<int64_t> counts;
  for (const auto& [word, count] : frequency) {
    words.emplace_back(reinterpret_cast<const unsigned char*>(word.data()),
                       reinterpret_cast<const unsigned char*>(word.data()) + word.size());
    counts.push_back(count);
  }
  std::vector<Pair> merges;
  while (static_cast<int>(merges.size()) + 256 < vocab_size) {
    std::map<Pair, int64_t> pairs;
    for (size_t w = 0; w < words.size(); ++w) {
      for (size_t i = 0; i + 1 < words[w].size(); ++i) pairs[{words[w][i], words[w][i + 1]}] += counts[w];
    }
    if (pairs.empty()) break;  // every word is a single token already
    // The most frequent pair; std::map order breaks ties deterministically.
    auto best =
        std::max_element(pairs.begin(), pairs.end(), [](const auto& a, const auto& b) { return a.second < b.second; });
    const Pair merge = best->first;
    const int id = 256 + static_cast<int>(merges.size());
    merges.push_back(merge);
    for (auto& word : words) {
      for (size_t i = 0; i + 1 < word.size(); ++i) {
        if (word[i] == merge.first && word[i + 1] == merge.second) {
          word[i] = id;
          word.erase(word.begin() + i + 1);
        }
      }
    }
  }
  return std::unique_ptr<Tokenizer>(new BpeTokenizer(std::move(merges)));
}

Registry<TokenizerKind>& TokenizerRegistry() {
  static auto* registry = new Registry<TokenizerKind>("tokenizer");
  return *registry;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizer(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open tokenizer file ", path));
  std::string name;
  in >> name;
  absl::StatusOr<TokenizerKind> kind = TokenizerRegistry().Find(name);
  if (!kind.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("tokenizer file ", path, " starts with '", name,
                                                   "', which is not a tokenizer kind; it should start with one of ",
                                                   absl::StrJoin(TokenizerRegistry().Names(), ", ")));
  }
  return kind->load(in, path);
}

namespace {

// The rest of a "bpe" file: VOCAB_SIZE, then VOCAB_SIZE - 256 merges.
absl::StatusOr<std::unique_ptr<Tokenizer>> LoadBpe(std::istream& in, const std::string& path) {
  int vocab = 0;
  if (!(in >> vocab) || vocab < 256) {
    return absl::InvalidArgumentError(absl::StrCat("tokenizer file ", path, " does not start with 'bpe VOCAB_SIZE'"));
  }
  std::vector<Pair> merges;
  Pair merge;
  while (in >> merge.first >> merge.second) {
    const int next = 256 + static_cast<int>(merges.size());
    if (merge.first < 0 || merge.second < 0 || merge.first >= next || merge.second >= next) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokenizer file ", path, ": merge ", merges.size(), " refers to unknown ids"));
    }
    merges.push_back(merge);
  }
  if (static_cast<int>(merges.size()) + 256 != vocab) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokenizer file ", path, " declares vocab ", vocab, " but has ", merges.size(), " merges"));
  }
  return std::unique_ptr<Tokenizer>(new BpeTokenizer(std::move(merges)));
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Bytes() { return MakeByteTokenizer(); }

TRIDENT_REGISTER(TokenizerRegistry, "byte",
                 TokenizerKind{[](absl::string_view, int) { return Bytes(); },
                               [](std::istream&, const std::string&) { return Bytes(); }});
TRIDENT_REGISTER(TokenizerRegistry, "bpe", TokenizerKind{TrainBpeTokenizer, LoadBpe});

}  // namespace

}  // namespace trident
