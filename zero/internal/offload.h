// Tensors kept in a file between uses (ZeRO's offload_optimizer=disk): each
// slot (a bucket) holds a fixed list of CPU tensors, written to its place in
// the file and their memory freed, read back into freshly allocated memory
// before the next use. Reads and writes run in order on one I/O thread, so
// the caller computes while the next slot is read and the last one written.
// Private to zero.
//
//   OffloadedTensors file = *OffloadedTensors::Create("/scratch", rank);
//   file.StartRead(1, state_of_bucket_1);   // memory allocated now, filled there
//   TRIDENT_RETURN_IF_ERROR(file.Wait(0));  // bucket 0's read (and all before it) done
//   ...update bucket 0...
//   file.StartWrite(0, state_of_bucket_0);  // written there, then its memory freed
#ifndef TRIDENT_ZERO_INTERNAL_OFFLOAD_H_
#define TRIDENT_ZERO_INTERNAL_OFFLOAD_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace trident {
namespace zero_internal {

class OffloadedTensors {
 public:
  // A new file under `dir` for this process, `rank` and `what` it holds
  // ("optimizer", "params"), unlinked at once (its space is freed when the
  // process ends, however it ends). Errors name `dir`.
  static absl::StatusOr<std::unique_ptr<OffloadedTensors>> Create(const std::string& dir, int rank,
                                                                  const std::string& what);
  ~OffloadedTensors();  // finishes the I/O under way

  // Queues writing `tensors` (contiguous CPU tensors; the slot's first write
  // fixes their sizes) to `slot`'s place, then freeing their memory (their
  // storage keeps its size and holds nothing, as a released ZeRO-3 bucket's).
  void StartWrite(int slot, std::vector<at::Tensor> tensors);
  // Gives `tensors` memory now and queues reading `slot` into it.
  void StartRead(int slot, std::vector<at::Tensor> tensors);
  // Whether `slot` has been written (its tensors live in the file).
  bool InFile(int slot) const;
  // Waits for the queued I/O up to and including the last on `slot` (all, for
  // WaitAll); returns the first failure since the last wait.
  absl::Status Wait(int slot);
  absl::Status WaitAll();
  // `slot`'s tensor `index` as it is in the file, mapped (the kernel pages it
  // in and out; no copy is made), shaped like the tensor written: read-only,
  // or `writable` (what is written there is in the file, as the next read
  // sees it). WaitAll first, and no I/O on the slot while the tensor is used.
  absl::StatusOr<at::Tensor> Mapped(int slot, size_t index, bool writable = false) const;
  // Bytes written and read so far.
  int64_t bytes_written() const { return bytes_written_.load(); }
  int64_t bytes_read() const { return bytes_read_.load(); }

 private:
  struct Place {
    int64_t offset = 0, bytes = 0;
    std::vector<int64_t> sizes;
    at::ScalarType dtype;
  };
  struct Job {
    int slot;
    std::function<absl::Status()> run;
  };
  OffloadedTensors() = default;
  void Enqueue(int slot, std::function<absl::Status()> run);
  void Work();

  int fd_ = -1;
  std::string path_;
  int64_t end_ = 0;                           // the file's used length
  std::map<int, std::vector<Place>> places_;  // by slot
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Job> queue_;
  int64_t queued_ = 0, done_ = 0;  // jobs ever queued and finished
  std::map<int, int64_t> last_job_of_slot_;
  absl::Status failure_;
  bool stopping_ = false;
  std::atomic<int64_t> bytes_written_{0}, bytes_read_{0};
  std::thread worker_;
};

}  // namespace zero_internal
}  // namespace trident

#endif  // TRIDENT_ZERO_INTERNAL_OFFLOAD_H_
