// DeferredRecords: a TorchScript archive loaded without its weights, each
// parameter's stored values read on request (nnScaler's tracing_from_weights,
// Merak's init_empty_weights, for models saved with torch.jit.save).
//
//   auto loaded = DeferredRecords::Load("model.pt");
//   // loaded->module's parameters read as zeros and hold no resident memory
//   loaded->records->Read({weight});  // now `weight` holds its saved values
//
// The archive is read through LibTorch's own loader; the tensor records it
// asks for (those under data/ of at least kMinDeferredBytes) are allocated by
// it but not written: their pages are handed back to the kernel, so they read
// as zeros and count nothing towards resident memory until Read fills them.
// Records behind anything other than a parameter (buffers, tensor attributes)
// are read before Load returns.
#ifndef TRIDENT_GRAPH_INTERNAL_DEFERRED_RECORDS_H_
#define TRIDENT_GRAPH_INTERNAL_DEFERRED_RECORDS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/StorageImpl.h>
#include <torch/csrc/jit/api/module.h>

#include "absl/status/statusor.h"

namespace trident {
namespace graph_internal {

class DeferredRecords {
 public:
  // Records smaller than this are read as they are loaded.
  static constexpr size_t kMinDeferredBytes = 4096;

  struct Loaded {
    torch::jit::Module module;
    std::shared_ptr<DeferredRecords> records;
  };
  // Loads `path`; errors name the file.
  static absl::StatusOr<Loaded> Load(const std::string& path);
  ~DeferredRecords();

  // Reads the saved values of those `tensors` whose storage is a deferred
  // record not read yet (each once; anything else is left alone). Throws on a
  // short read or I/O error, naming the file. Thread-safe.
  void Read(const std::vector<at::Tensor>& tensors);

 private:
  struct Record {
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
    uint64_t offset;  // in the file
    size_t bytes;
  };
  DeferredRecords(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  void ReadRecord(void* destination, uint64_t offset, size_t bytes) const;

  std::string path_;
  int fd_ = -1;
  mutable std::mutex mutex_;
  std::map<const c10::StorageImpl*, Record> deferred_;
};

}  // namespace graph_internal
}  // namespace trident

#endif  // TRIDENT_GRAPH_INTERNAL_DEFERRED_RECORDS_H_
