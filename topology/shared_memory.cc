#include "topology/shared_memory.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"

namespace trident {
namespace internal {

namespace {

struct alignas(64) ArrivalCounter {
  std::atomic<uint64_t> phase;
};

// The start of the segment; the slots follow at kHeaderBytes.
struct Header {
  uint64_t nonce;
  int32_t ranks;
  std::atomic<int32_t> pids[SharedMemoryChannel::kMaxRanks];
  alignas(64) SharedWord arrivals;                         // notified by every arrival
  ArrivalCounter arrived[SharedMemoryChannel::kMaxRanks];  // the last phase each rank reached
};

constexpr size_t kHeaderBytes = (sizeof(Header) + 4095) / 4096 * 4096;
constexpr auto kSpin = std::chrono::microseconds(50);
constexpr auto kSleepSlice = std::chrono::milliseconds(50);

size_t SegmentBytes(int ranks) {
  return kHeaderBytes + static_cast<size_t>(2 * (ranks + 1)) * SharedMemoryChannel::kSlotBytes;
}

}  // namespace

std::string Errno(const char* what) { return absl::StrCat(what, ": ", std::strerror(errno)); }

namespace {

bool ProcessExited(int pid) { return pid > 0 && kill(pid, 0) != 0 && errno == ESRCH; }

void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::nanoseconds timeout) {
  timespec relative{static_cast<time_t>(timeout.count() / 1000000000), static_cast<long>(timeout.count() % 1000000000)};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &relative, nullptr, 0);
}

void FutexWakeAll(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// out = a (op) b; then out (op)= c for each further rank, in rank order.
void Combine(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      at::add_out(out, a, b);
      return;
    case ReduceOp::kMax:
      at::maximum_out(out, a, b);
      return;
    case ReduceOp::kMin:
      at::minimum_out(out, a, b);
      return;
    case ReduceOp::kProduct:
      at::mul_out(out, a, b);
      return;
  }
}

}  // namespace

void SharedWord::Notify() {
  epoch.fetch_add(1);
  if (sleepers.load() > 0) FutexWakeAll(&epoch);
}

bool WaitOn(SharedWord& word, bool spin, std::chrono::steady_clock::time_point deadline,
            const std::function<bool()>& ready, const std::function<bool()>& give_up) {
  auto now = std::chrono::steady_clock::now();
  for (const auto spin_end = now + kSpin; spin && now < spin_end; now = std::chrono::steady_clock::now()) {
    for (int i = 0; i < 64; ++i) {
      if (ready()) return true;
      CpuRelax();
    }
  }
  while (true) {
    const uint32_t seen = word.epoch.load();
    if (ready()) return true;
    word.sleepers.fetch_add(1);
    if (!ready()) FutexWait(&word.epoch, seen, kSleepSlice);
    word.sleepers.fetch_sub(1);
    if (ready()) return true;
    if (give_up() || std::chrono::steady_clock::now() >= deadline) return false;
  }
}

SharedMemoryChannel::SharedMemoryChannel(std::string name, int rank, int ranks, void* base, size_t bytes, bool owner)
    : name_(std::move(name)),
      rank_(rank),
      ranks_(ranks),
      base_(base),
      bytes_(bytes),
      owner_(owner),
      spin_(ranks <= static_cast<int>(std::thread::hardware_concurrency())) {}

SharedMemoryChannel::~SharedMemoryChannel() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  if (worker_.joinable()) worker_.join();  // after the started operations
  for (auto& outbox : outboxes_) {
    if (outbox) outbox->receiver_exited = PeerExited(outbox->peer);
  }
  outboxes_.clear();  // their threads read the peers' pids here
  inboxes_.clear();
  // Mailboxes to this rank that it never opened: nobody else will.
  for (int src = 0; src < ranks_; ++src) {
    if (src != rank_) shm_unlink(MailboxName(src, rank_).c_str());
  }
  munmap(base_, bytes_);
  if (owner_) shm_unlink(name_.c_str());
}

absl::StatusOr<void*> CreateSegment(const std::string& name, size_t bytes) {
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) return absl::UnavailableError(Errno(absl::StrCat("shm_open(", name, ")").c_str()));
  // posix_fallocate reserves the pages: without it a full /dev/shm would
  // surface as SIGBUS at the first write.
  const int reserved =
      ftruncate(fd, static_cast<off_t>(bytes)) != 0 ? errno : posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  void* base = reserved == 0 ? mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
  const int mapped = base == MAP_FAILED ? (reserved != 0 ? reserved : errno) : 0;
  close(fd);
  if (mapped != 0) {
    shm_unlink(name.c_str());
    return absl::UnavailableError(absl::StrCat("reserving ", bytes >> 20, " MiB of shared memory for ", name,
                                               " failed: ", std::strerror(mapped),
                                               " (is /dev/shm full or too small?)"));
  }
  return base;
}

