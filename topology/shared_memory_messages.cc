// SharedMemoryChannel's point-to-point messages: one ring per ordered pair of
// ranks, in a segment of its own that the sender creates at its first message.
#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <new>
#include <thread>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "topology/shared_memory.h"

namespace trident {
namespace internal {

namespace {

// The start of a mailbox's segment; its ring follows at kMailboxHeaderBytes.
struct MailboxHeader {
  uint64_t nonce;                             // the group segment's
  std::atomic<uint32_t> ready;                // set by the sender once the header is written
  std::atomic<uint32_t> opened;               // set by the receiver once it mapped the segment and removed its name
  alignas(64) std::atomic<uint64_t> written;  // bytes ever written to the ring: the sender's end
  alignas(64) std::atomic<uint64_t> taken;    // bytes ever taken from it: the receiver's end
  alignas(64) SharedWord wrote;               // notified after every message written
  alignas(64) SharedWord took;                // notified after messages were taken
};

constexpr size_t kMailboxHeaderBytes = 4096;
static_assert(sizeof(MailboxHeader) <= kMailboxHeaderBytes, "the mailbox header outgrew its page");
constexpr size_t kMailboxSegmentBytes = kMailboxHeaderBytes + SharedMemoryChannel::kMailboxBytes;

// A message in the ring: this record, then its payload, padded to 64 bytes.
// A filler record covers the ring's end when the next message does not fit
// before it.
struct alignas(64) Record {
  uint64_t bytes;    // of the record with its payload and padding
  uint64_t payload;  // bytes
  int32_t tag;
  bool filler;
};

MailboxHeader& HeaderOf(char* base) { return *reinterpret_cast<MailboxHeader*>(base); }
char* RingOf(char* base) { return base + kMailboxHeaderBytes; }
uint64_t Padded(uint64_t bytes) { return (bytes + 63) / 64 * 64; }

int64_t Bytes(const at::Tensor& tensor) { return tensor.numel() * static_cast<int64_t>(tensor.element_size()); }

}  // namespace

struct PostedReceive {
  at::Tensor tensor;
  int src;
  int tag;
  bool done = false;
  absl::Status status;  // once done

