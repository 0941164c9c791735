#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/internal/safetensors_header.h"

namespace trident {
namespace {

const std::vector<std::pair<at::ScalarType, const char*>>& DtypeNames() {
  static const auto* names = new std::vector<std::pair<at::ScalarType, const char*>>{
      {at::kDouble, "F64"}, {at::kFloat, "F32"}, {at::kHalf, "F16"}, {at::kBFloat16, "BF16"}, {at::kLong, "I64"},
      {at::kInt, "I32"},    {at::kShort, "I16"}, {at::kChar, "I8"},  {at::kByte, "U8"},       {at::kBool, "BOOL"}};
  return *names;
}

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char escaped[8];
      std::snprintf(escaped, sizeof(escaped), "\\u%04x", c);
      out += escaped;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

// A parsed JSON value: just what safetensors headers use.
struct Json {
  enum Kind { kNull, kNumber, kString, kArray, kObject } kind = kNull;
  double number = 0;
  std::string text;
  std::vector<Json> items;
  std::vector<std::pair<std::string, Json>> members;
  const Json* Find(const std::string& key) const {
    for (const auto& m : members) {
      if (m.first == key) return &m.second;
    }
    return nullptr;
  }
};

class JsonParser {
 public:
  explicit JsonParser(const std::string& text) : s_(text) {}
  bool Parse(Json* out) {
    if (!Value(out)) return false;
    Skip();
    return pos_ == s_.size();
  }

 private:
  void Skip() {
    while (pos_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[pos_]))) ++pos_;
  }
  bool Eat(char c) {
    Skip();
    if (pos_ < s_.size() && s_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  bool String(std::string* out) {
    if (!Eat('"')) return false;
    while (pos_ < s_.size() && s_[pos_] != '"') {
      char c = s_[pos_++];
      if (c == '\\') {
        if (pos_ >= s_.size()) return false;
        char e = s_[pos_++];
        if (e == 'n')
          c = '\n';
        else if (e == 't')
          c = '\t';
        else if (e == 'r')
          c = '\r';
        else if (e == 'u') {
          if (pos_ + 4 > s_.size()) return false;
          c = static_cast<char>(std::stoi(s_.substr(pos_, 4), nullptr, 16));
          pos_ += 4;
        } else {
          c = e;
        }
      }
      out->push_back(c);
    }
    return Eat('"');
  }
  bool Value(Json* out) {
    Skip();
    if (pos_ >= s_.size()) return false;
    const char c = s_[pos_];
    if (c == '{') {
      ++pos_;
      out->kind = Json::kObject;
      if (Eat('}')) return true;
      do {
        std::string key;
        Json value;
        if (!String(&key) || !Eat(':') || !Value(&value)) return false;
        out->members.emplace_back(std::move(key), std::move(value));
      } while (Eat(','));
      return Eat('}');
    }
    if (c == '[') {
      ++pos_;
      out->kind = Json::kArray;
      if (Eat(']')) return true;
      do {
        Json value;
        if (!Value(&value)) return false;
        out->items.push_back(std::move(value));
      } while (Eat(','));
      return Eat(']');
    }
    if (c == '"') {
      out->kind = Json::kString;
      return String(&out->text);
    }
    size_t end = pos_;
    while (end < s_.size() && std::strchr("+-0123456789.eE", s_[end]) != nullptr) ++end;
    if (end == pos_) return false;
    out->kind = Json::kNumber;
    out->number = std::stod(s_.substr(pos_, end - pos_));
    pos_ = end;
    return true;
  }

  const std::string& s_;
  size_t pos_ = 0;
};

}  // namespace

absl::Status WriteSafetensors(const std::string& path, const NamedTensors& tensors,
                              const std::map<std::string, std::string>& metadata, Checksum* checksum) {
  std::vector<std::string> entries;
  if (!metadata.empty()) {
    std::vector<std::string> fields;
    for (const auto& [k, v] : metadata) fields.push_back(JsonString(k) + ":" + JsonString(v));
    entries.push_back("\"__metadata__\":{" + absl::StrJoin(fields, ",") + "}");
  }
  std::vector<at::Tensor> contiguous;
  int64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    const char* dtype = nullptr;
    for (const auto& [type, label] : DtypeNames()) {
      if (type == tensor.scalar_type()) dtype = label;
    }
    if (dtype == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("safetensors cannot store tensor '", name, "' of dtype ", c10::toString(tensor.scalar_type())));
    }
    contiguous.push_back(tensor.detach().to(at::kCPU).contiguous());
    const int64_t bytes = contiguous.back().numel() * contiguous.back().element_size();
    entries.push_back(absl::StrCat(JsonString(name), ":{\"dtype\":\"", dtype, "\",\"shape\":[",
                                   absl::StrJoin(tensor.sizes(), ","), "],\"data_offsets\":[", offset, ",",
                                   offset + bytes, "]}"));
    offset += bytes;
  }
  std::string header = "{" + absl::StrJoin(entries, ",") + "}";
  header.append((8 - header.size() % 8) % 8, ' ');
  const uint64_t header_size = header.size();
  // POSIX calls rather than a stream, so that a failure says why (disk full,
  // permission denied); a partly written file is removed.
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  bool ok = fd >= 0;
  uLong crc = crc32(0L, Z_NULL, 0);
  int64_t written = 0;
  auto write_all = [&](const void* data, size_t size) {
    const char* p = static_cast<const char*>(data);
    if (checksum != nullptr) {
      for (size_t done = 0; done < size;) {  // zlib takes at most 4 GiB at a time
        const uInt part = static_cast<uInt>(std::min<size_t>(size - done, 1u << 30));
        crc = crc32(crc, reinterpret_cast<const Bytef*>(p + done), part);
        done += part;
      }
    }
    written += static_cast<int64_t>(size);
    while (ok && size > 0) {
      const ssize_t n = ::write(fd, p, size);
      if (n < 0 && errno == EINTR) continue;
      ok = n > 0;
      p += std::max<ssize_t>(n, 0);
      size -= static_cast<size_t>(std::max<ssize_t>(n, 0));
    }
  };
  write_all(&header_size, sizeof(header_size));
  write_all(header.data(), header.size());
  for (const at::Tensor& t : contiguous) write_all(t.data_ptr(), t.numel() * t.element_size());
  int error = ok ? 0 : errno;
  if (fd >= 0 && ::close(fd) != 0 && ok) {
    ok = false;
    error = errno;
  }
  if (ok) {
    if (checksum != nullptr) *checksum = {static_cast<uint32_t>(crc), written};
    return absl::OkStatus();
  }
  if (fd >= 0) ::unlink(path.c_str());
  const std::string message = absl::StrCat("cannot write safetensors file ", path, ": ", std::strerror(error));
  if (error == ENOSPC || error == EDQUOT) return absl::ResourceExhaustedError(message);
  if (error == EACCES || error == EPERM || error == EROFS) return absl::PermissionDeniedError(message);
  return absl::InternalError(message);
}