absl::StatusOr<void*> MapSegment(const std::string& name, size_t bytes) {
  const int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) {
    if (errno == ENOENT) return absl::NotFoundError(absl::StrCat(name, " does not exist"));
    return absl::UnavailableError(Errno(absl::StrCat("shm_open(", name, ")").c_str()));
  }
  struct stat info;
  const bool sized = fstat(fd, &info) == 0 && static_cast<size_t>(info.st_size) == bytes;
  void* base = sized ? mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
  const int failure = errno;  // before close() can change it
  close(fd);
  if (base == MAP_FAILED) {
    if (!sized) return absl::FailedPreconditionError(absl::StrCat("mapping ", name, " failed: it has another size"));
    return absl::UnavailableError(absl::StrCat("mapping ", name, " failed: ", std::strerror(failure)));
  }
  return base;
}

absl::StatusOr<std::unique_ptr<SharedMemoryChannel>> SharedMemoryChannel::Create(int ranks) {
  if (ranks < 2 || ranks > kMaxRanks) {
    return absl::InvalidArgumentError(absl::StrCat("shared memory serves 2 to ", kMaxRanks, " ranks, not ", ranks));
  }
  static std::atomic<int> created{0};
  const std::string name = absl::StrCat("/trident-", getpid(), "-", created++);
  const size_t bytes = SegmentBytes(ranks);
  TRIDENT_ASSIGN_OR_RETURN(void* base, CreateSegment(name, bytes));
  auto* header = new (base) Header();
  std::random_device random;
  header->nonce = (uint64_t{random()} << 32) ^ random() ^ static_cast<uint64_t>(getpid());
  header->ranks = ranks;
  header->pids[0].store(getpid());
  return std::unique_ptr<SharedMemoryChannel>(new SharedMemoryChannel(name, 0, ranks, base, bytes, /*owner=*/true));
}

absl::StatusOr<std::unique_ptr<SharedMemoryChannel>> SharedMemoryChannel::Open(const std::string& name, uint64_t nonce,
                                                                               int rank, int ranks) {
  const size_t bytes = SegmentBytes(ranks);
  TRIDENT_ASSIGN_OR_RETURN(void* base, MapSegment(name, bytes));
  auto channel = std::unique_ptr<SharedMemoryChannel>(new SharedMemoryChannel(name, rank, ranks, base, bytes, false));
  const Header* header = static_cast<const Header*>(base);
  if (header->nonce != nonce || header->ranks != ranks) {
    return absl::UnavailableError(absl::StrCat(name,
                                               " here is not the segment rank 0 created (another host's "
                                               "/dev/shm or another job's)"));
  }
  static_cast<Header*>(base)->pids[rank].store(getpid());
  return channel;
}

uint64_t SharedMemoryChannel::nonce() const { return static_cast<const Header*>(base_)->nonce; }

void SharedMemoryChannel::Connected(std::vector<int> global_ranks) {
  global_ranks_ = std::move(global_ranks);
  if (std::exchange(owner_, false)) shm_unlink(name_.c_str());
  const Header* header = static_cast<const Header*>(base_);
  watch_peers_ = true;
  for (int r = 0; r < ranks_; ++r) {
    const int pid = header->pids[r].load();
    if (r != rank_ && (pid <= 0 || ProcessExited(pid))) watch_peers_ = false;  // another pid namespace
  }
}

char* SharedMemoryChannel::Slot(int set, int rank) const {
  return static_cast<char*>(base_) + kHeaderBytes + static_cast<size_t>(set * ranks_ + rank) * kSlotBytes;
}

char* SharedMemoryChannel::Result(int set) const {
  return Slot(0, 0) + static_cast<size_t>(2 * ranks_ + set) * kSlotBytes;
}

bool SharedMemoryChannel::PeerExited(int rank) const {
  return watch_peers_ && ProcessExited(static_cast<const Header*>(base_)->pids[rank].load());
}

std::string SharedMemoryChannel::Describe(int rank) const {
  return absl::StrCat("rank ", global_ranks_[rank], " (pid ", static_cast<const Header*>(base_)->pids[rank].load(),
                      ")");
}

absl::Status SharedMemoryChannel::Arrive(std::chrono::milliseconds timeout) {
  if (broken_) {
    return absl::FailedPreconditionError(
        "an earlier operation of this group failed, which leaves its ranks out of step; restart the job");
  }
  Header* header = static_cast<Header*>(base_);
  const uint64_t phase = ++phase_;
  header->arrived[rank_].phase.store(phase);
  header->arrivals.Notify();
  auto late = [&] {
    std::vector<int> ranks;
    for (int r = 0; r < ranks_; ++r) {
      if (header->arrived[r].phase.load() < phase) ranks.push_back(r);
    }
    return ranks;
  };
  auto all_arrived = [&] {
    for (int r = 0; r < ranks_; ++r) {
      if (header->arrived[r].phase.load() < phase) return false;
    }
    return true;
  };
  auto any_late_exited = [&] {
    for (int r : late()) {
      if (PeerExited(r)) return true;
    }
    return false;
  };
  if (WaitOn(header->arrivals, spin_, std::chrono::steady_clock::now() + timeout, all_arrived, any_late_exited)) {
    return absl::OkStatus();
  }
  broken_ = true;
  std::vector<std::string> exited, waited_for;
  for (int r : late()) {
    waited_for.push_back(Describe(r));
    if (PeerExited(r)) exited.push_back(Describe(r));
  }
  if (!exited.empty()) return absl::UnavailableError(absl::StrCat(absl::StrJoin(exited, ", "), " exited"));
  return absl::DeadlineExceededError(absl::StrCat("timed out after ", timeout.count(), " ms waiting for ",
                                                  absl::StrJoin(waited_for, ", "), " in shared memory"));
}

