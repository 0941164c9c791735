// TensorSlice: where a stored piece sits in the single-process tensor, and
// copying between pieces of different layouts.
#include <algorithm>

#include <ATen/ATen.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "checkpoint/checkpoint.h"

namespace trident {
namespace {

std::vector<int64_t> ContiguousStrides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (int64_t d = static_cast<int64_t>(shape.size()) - 2; d >= 0; --d) strides[d] = strides[d + 1] * shape[d + 1];
  return strides;
}

int64_t Product(const std::vector<int64_t>& v) {
  int64_t n = 1;
  for (int64_t x : v) n *= x;
  return n;
}

struct Box {
  std::vector<int64_t> offsets, lengths;
};

// Splits elements [begin, end) of the row-major flattening of `shape` into
// boxes, in order (each box's elements are consecutive in that order).
void FlatBoxes(const std::vector<int64_t>& shape, size_t dim, std::vector<int64_t> prefix, int64_t begin, int64_t end,
               std::vector<Box>* out) {
  if (begin >= end) return;
  const std::vector<int64_t> rest(shape.begin() + dim, shape.end());
  auto emit = [&](int64_t from, int64_t count) {  // rows [from, from + count) of dimension `dim`, whole below
    Box box{prefix, std::vector<int64_t>(dim, 1)};
    if (dim < shape.size()) {
      box.offsets.push_back(from);
      box.lengths.push_back(count);
      for (size_t d = dim + 1; d < shape.size(); ++d) {
        box.offsets.push_back(0);
        box.lengths.push_back(shape[d]);
      }
    }
    out->push_back(std::move(box));
  };
  if (dim == shape.size()) {  // a single element (or a 0-d tensor)
    emit(0, 1);
    return;
  }
  const int64_t inner = Product(std::vector<int64_t>(shape.begin() + dim + 1, shape.end()));
  int64_t first = begin / inner;
  const int64_t last = (end - 1) / inner;  // rows touched: [first, last]
  auto descend = [&](int64_t row, int64_t from, int64_t to) {
    std::vector<int64_t> deeper = prefix;
    deeper.push_back(row);
    FlatBoxes(shape, dim + 1, deeper, from, to, out);
  };
  if (first == last) {
    descend(first, begin - first * inner, end - first * inner);
    return;
  }
  if (begin % inner != 0) descend(first++, begin % inner, inner);
  const int64_t full_end = end % inner == 0 ? last + 1 : last;
  if (full_end > first) emit(first, full_end - first);
  if (end % inner != 0) descend(last, 0, end % inner);
}

// The intersection of two boxes of the same rank; false when empty.
bool Intersect(const std::vector<int64_t>& a_offsets, const std::vector<int64_t>& a_lengths,
               const std::vector<int64_t>& b_offsets, const std::vector<int64_t>& b_lengths, Box* out) {
  out->offsets.resize(a_offsets.size());
  out->lengths.resize(a_offsets.size());
  for (size_t d = 0; d < a_offsets.size(); ++d) {
    const int64_t lo = std::max(a_offsets[d], b_offsets[d]);
    const int64_t hi = std::min(a_offsets[d] + a_lengths[d], b_offsets[d] + b_lengths[d]);
    if (hi <= lo) return false;
    out->offsets[d] = lo;
    out->lengths[d] = hi - lo;
  }
  return true;
}

// Where element `at` of `segment`'s box sits in the piece's data.
int64_t DataIndex(const SliceSegment& segment, const std::vector<int64_t>& at) {
  int64_t index = segment.data_offset;
  for (size_t d = 0; d < at.size(); ++d) index += (at[d] - segment.offsets[d]) * segment.data_strides[d];
  return index;
}

std::string Join(const std::vector<int64_t>& v) { return absl::StrJoin(v, ","); }

bool ParseList(absl::string_view text, std::vector<int64_t>* out) {
  out->clear();
  if (text.empty()) return true;
  for (absl::string_view item : absl::StrSplit(text, ',')) {
    int64_t value;
    if (!absl::SimpleAtoi(item, &value)) return false;
    out->push_back(value);
  }
  return true;
}

}  // namespace

bool SliceSegment::operator==(const SliceSegment& other) const {
  return offsets == other.offsets && lengths == other.lengths && data_offset == other.data_offset &&
         data_strides == other.data_strides;
}

TensorSlice TensorSlice::Whole(std::vector<int64_t> shape) {
  TensorSlice slice;
  slice.segments.push_back({std::vector<int64_t>(shape.size(), 0), shape, 0, ContiguousStrides(shape)});
  slice.local_shape = shape;
  slice.full_shape = std::move(shape);
  return slice;
}

TensorSlice TensorSlice::BlockShard(std::vector<int64_t> full_shape, int64_t dim, int64_t blocks, int64_t index,
                                    int64_t parts) {
  TensorSlice slice;
  const int64_t block = full_shape[dim] / blocks, part = block / parts;
  slice.local_shape = full_shape;
  slice.local_shape[dim] = blocks * part;
  const std::vector<int64_t> strides = ContiguousStrides(slice.local_shape);
  for (int64_t b = 0; b < blocks; ++b) {
    SliceSegment segment{std::vector<int64_t>(full_shape.size(), 0), full_shape, b * part * strides[dim], strides};
    segment.offsets[dim] = b * block + index * part;
    segment.lengths[dim] = part;
    slice.segments.push_back(std::move(segment));
  }
  slice.full_shape = std::move(full_shape);
  return slice;
}

