#include "parallel/internal/transfer.h"

#include <cstring>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/status.h"

namespace trident {
namespace internal {
namespace {

constexpr int kTransferTag = 1 << 28;

at::Tensor Bytes(const std::string& text) {
  at::Tensor bytes = at::empty({static_cast<int64_t>(text.size())}, at::kByte);
  if (!text.empty()) std::memcpy(bytes.data_ptr(), text.data(), text.size());
  return bytes;
}

std::string Text(const at::Tensor& bytes) {
  return std::string(static_cast<const char*>(bytes.data_ptr()), bytes.numel());
}

// A variable-length message: its length first.
absl::Status SendSized(const ProcessGroup& group, int peer, const at::Tensor& payload, int tag) {
  at::Tensor length = at::full({1}, payload.numel(), at::kLong);
  TRIDENT_RETURN_IF_ERROR(group.Send(length, peer, tag));
  return payload.numel() > 0 ? group.Send(payload.contiguous(), peer, tag + 1) : absl::OkStatus();
}

absl::StatusOr<at::Tensor> RecvSized(const ProcessGroup& group, int peer, at::ScalarType dtype, int tag) {
  at::Tensor length = at::empty({1}, at::kLong);
  TRIDENT_RETURN_IF_ERROR(group.Recv(length, peer, tag));
  at::Tensor payload = at::empty({length.item<int64_t>()}, dtype);
  if (payload.numel() > 0) TRIDENT_RETURN_IF_ERROR(group.Recv(payload, peer, tag + 1));
  return payload;
}

}  // namespace

absl::Status SendNamedTensors(const ProcessGroup& group, int peer, const NamedTensors& tensors) {
  std::vector<std::string> names;
  std::vector<int64_t> layout;  // per tensor: dtype, rank, sizes...
  for (const auto& [name, t] : tensors) {
    names.push_back(name);
    layout.push_back(static_cast<int64_t>(t.scalar_type()));
    layout.push_back(t.dim());
    for (int64_t d : t.sizes()) layout.push_back(d);
  }
  TRIDENT_RETURN_IF_ERROR(SendSized(group, peer, Bytes(absl::StrJoin(names, "\n")), kTransferTag));
  TRIDENT_RETURN_IF_ERROR(SendSized(group, peer, at::tensor(layout, at::kLong), kTransferTag + 2));
  for (const auto& [name, t] : tensors) {
    TRIDENT_RETURN_IF_ERROR(group.Send(t.detach().contiguous(), peer, kTransferTag + 4));
  }
  return absl::OkStatus();
}

absl::StatusOr<NamedTensors> RecvNamedTensors(const ProcessGroup& group, int peer) {
  TRIDENT_ASSIGN_OR_RETURN(at::Tensor names_bytes, RecvSized(group, peer, at::kByte, kTransferTag));
  TRIDENT_ASSIGN_OR_RETURN(at::Tensor layout, RecvSized(group, peer, at::kLong, kTransferTag + 2));
  const std::string joined = Text(names_bytes);
  const std::vector<std::string> names =
      joined.empty() ? std::vector<std::string>() : std::vector<std::string>(absl::StrSplit(joined, '\n'));
  const int64_t* l = layout.data_ptr<int64_t>();
  NamedTensors tensors;
  int64_t at = 0;
  for (const std::string& name : names) {
    const auto dtype = static_cast<at::ScalarType>(l[at++]);
    const int64_t rank = l[at++];
    std::vector<int64_t> shape(l + at, l + at + rank);
    at += rank;
    at::Tensor t = at::empty(shape, dtype);
    TRIDENT_RETURN_IF_ERROR(group.Recv(t, peer, kTransferTag + 4));
    tensors.emplace_back(name, t);
  }
  return tensors;
}

}  // namespace internal
}  // namespace trident