absl::StatusOr<at::Tensor> SafetensorsContents::Get(const std::string& name) const {
  for (const auto& [key, tensor] : tensors) {
    if (key == name) return tensor;
  }
  return absl::NotFoundError(absl::StrCat("safetensors file ", path, " has no tensor '", name, "'"));
}

namespace internal {

absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(const std::string& path, const char* data, uint64_t size) {
  auto malformed = [&path](const std::string& what) {
    return absl::DataLossError(absl::StrCat("safetensors file ", path, " is malformed: ", what));
  };
  uint64_t header_size = 0;
  if (size < 8) return malformed("shorter than its 8-byte header length");
  std::memcpy(&header_size, data, 8);
  if (header_size > size - 8) return malformed("header length exceeds the file");
  Json header;
  if (!JsonParser(std::string(data + 8, header_size)).Parse(&header) || header.kind != Json::kObject) {
    return malformed("the header is not a JSON object");
  }
  const uint64_t data_size = size - 8 - header_size;
  SafetensorsHeader parsed;
  for (const auto& [name, entry] : header.members) {
    if (name == "__metadata__") {
      for (const auto& [k, v] : entry.members) parsed.metadata[k] = v.text;
      continue;
    }
    const Json* dtype = entry.Find("dtype");
    const Json* shape = entry.Find("shape");
    const Json* offsets = entry.Find("data_offsets");
    if (dtype == nullptr || shape == nullptr || offsets == nullptr || offsets->items.size() != 2) {
      return malformed(absl::StrCat("tensor '", name, "' lacks dtype, shape or data_offsets"));
    }
    std::optional<at::ScalarType> type;
    for (const auto& [t, label] : DtypeNames()) {
      if (dtype->text == label) type = t;
    }
    if (!type) return malformed(absl::StrCat("tensor '", name, "' has unknown dtype ", dtype->text));
    SafetensorsEntry e{name, *type, {}, 0, 0};
    for (const Json& d : shape->items) e.shape.push_back(static_cast<int64_t>(d.number));
    const uint64_t begin = static_cast<uint64_t>(offsets->items[0].number);
    const uint64_t end = static_cast<uint64_t>(offsets->items[1].number);
    const uint64_t expected = static_cast<uint64_t>(c10::multiply_integers(e.shape)) * c10::elementSize(*type);
    if (end < begin || end > data_size || end - begin != expected) {
      return malformed(absl::StrCat("tensor '", name, "' has data offsets [", begin, ", ", end,
                                    ") that do not fit its shape or the file"));
    }
    e.begin = 8 + header_size + begin;
    e.end = 8 + header_size + end;
    parsed.entries.push_back(std::move(e));
  }
  return parsed;
}

}  // namespace internal

absl::StatusOr<SafetensorsContents> ReadSafetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open safetensors file ", path));
  std::ostringstream buffer;
  buffer << in.rdbuf();
  const std::string bytes = buffer.str();
  TRIDENT_ASSIGN_OR_RETURN(internal::SafetensorsHeader header,
                           internal::ParseSafetensorsHeader(path, bytes.data(), bytes.size()));
  SafetensorsContents contents;
  contents.path = path;
  contents.metadata = std::move(header.metadata);
  for (const internal::SafetensorsEntry& e : header.entries) {
    at::Tensor tensor = at::empty(e.shape, at::TensorOptions().dtype(e.dtype));
    std::memcpy(tensor.data_ptr(), bytes.data() + e.begin, e.end - e.begin);
    contents.tensors.emplace_back(e.name, std::move(tensor));
  }
  return contents;
}

}  // namespace trident
