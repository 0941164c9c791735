#include "graph/internal/deferred_records.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <set>

#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>
#include <caffe2/serialize/read_adapter_interface.h>
#include <torch/csrc/jit/serialization/import.h>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace trident {
namespace graph_internal {
namespace {

void ReadFully(int fd, const std::string& path, void* destination, size_t bytes, uint64_t offset) {
  auto* out = static_cast<char*>(destination);
  while (bytes > 0) {
    const ssize_t got = pread(fd, out, bytes, static_cast<off_t>(offset));
    if (got < 0 && errno == EINTR) continue;
    TORCH_CHECK(got > 0, "reading ", path, " at byte ", offset, ": ",
                got == 0 ? std::string("the file ends early") : std::string(std::strerror(errno)));
    out += got;
    bytes -= static_cast<size_t>(got);
    offset += static_cast<uint64_t>(got);
  }
}

// Makes [data, data + bytes) read as zeros without touching its whole pages:
// they go back to the kernel (private anonymous memory refills with zeros).
void ZeroWithoutTouching(void* data, size_t bytes) {
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data), end = begin + bytes;
  const uintptr_t inner_begin = (begin + page - 1) / page * page, inner_end = end / page * page;
  if (inner_end <= inner_begin ||
      madvise(reinterpret_cast<void*>(inner_begin), inner_end - inner_begin, MADV_DONTNEED) != 0) {
    std::memset(data, 0, bytes);
    return;
  }
  std::memset(data, 0, inner_begin - begin);
  std::memset(reinterpret_cast<void*>(inner_end), 0, end - inner_end);
}

// Serves the archive to LibTorch's loader from `fd`, leaving the tensor
// records that start at `deferred_offsets` unwritten (zeros) and noting where
// each went.
class DeferringReader : public caffe2::serialize::ReadAdapterInterface {
 public:
  struct Skipped {
    void* destination;
    uint64_t offset;
    size_t bytes;
  };
  DeferringReader(int fd, std::string path, size_t size, std::set<uint64_t> deferred_offsets)
      : fd_(fd), path_(std::move(path)), size_(size), deferred_offsets_(std::move(deferred_offsets)) {}
  size_t size() const override { return size_; }
  size_t read(uint64_t pos, void* buf, size_t n, const char* /*what*/) const override {
    if (n >= DeferredRecords::kMinDeferredBytes && deferred_offsets_.count(pos) > 0) {
      ZeroWithoutTouching(buf, n);
      skipped_.push_back({buf, pos, n});
      return n;
    }
    ReadFully(fd_, path_, buf, n, pos);
    return n;
  }
  const std::vector<Skipped>& skipped() const { return skipped_; }

 private:
  int fd_;
  std::string path_;
  size_t size_;
  std::set<uint64_t> deferred_offsets_;
  mutable std::vector<Skipped> skipped_;
};

// "data/12": a tensor record of the module's state (not code or constants).
bool IsDataRecord(const std::string& name) {
  if (!absl::StartsWith(name, "data/")) return false;
  const std::string key = name.substr(5);
  if (key.empty()) return false;
  for (char c : key) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

void AddStorage(const c10::IValue& value, std::map<const void*, c10::intrusive_ptr<c10::StorageImpl>>* storages) {
  auto add = [&](const at::Tensor& t) {
    if (t.defined() && t.has_storage()) {
      storages->emplace(t.storage().data(),
                        c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(t.storage().unsafeGetStorageImpl()));
    }
  };
  if (value.isTensor()) add(value.toTensor());
  if (value.isTensorList()) {
    for (const at::Tensor& t : value.toTensorVector()) add(t);
  }
}

}  // namespace

absl::StatusOr<DeferredRecords::Loaded> DeferredRecords::Load(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::NotFoundError(
        absl::StrCat("loading TorchScript module ", path, ": cannot open it (", std::strerror(errno), ")"));
  }
  std::shared_ptr<DeferredRecords> records(new DeferredRecords(path, fd));
  const off_t size = lseek(fd, 0, SEEK_END);
  std::set<uint64_t> offsets;
  TRIDENT_RETURN_IF_ERROR(CatchExceptions(absl::StrCat("loading TorchScript module ", path), [&] {
    caffe2::serialize::PyTorchStreamReader directory(path);
    for (const std::string& name : directory.getAllRecords()) {
      if (IsDataRecord(name)) offsets.insert(directory.getRecordOffset(name));
    }
  }));
  auto reader = std::make_shared<DeferringReader>(fd, path, static_cast<size_t>(size), std::move(offsets));
  Loaded loaded;
  TRIDENT_RETURN_IF_ERROR(CatchExceptions(absl::StrCat("loading TorchScript module ", path), [&] {
    loaded.module = torch::jit::load(std::static_pointer_cast<caffe2::serialize::ReadAdapterInterface>(reader));
  }));
  // Where each skipped record went: a parameter's storage stays deferred; any
  // other holder's is read now.
  std::map<const void*, c10::intrusive_ptr<c10::StorageImpl>> parameters, others;
  for (const auto& item : loaded.module.named_parameters(/*recurse=*/true)) AddStorage(item.value, &parameters);
  for (const auto& item : loaded.module.named_attributes(/*recurse=*/true)) AddStorage(item.value, &others);
  for (const DeferringReader::Skipped& skipped : reader->skipped()) {
    if (auto it = parameters.find(skipped.destination); it != parameters.end()) {
      if (it->second->nbytes() < skipped.bytes) {
        return absl::InternalError(absl::StrCat("loading TorchScript module ", path, ": the record at byte ",
                                                skipped.offset, " is larger than the storage it was loaded into"));
      }
      records->deferred_.emplace(it->second.get(), Record{c10::weak_intrusive_ptr<c10::StorageImpl>(it->second),
                                                          skipped.offset, skipped.bytes});
    } else if (others.count(skipped.destination) > 0) {
      TRIDENT_RETURN_IF_ERROR(CatchExceptions(absl::StrCat("loading TorchScript module ", path), [&] {
        records->ReadRecord(skipped.destination, skipped.offset, skipped.bytes);
      }));
    } else {
      return absl::FailedPreconditionError(
          absl::StrCat("loading TorchScript module ", path, ": a tensor record at byte ", skipped.offset,
                       " belongs to no parameter, buffer or tensor attribute of the module, so it cannot be "
                       "read later; load the module whole"));
    }
  }
  loaded.records = std::move(records);
  return loaded;
}

DeferredRecords::~DeferredRecords() {
  if (fd_ >= 0) close(fd_);
}

void DeferredRecords::ReadRecord(void* destination, uint64_t offset, size_t bytes) const {
  ReadFully(fd_, path_, destination, bytes, offset);
}

void DeferredRecords::Read(const std::vector<at::Tensor>& tensors) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const at::Tensor& t : tensors) {
    if (!t.defined() || !t.has_storage()) continue;
    auto it = deferred_.find(t.storage().unsafeGetStorageImpl());
    if (it == deferred_.end()) continue;
    c10::intrusive_ptr<c10::StorageImpl> storage = it->second.storage.lock();
    if (storage && storage.get() == it->first) ReadRecord(storage->data(), it->second.offset, it->second.bytes);
    deferred_.erase(it);
  }
}

}  // namespace graph_internal
}  // namespace trident