void SharedMemoryChannel::ReduceSlots(at::Tensor& out, int set, int64_t offset, ReduceOp op) const {
  auto part = [&](int r) { return at::from_blob(Slot(set, r) + offset, out.sizes(), out.options()); };
  Combine(out, part(0), part(1), op);
  for (int r = 2; r < ranks_; ++r) Combine(out, out, part(r), op);
}

absl::Status SharedMemoryChannel::AllReduce(at::Tensor& tensor, ReduceOp op, std::chrono::milliseconds timeout) {
  const int64_t element = tensor.element_size();
  const int64_t per_round = kSlotBytes / element;
  char* data = static_cast<char*>(tensor.data_ptr());
  const auto options = at::TensorOptions().dtype(tensor.scalar_type());
  for (int64_t begin = 0; begin < tensor.numel(); begin += per_round, ++round_) {
    const int64_t count = std::min(per_round, tensor.numel() - begin);
    const int set = static_cast<int>(round_ % 2);
    std::memcpy(Slot(set, rank_), data + begin * element, count * element);
    if (absl::Status arrived = Arrive(timeout); !arrived.ok()) return arrived;
    // This rank's slice of the result, reduced in rank order.
    const int64_t lo = count * rank_ / ranks_, hi = count * (rank_ + 1) / ranks_;
    if (hi > lo) {
      at::Tensor out = at::from_blob(Result(set) + lo * element, {hi - lo}, options);
      ReduceSlots(out, set, lo * element, op);
    }
    if (absl::Status reduced = Arrive(timeout); !reduced.ok()) return reduced;
    std::memcpy(data + begin * element, Result(set), count * element);
  }
  return absl::OkStatus();
}

absl::Status SharedMemoryChannel::AllGather(const at::Tensor& input, const std::vector<at::Tensor>& outputs,
                                            std::chrono::milliseconds timeout) {
  const int64_t bytes = input.numel() * input.element_size();
  const char* data = static_cast<const char*>(input.data_ptr());
  for (int64_t begin = 0; begin < bytes; begin += kSlotBytes, ++round_) {
    const int64_t count = std::min(kSlotBytes, bytes - begin);
    const int set = static_cast<int>(round_ % 2);
    std::memcpy(Slot(set, rank_), data + begin, count);
    if (absl::Status arrived = Arrive(timeout); !arrived.ok()) return arrived;
    // A slot is rewritten two rounds later, after every rank arrived at the
    // next round, so once all copied: one wait per round.
    for (int r = 0; r < ranks_; ++r)
      std::memcpy(static_cast<char*>(outputs[r].data_ptr()) + begin, Slot(set, r), count);
  }
  return absl::OkStatus();
}

absl::Status SharedMemoryChannel::ReduceScatter(const at::Tensor& input, at::Tensor& output, ReduceOp op,
                                                std::chrono::milliseconds timeout) {
  const int64_t element = input.element_size(), chunk = output.numel();
  const int64_t per_round = kSlotBytes / element / ranks_;  // of each chunk
  const char* data = static_cast<const char*>(input.data_ptr());
  for (int64_t begin = 0; begin < chunk; begin += per_round, ++round_) {
    const int64_t count = std::min(per_round, chunk - begin);
    const int set = static_cast<int>(round_ % 2);
    for (int r = 0; r < ranks_; ++r) {  // each chunk's window, one after another
      std::memcpy(Slot(set, rank_) + r * count * element, data + (r * chunk + begin) * element, count * element);
    }
    if (absl::Status arrived = Arrive(timeout); !arrived.ok()) return arrived;
    at::Tensor out = output.view({-1}).narrow(0, begin, count);
    ReduceSlots(out, set, rank_ * count * element, op);
  }
  return absl::OkStatus();
}

std::future<absl::Status> SharedMemoryChannel::Start(std::function<absl::Status()> operation) {
  std::packaged_task<absl::Status()> task(std::move(operation));
  std::future<absl::Status> result = task.get_future();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(std::move(task));
    ++unfinished_;
    if (!worker_.joinable()) worker_ = std::thread([this] { Work(); });
  }
  changed_.notify_all();
  return result;
}

absl::Status SharedMemoryChannel::Run(const std::function<absl::Status()>& operation) {
  {
    std::unique_lock<std::mutex> lock(mutex_);
    // Started operations come first; they are bounded by their timeouts.
    changed_.wait(lock, [this] { return unfinished_ == 0; });
  }
  return operation();
}

void SharedMemoryChannel::Work() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    changed_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, and everything started has run
    std::packaged_task<absl::Status()> task = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    task();
    lock.lock();
    --unfinished_;
    changed_.notify_all();
  }
}

}  // namespace internal
}  // namespace trident
