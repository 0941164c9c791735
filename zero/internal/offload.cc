#include "zero/internal/offload.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "zero/internal/buckets.h"

namespace trident {
namespace zero_internal {
namespace {

constexpr int64_t kPage = 4096;

int64_t RoundUp(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

// pread / pwrite of all `bytes`, whatever they return at a time.
template <typename Call>
absl::Status WholeTransfer(const char* what, const std::string& path, int64_t bytes, int64_t offset, Call call) {
  int64_t done = 0;
  while (done < bytes) {
    const ssize_t n = call(done, static_cast<size_t>(bytes - done), static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return absl::DataLossError(absl::StrCat(what, " ", bytes, " bytes at offset ", offset, " of ", path, ": ",
                                              n < 0 ? std::strerror(errno) : "the file ended",
                                              " (is offload_dir on a full or removed file system?)"));
    }
    done += n;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<OffloadedTensors>> OffloadedTensors::Create(const std::string& dir, int rank,
                                                                           const std::string& what) {
  std::string path = absl::StrCat(dir, "/trident-offload-", what, "-rank", rank, "-XXXXXX");
  const int fd = mkstemp(path.data());
  if (fd < 0) {
    return absl::FailedPreconditionError(absl::StrCat("cannot create an offload file in offload_dir '", dir,
                                                      "': ", std::strerror(errno),
                                                      "; give a writable local directory with enough space"));
  }
  unlink(path.c_str());  // the space goes with the last descriptor
  std::unique_ptr<OffloadedTensors> file(new OffloadedTensors());
  file->fd_ = fd;
  file->path_ = path;
  file->worker_ = std::thread([raw = file.get()] { raw->Work(); });
  return file;
}

OffloadedTensors::~OffloadedTensors() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  if (worker_.joinable()) worker_.join();
  if (fd_ >= 0) close(fd_);
}

void OffloadedTensors::Enqueue(int slot, std::function<absl::Status()> run) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back({slot, std::move(run)});
    last_job_of_slot_[slot] = ++queued_;
  }
  changed_.notify_all();
}

void OffloadedTensors::Work() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    changed_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, with nothing left to do
    Job job = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    absl::Status status = job.run();
    lock.lock();
    if (!status.ok() && failure_.ok()) failure_ = status;
    ++done_;
    changed_.notify_all();
  }
}

void OffloadedTensors::StartWrite(int slot, std::vector<at::Tensor> tensors) {
  std::vector<Place>& places = places_[slot];
  if (places.empty()) {
    for (const at::Tensor& t : tensors) {
      const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
      places.push_back({end_, bytes, t.sizes().vec(), t.scalar_type()});
      end_ = RoundUp(end_ + bytes, kPage);
    }
  }
  Enqueue(slot, [this, places, tensors = std::move(tensors)]() -> absl::Status {
    for (size_t i = 0; i < tensors.size(); ++i) {
      const char* data = static_cast<const char*>(tensors[i].data_ptr());
      absl::Status written =
          WholeTransfer("writing", path_, places[i].bytes, places[i].offset,
                        [&](int64_t done, size_t n, off_t at) { return pwrite(fd_, data + done, n, at); });
      if (!written.ok()) return written;
      bytes_written_ += places[i].bytes;
      FreeStorage(tensors[i]);
    }
    return absl::OkStatus();
  });
}

void OffloadedTensors::StartRead(int slot, std::vector<at::Tensor> tensors) {
  const std::vector<Place>& places = places_.at(slot);
  for (const at::Tensor& t : tensors) AllocateStorage(t);
  Enqueue(slot, [this, places, tensors = std::move(tensors)]() -> absl::Status {
    for (size_t i = 0; i < tensors.size(); ++i) {
      char* data = static_cast<char*>(tensors[i].data_ptr());
      absl::Status read =
          WholeTransfer("reading", path_, places[i].bytes, places[i].offset,
                        [&](int64_t done, size_t n, off_t at) { return pread(fd_, data + done, n, at); });
      if (!read.ok()) return read;
      bytes_read_ += places[i].bytes;
    }
    return absl::OkStatus();
  });
}

bool OffloadedTensors::InFile(int slot) const { return places_.count(slot) > 0; }

absl::Status OffloadedTensors::Wait(int slot) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto last = last_job_of_slot_.find(slot);
  const int64_t until = last == last_job_of_slot_.end() ? 0 : last->second;
  changed_.wait(lock, [&] { return done_ >= until; });
  return std::exchange(failure_, absl::OkStatus());
}

absl::Status OffloadedTensors::WaitAll() {
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [&] { return done_ >= queued_; });
  return std::exchange(failure_, absl::OkStatus());
}

absl::StatusOr<at::Tensor> OffloadedTensors::Mapped(int slot, size_t index, bool writable) const {
  const Place& place = places_.at(slot).at(index);
  const int64_t begin = place.offset / kPage * kPage, length = place.offset + place.bytes - begin;
  void* base = mmap(nullptr, static_cast<size_t>(length), writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED,
                    fd_, static_cast<off_t>(begin));
  if (base == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("mapping ", length, " bytes of the offload file ", path_, ": ", std::strerror(errno)));
  }
  char* data = static_cast<char*>(base) + (place.offset - begin);
  return at::from_blob(
      data, place.sizes, [base, length](void*) { munmap(base, static_cast<size_t>(length)); },
      at::TensorOptions().dtype(place.dtype));
}

}  // namespace zero_internal

absl::StatusOr<DiskBandwidth> MeasureOffloadBandwidth(const std::string& dir, int64_t bytes) {
  std::string path = absl::StrCat(dir, "/trident-offload-probe-XXXXXX");
  const int fd = mkstemp(path.data());
  if (fd < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create a file in offload_dir '", dir, "': ", std::strerror(errno)));
  }
  unlink(path.c_str());
  std::vector<char> data(static_cast<size_t>(bytes), 1);
  using Clock = std::chrono::steady_clock;
  auto seconds_since = [](Clock::time_point start) {
    return std::max(1e-9, std::chrono::duration<double>(Clock::now() - start).count());
  };
  DiskBandwidth bandwidth;
  auto start = Clock::now();
  absl::Status status = zero_internal::WholeTransfer("writing", path, bytes, 0, [&](int64_t done, size_t n, off_t at) {
    return pwrite(fd, data.data() + done, n, at);
  });
  if (status.ok() && fdatasync(fd) != 0) status = absl::DataLossError(absl::StrCat("syncing ", path));
  bandwidth.write_bytes_per_second = static_cast<double>(bytes) / seconds_since(start);
  posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);  // read from the disk, not the page cache
  start = Clock::now();
  if (status.ok()) {
    status = zero_internal::WholeTransfer("reading", path, bytes, 0, [&](int64_t done, size_t n, off_t at) {
      return pread(fd, data.data() + done, n, at);
    });
  }
  bandwidth.read_bytes_per_second = static_cast<double>(bytes) / seconds_since(start);
  close(fd);
  TRIDENT_RETURN_IF_ERROR(status);
  return bandwidth;
}

}  // namespace trident