  // Fills the tensor with a message of `bytes` (or fails when the sizes differ).
  void Deliver(const char* data, int64_t bytes) {
    done = true;
    if (bytes != Bytes(tensor)) {
      status = absl::InvalidArgumentError(absl::StrCat("the message with tag ", tag, " has ", bytes,
                                                       " bytes where the receive expected ", Bytes(tensor),
                                                       " (receive into a tensor of the sender's shape and dtype)"));
      return;
    }
    std::memcpy(tensor.data_ptr(), data, bytes);
  }
};

SharedMemoryChannel::Outbox::~Outbox() {
  {
    std::lock_guard<std::mutex> lock(mutex);
    stopping = true;
  }
  changed.notify_all();
  if (sender.joinable()) sender.join();
  if (base == nullptr) return;
  const MailboxHeader& header = HeaderOf(base);
  const bool opened = header.opened.load() != 0, pending = header.written.load() != header.taken.load();
  munmap(base, kMailboxSegmentBytes);
  // A mailbox the receiver has not opened keeps its name while it holds
  // messages the receiver may still take (it removes the name when it opens
  // the mailbox, or as it goes); otherwise nobody will come for it.
  if (!opened && (!pending || receiver_exited)) shm_unlink(name.c_str());
}

SharedMemoryChannel::Inbox::~Inbox() {
  if (base != nullptr) munmap(base, kMailboxSegmentBytes);
}

namespace {

// boxes[peer] (sized for `ranks`), made and named `name` at its first use.
template <typename Box>
Box& MailboxOf(std::vector<std::unique_ptr<Box>>& boxes, int ranks, int peer, std::string name) {
  boxes.resize(ranks);
  if (!boxes[peer]) {
    boxes[peer] = std::make_unique<Box>();
    boxes[peer]->peer = peer;
    boxes[peer]->name = std::move(name);
  }
  return *boxes[peer];
}

}  // namespace

std::string SharedMemoryChannel::MailboxName(int src, int dst) const { return absl::StrCat(name_, "-", src, "-", dst); }

SharedMemoryChannel::Outbox& SharedMemoryChannel::OutboxTo(int dst) {
  std::lock_guard<std::mutex> lock(mailboxes_mutex_);
  return MailboxOf(outboxes_, ranks_, dst, MailboxName(rank_, dst));
}

SharedMemoryChannel::Inbox& SharedMemoryChannel::InboxFrom(int src) {
  std::lock_guard<std::mutex> lock(mailboxes_mutex_);
  return MailboxOf(inboxes_, ranks_, src, MailboxName(src, rank_));
}

bool SharedMemoryChannel::TryWrite(Outbox& outbox, const at::Tensor& tensor, int tag) {
  MailboxHeader& header = HeaderOf(outbox.base);
  char* ring = RingOf(outbox.base);
  const uint64_t payload = Bytes(tensor);
  const uint64_t length = Padded(sizeof(Record) + payload);
  uint64_t position = header.written.load(std::memory_order_relaxed);
  const uint64_t tail = kMailboxBytes - position % kMailboxBytes;  // room before the ring's end
  const uint64_t needed = length <= tail ? length : tail + length;
  if (needed > kMailboxBytes - (position - header.taken.load(std::memory_order_acquire))) return false;
  if (length > tail) {
    new (ring + position % kMailboxBytes) Record{tail, 0, 0, /*filler=*/true};
    position += tail;
  }
  char* at = ring + position % kMailboxBytes;
  new (at) Record{length, payload, tag, /*filler=*/false};
  if (payload > 0) std::memcpy(at + sizeof(Record), tensor.data_ptr(), payload);
  header.written.store(position + length, std::memory_order_release);
  header.wrote.Notify();
  return true;
}

std::future<absl::Status> SharedMemoryChannel::Send(const at::Tensor& tensor, int dst, int tag,
                                                    std::chrono::milliseconds timeout) {
  Outbox& outbox = OutboxTo(dst);
  std::promise<absl::Status> sent;
  std::future<absl::Status> result = sent.get_future();
  std::unique_lock<std::mutex> lock(outbox.mutex);
  if (outbox.base == nullptr && outbox.failure.ok()) {
    absl::StatusOr<void*> created = CreateSegment(outbox.name, kMailboxSegmentBytes);
    if (created.ok()) {
      auto* header = new (*created) MailboxHeader();
      header->nonce = nonce();
      header->ready.store(1, std::memory_order_release);
      outbox.base = static_cast<char*>(*created);
    } else {
      outbox.failure = created.status();
    }
  }
  if (!outbox.failure.ok()) {
    sent.set_value(outbox.failure);
  } else if (outbox.queue.empty() && TryWrite(outbox, tensor, tag)) {
    sent.set_value(absl::OkStatus());
  } else {
    outbox.queue.push_back({tensor, tag, timeout, std::move(sent)});
    if (!outbox.sender.joinable()) outbox.sender = std::thread([this, &outbox] { SendQueued(outbox); });
    lock.unlock();
    outbox.changed.notify_all();
  }
  return result;
}

void SharedMemoryChannel::SendQueued(Outbox& outbox) {
  MailboxHeader& header = HeaderOf(outbox.base);
  std::unique_lock<std::mutex> lock(outbox.mutex);
  while (true) {
    outbox.changed.wait(lock, [&] { return outbox.stopping || !outbox.queue.empty(); });
    if (outbox.queue.empty()) return;
    // The front stays queued until written, so that no later send overtakes it;
    // only this thread writes while the queue holds messages.
    Outbox::Queued& front = outbox.queue.front();
    lock.unlock();
    bool written = false;
    WaitOn(
        header.took, spin_, std::chrono::steady_clock::now() + front.timeout,
        [&] { return written || (written = TryWrite(outbox, front.tensor, front.tag)); },
        [&] { return outbox.stopping || PeerExited(outbox.peer); });
    absl::Status status;
    if (!written) {
      status = PeerExited(outbox.peer) ? absl::UnavailableError(absl::StrCat(Describe(outbox.peer), " exited"))
               : outbox.stopping       ? absl::CancelledError("the process group was destroyed before the send")
                                 : absl::DeadlineExceededError(absl::StrCat("timed out after ", front.timeout.count(),
                                                                            " ms waiting for ", Describe(outbox.peer),
                                                                            " to take messages from shared memory"));
    }
    lock.lock();
    outbox.queue.front().sent.set_value(status);
    outbox.queue.pop_front();
    if (!status.ok()) {  // the peer is gone or out of step: fail what follows too
      outbox.failure = status;
      for (Outbox::Queued& queued : outbox.queue) queued.sent.set_value(status);
      outbox.queue.clear();
    }
  }
}

absl::StatusOr<bool> SharedMemoryChannel::OpenInbox(Inbox& inbox) {
  if (inbox.base != nullptr) return true;
  absl::StatusOr<void*> mapped = MapSegment(inbox.name, kMailboxSegmentBytes);
  if (absl::IsNotFound(mapped.status()) || absl::IsFailedPrecondition(mapped.status())) return false;  // not yet
  if (!mapped.ok()) return mapped.status();
  MailboxHeader& header = HeaderOf(static_cast<char*>(*mapped));
  const bool ready = header.ready.load(std::memory_order_acquire) != 0;
  if (!ready || header.nonce != nonce()) {
    munmap(*mapped, kMailboxSegmentBytes);
    if (!ready) return false;  // being set up
    return absl::UnavailableError(absl::StrCat(inbox.name, " is not this group's mailbox"));
  }
  header.opened.store(1);
  shm_unlink(inbox.name.c_str());  // both ends have it mapped: nothing is left behind in /dev/shm
  inbox.base = static_cast<char*>(*mapped);
  return true;
}

void SharedMemoryChannel::TakeMessages(Inbox& inbox) {
  MailboxHeader& header = HeaderOf(inbox.base);
  const char* ring = RingOf(inbox.base);
  const uint64_t written = header.written.load(std::memory_order_acquire);
  uint64_t position = header.taken.load(std::memory_order_relaxed);
  if (position == written) return;
  while (position < written) {
    const Record& record = *reinterpret_cast<const Record*>(ring + position % kMailboxBytes);
    const char* payload = reinterpret_cast<const char*>(&record) + sizeof(Record);
    if (!record.filler) {
      auto match = std::find_if(inbox.posted.begin(), inbox.posted.end(),
                                [&](const auto& receive) { return receive->tag == record.tag; });
      if (match != inbox.posted.end()) {
        (*match)->Deliver(payload, static_cast<int64_t>(record.payload));
        inbox.posted.erase(match);
      } else {  // nobody waits for it yet: keep it here, so the sender can go on
        at::Tensor copy = at::empty({static_cast<int64_t>(record.payload)}, at::kByte);
        std::memcpy(copy.data_ptr(), payload, record.payload);
        inbox.unexpected.emplace_back(record.tag, std::move(copy));
      }
    }
    position += record.bytes;
  }
  header.taken.store(position, std::memory_order_release);
  header.took.Notify();
}

std::shared_ptr<PostedReceive> SharedMemoryChannel::PostReceive(const at::Tensor& tensor, int src, int tag) {
  auto receive = std::make_shared<PostedReceive>();
  receive->tensor = tensor;
  receive->src = src;
  receive->tag = tag;
  Inbox& inbox = InboxFrom(src);
  std::lock_guard<std::mutex> lock(inbox.mutex);
  auto early = std::find_if(inbox.unexpected.begin(), inbox.unexpected.end(),
                            [&](const auto& message) { return message.first == tag; });
  if (early != inbox.unexpected.end()) {
    receive->Deliver(static_cast<const char*>(early->second.data_ptr()), early->second.numel());
    inbox.unexpected.erase(early);
  } else {
    inbox.posted.push_back(receive);
  }
  return receive;
}

bool SharedMemoryChannel::Received(PostedReceive& receive) {
  Inbox& inbox = InboxFrom(receive.src);
  std::lock_guard<std::mutex> lock(inbox.mutex);
  if (!receive.done) {
    absl::StatusOr<bool> opened = OpenInbox(inbox);
    if (opened.ok() && *opened) TakeMessages(inbox);
  }
  return receive.done;
}

absl::Status SharedMemoryChannel::WaitReceive(PostedReceive& receive, std::chrono::milliseconds timeout) {
  Inbox& inbox = InboxFrom(receive.src);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto failed = [&](absl::Status status) {
    std::lock_guard<std::mutex> lock(inbox.mutex);
    inbox.posted.erase(std::remove_if(inbox.posted.begin(), inbox.posted.end(),
                                      [&](const auto& posted) { return posted.get() == &receive; }),
                       inbox.posted.end());
    return status;
  };
  auto timed_out = [&] {
    return absl::DeadlineExceededError(absl::StrCat("timed out after ", timeout.count(),
                                                    " ms waiting for the message with tag ", receive.tag, " from ",
                                                    Describe(receive.src), " in shared memory"));
  };
  auto exited = [&] { return absl::UnavailableError(absl::StrCat(Describe(receive.src), " exited")); };
  // Until the sender's first message the mailbox may not exist yet.
  while (true) {
    // Asked before looking: a sender that sent and went leaves its mailbox.
    const bool sender_exited = PeerExited(receive.src);
    absl::StatusOr<bool> opened;
    {
      std::lock_guard<std::mutex> lock(inbox.mutex);
      opened = OpenInbox(inbox);
    }
    if (!opened.ok()) return failed(opened.status());
    if (*opened) break;
    if (sender_exited) return failed(exited());
    if (std::chrono::steady_clock::now() >= deadline) return failed(timed_out());
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  auto arrived = [&] {
    std::lock_guard<std::mutex> lock(inbox.mutex);
    TakeMessages(inbox);
    return receive.done;
  };
  if (!WaitOn(HeaderOf(inbox.base).wrote, spin_, deadline, arrived, [&] { return PeerExited(receive.src); })) {
    return failed(PeerExited(receive.src) ? exited() : timed_out());
  }
  return receive.status;
}

}  // namespace internal
}  // namespace trident