TensorSlice TensorSlice::FlatRange(int64_t begin, int64_t end) const {
  const std::vector<int64_t> strides = ContiguousStrides(local_shape);
  std::vector<Box> boxes;
  FlatBoxes(local_shape, 0, {}, begin, end, &boxes);
  TensorSlice part;
  part.full_shape = full_shape;
  part.local_shape = {end - begin};
  for (const SliceSegment& s : segments) {
    // The segment's box in the piece's own coordinates.
    std::vector<int64_t> local(local_shape.size());
    int64_t rest = s.data_offset;
    for (size_t d = 0; d < local.size(); ++d) {
      local[d] = rest / strides[d];
      rest %= strides[d];
    }
    for (const Box& box : boxes) {
      Box common;
      if (!Intersect(local, s.lengths, box.offsets, box.lengths, &common)) continue;
      SliceSegment segment{common.offsets, common.lengths, 0, strides};
      int64_t flat = 0;
      for (size_t d = 0; d < local.size(); ++d) {
        segment.offsets[d] = s.offsets[d] + common.offsets[d] - local[d];
        flat += common.offsets[d] * strides[d];
      }
      segment.data_offset = flat - begin;
      part.segments.push_back(std::move(segment));
    }
  }
  return part;
}

int64_t TensorSlice::numel() const {
  int64_t n = 0;
  for (const SliceSegment& s : segments) n += Product(s.lengths);
  return n;
}

bool TensorSlice::whole() const {
  return segments.size() == 1 && segments[0].lengths == full_shape && segments[0].data_offset == 0 &&
         segments[0].data_strides == ContiguousStrides(full_shape);
}

std::string TensorSlice::Encode() const {
  std::vector<std::string> parts = {Join(full_shape), Join(local_shape)};
  for (const SliceSegment& s : segments) {
    parts.push_back(absl::StrCat(Join(s.offsets), ";", Join(s.lengths), ";", s.data_offset, ";", Join(s.data_strides)));
  }
  return absl::StrJoin(parts, "|");
}

absl::StatusOr<TensorSlice> TensorSlice::Decode(const std::string& text) {
  auto bad = [&] { return absl::DataLossError(absl::StrCat("malformed tensor slice '", text, "'")); };
  std::vector<absl::string_view> parts = absl::StrSplit(text, '|');
  TensorSlice slice;
  if (parts.size() < 2 || !ParseList(parts[0], &slice.full_shape) || !ParseList(parts[1], &slice.local_shape)) {
    return bad();
  }
  for (size_t i = 2; i < parts.size(); ++i) {
    std::vector<absl::string_view> fields = absl::StrSplit(parts[i], ';');
    SliceSegment s;
    if (fields.size() != 4 || !ParseList(fields[0], &s.offsets) || !ParseList(fields[1], &s.lengths) ||
        !absl::SimpleAtoi(fields[2], &s.data_offset) || !ParseList(fields[3], &s.data_strides) ||
        s.offsets.size() != slice.full_shape.size() || s.lengths.size() != s.offsets.size() ||
        s.data_strides.size() != s.offsets.size()) {
      return bad();
    }
    for (size_t d = 0; d < s.offsets.size(); ++d) {
      if (s.offsets[d] < 0 || s.lengths[d] < 0 || s.offsets[d] + s.lengths[d] > slice.full_shape[d]) return bad();
    }
    slice.segments.push_back(std::move(s));
  }
  return slice;
}

int64_t CopyOverlap(const TensorSlice& source, const at::Tensor& source_data, const TensorSlice& target,
                    at::Tensor& target_data, at::Tensor* covered) {
  int64_t copied = 0;
  for (const SliceSegment& t : target.segments) {
    for (const SliceSegment& s : source.segments) {
      Box common;
      if (!Intersect(t.offsets, t.lengths, s.offsets, s.lengths, &common)) continue;
      at::Tensor from = source_data.as_strided(common.lengths, s.data_strides,
                                               source_data.storage_offset() + DataIndex(s, common.offsets));
      const int64_t into = DataIndex(t, common.offsets);
      target_data.as_strided(common.lengths, t.data_strides, target_data.storage_offset() + into).copy_(from);
      copied += Product(common.lengths);
      if (covered != nullptr) {
        covered->as_strided(common.lengths, t.data_strides, covered->storage_offset() + into).fill_(1);
      }
    }
  }
  return copied;
}

absl::Status WriteSlicedSafetensors(const std::string& path, const std::vector<SlicedTensor>& pieces,
                                    std::map<std::string, std::string> metadata, Checksum* checksum) {
  NamedTensors tensors;
  for (const SlicedTensor& piece : pieces) {
    if (piece.data.numel() != piece.slice.numel()) {
      return absl::InternalError(absl::StrCat("piece of '", piece.name, "' holds ", piece.data.numel(),
                                              " elements but its slice ", piece.slice.numel()));
    }
    if (piece.slice.whole()) {
      tensors.emplace_back(piece.name, piece.data.reshape(piece.slice.full_shape));
    } else {
      tensors.emplace_back(piece.name, piece.data.reshape({-1}));
      metadata["slice:" + piece.name] = piece.slice.Encode();
    }
  }
  return WriteSafetensors(path, tensors, metadata, checksum);
}

}  // namespace trident
