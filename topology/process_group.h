// ProcessGroup: a group of ranks and the collectives Trident uses on it, over
// LibTorch's c10d (Gloo on CPU, NCCL on GPU). Every operation blocks until done
// or until the group's timeout, and returns a status instead of throwing: a peer
// that died or timed out gives an error that names the group, the operation and,
// where it can be told, the rank at fault. Tensors may live on any device: one
// that is not the backend's (a CPU scalar for NCCL, a GPU tensor for Gloo) is
// copied there and the result copied back, so callers write one code path.
//
//   ProcessGroup& dp = *topology->Group("dp").value();
//   at::Tensor grad = ...;
//   TRIDENT_RETURN_IF_ERROR(dp.AllReduce(grad, ReduceOp::kAvg));
#ifndef TRIDENT_TOPOLOGY_PROCESS_GROUP_H_
#define TRIDENT_TOPOLOGY_PROCESS_GROUP_H_

#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/version.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace c10d {
class ProcessGroup;
class Backend;
class Work;
}  // namespace c10d

namespace trident {

enum class ReduceOp { kSum, kAvg, kMax, kMin, kProduct };

namespace internal {
class SharedMemoryChannel;
struct PostedReceive;  // a receive posted on a SharedMemoryChannel
// The c10d class that implements collectives: ProcessGroup in LibTorch 1.x,
// Backend in 2.x. Only topology's .cc files see its definition.
#if TORCH_VERSION_MAJOR >= 2
using C10dBackend = c10d::Backend;
#else
using C10dBackend = c10d::ProcessGroup;
#endif
}  // namespace internal

// An operation started with ProcessGroup::ISend / IRecv. Wait() must be called
// before the tensor is read or reused. Move-only.
// Host time this process has spent in each kind of operation ("all_reduce",
// "reduce_scatter", "send", ...) of every group since it started: issuing
// it, and blocked waiting for it (an operation that overlaps other work
// counts only its wait). With NCCL a wait orders the GPU stream and returns,
// so GPU operations count their issue time only. For wall_clock_breakdown.
struct CommunicationTime {
  double seconds = 0;
  int64_t operations = 0;
};
std::map<std::string, CommunicationTime> CommunicationTimes();

class PendingWork {
 public:
  PendingWork();
  PendingWork(PendingWork&&) noexcept;
  PendingWork& operator=(PendingWork&&) noexcept;
  ~PendingWork();

  // Blocks until the operation finished or the group's timeout passed.
  absl::Status Wait();
  // Whether the operation has finished (Wait() then returns at once).
  bool IsCompleted() const;

 private:
  friend class ProcessGroup;
  // Work that finished as it started (a group of one rank).
  static PendingWork Done();
  bool done_ = false;
  const class ProcessGroup* group_ = nullptr;
  const char* operation_ = "";
  c10::intrusive_ptr<c10d::Work> work_;
  std::future<absl::Status> shared_memory_work_;                    // or this, started on shared memory
  std::shared_ptr<internal::PostedReceive> shared_memory_receive_;  // or this
  std::function<void()> after_;                                     // copies a result back from the backend's device
};

class ProcessGroup {
 public:
  // Returns a description of which of `peers` (global ranks) of `group` is at
  // fault ("rank 3 stopped ...", "rank 3 has not arrived ..."), or "" when it
  // cannot tell. Called after an operation of `group` failed.
  using FailureDiagnosis = std::function<std::string(const ProcessGroup& group, const std::vector<int>& peers)>;

  // Wraps `backend`, whose tensors live on `device`. `global_ranks[i]` is the
  // global rank of group rank i. A group of one rank may have no backend (null):
  // its collectives are then local copies, or nothing.
  ProcessGroup(std::string name, std::vector<int> global_ranks, int rank,
               c10::intrusive_ptr<internal::C10dBackend> backend, at::Device device, std::chrono::milliseconds timeout,
               FailureDiagnosis diagnosis);
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  const std::string& name() const { return name_; }
  // This process's rank within the group.
  int rank() const { return rank_; }
  int size() const { return static_cast<int>(global_ranks_.size()); }
  // Global rank of every group rank, in group-rank order.
  const std::vector<int>& global_ranks() const { return global_ranks_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  // Collective operations (not sends and receives) this rank has started on
  // the group; the watchdog compares them across ranks to name one that did
  // not arrive.
  int64_t collectives_started() const { return collectives_started_; }
  // Where the backend wants its tensors.
  const at::Device& device() const { return device_; }

  // Moves this group's all-reduces, all-gathers, reduce-scatters and
  // messages of up to 2 MiB from Gloo's sockets to shared memory when all its
  // ranks run on this host (CPU groups of 2 to 64 ranks;
  // TRIDENT_SHARED_MEMORY=0 in the environment keeps the sockets). Collective.
  // Returns why shared memory could not be set up although the ranks share a
  // host (empty when it is used, or not tried); errors when the group's
  // collectives fail.
  absl::StatusOr<std::string> ConnectSharedMemory();
  // Whether ConnectSharedMemory set shared memory up.
  bool shares_memory() const { return shared_memory_ != nullptr; }

  // In place: `tensor` becomes the reduction of every rank's `tensor`.
  absl::Status AllReduce(at::Tensor& tensor, ReduceOp op = ReduceOp::kSum) const;
  // Starts a summing all-reduce of contiguous `tensor` in place; the result is
  // there once the returned work's Wait() succeeds.
  absl::StatusOr<PendingWork> IAllReduce(at::Tensor& tensor) const;
  // In place: every rank's `tensor` becomes group rank `root`'s.
  absl::Status Broadcast(at::Tensor& tensor, int root) const;
  // Every rank's `input` (same shape and dtype everywhere), concatenated along
  // `dim` in group-rank order.
  absl::StatusOr<at::Tensor> AllGather(const at::Tensor& input, int64_t dim = 0) const;
  // Starts gathering every rank's `input` (contiguous) into `output`, whose
  // first dimension is size() times input's, in rank order; `output` is
  // complete once the returned work's Wait() succeeds.
  absl::StatusOr<PendingWork> IAllGather(const at::Tensor& input, at::Tensor& output) const;
  // The same into one tensor per rank, in rank order, each contiguous and of
  // input's shape and type, wherever they lie (rank r's columns of a bucket:
  // no gathered copy to scatter afterwards).
  absl::StatusOr<PendingWork> IAllGather(const at::Tensor& input, std::vector<at::Tensor> outputs) const;
  // Reduces `input` across ranks and returns this rank's chunk: `input` is split
  // into size() equal chunks along `dim` and rank r gets the reduced chunk r.
  absl::StatusOr<at::Tensor> ReduceScatter(const at::Tensor& input, int64_t dim = 0,
                                           ReduceOp op = ReduceOp::kSum) const;
  // Starts a summing reduce-scatter of contiguous `input` along its first
  // dimension: once the returned work's Wait() succeeds, contiguous `output`
  // (size() times fewer elements) holds this rank's chunk of the sum, added
  // the same way ReduceScatter adds it.
  absl::StatusOr<PendingWork> IReduceScatter(const at::Tensor& input, at::Tensor& output) const;
  absl::Status Barrier() const;

  // Point to point, peers given as group ranks. Receives need a tensor of the
  // sender's shape and dtype; messages between a pair with the same tag arrive
  // in the order sent.
  absl::Status Send(const at::Tensor& tensor, int dst, int tag = 0) const;
  absl::Status Recv(at::Tensor& tensor, int src, int tag = 0) const;
  absl::StatusOr<PendingWork> ISend(const at::Tensor& tensor, int dst, int tag = 0) const;
  absl::StatusOr<PendingWork> IRecv(at::Tensor& tensor, int src, int tag = 0) const;

 private:
  friend class PendingWork;
  // The shared-memory channel, when the group has one and `tensor` is on the CPU.
  internal::SharedMemoryChannel* SharedMemoryFor(const at::Tensor& tensor) const {
    return tensor.is_cpu() ? shared_memory_.get() : nullptr;
  }
  // The same for a message of `tensor` to or from `peer`: small enough for
  // its mailbox (both sides tell from the size), and not to this rank.
  internal::SharedMemoryChannel* MailboxFor(const at::Tensor& tensor, int peer) const;
  // Runs `operation` on the shared-memory channel, after the ones started.
  absl::Status RunOnSharedMemory(const char* operation, const std::function<absl::Status()>& run) const;
  PendingWork StartOnSharedMemory(const char* operation, std::function<absl::Status()> run) const;
  // Runs `start` (which issues a c10d operation) and waits for it.
  absl::Status Run(const char* operation, const std::function<c10::intrusive_ptr<c10d::Work>()>& start) const;
  absl::StatusOr<PendingWork> Start(const char* operation,
                                    const std::function<c10::intrusive_ptr<c10d::Work>()>& start) const;
  // The one place c10d failures become statuses: the current exception, or
  // `cause` when given, with the diagnosis of which peer is at fault.
  absl::Status Failure(const char* operation, const char* cause = nullptr) const;
  absl::Status CheckPeer(int peer, const char* operation) const;
  // CheckPeer, and a group of one rank has no peer to send to or receive from.
  absl::Status CheckMessagePeer(int peer, const char* operation) const;
  // A one-rank group without a backend: collectives are done here.
  bool local() const { return !backend_; }
  // Whether the backend reduces and scatters in one operation (NCCL); Gloo's
  // reduce-scatter is an all-to-all and a local reduction.
  bool NativeReduceScatter() const { return device_.is_cuda(); }
  // `tensor` on the backend's device (itself when it is there).
  at::Tensor OnDevice(const at::Tensor& tensor) const;
  // `tensor` as the backend's collectives take it: on its device, and bf16 as
  // fp32 on Gloo (CPU), which has no bf16 reductions (LibTorch 1.13). The
  // callers copy a staged result back into the caller's tensor.
  at::Tensor Staged(const at::Tensor& tensor) const;

  std::string name_;
  std::vector<int> global_ranks_;
  int rank_;
  c10::intrusive_ptr<internal::C10dBackend> backend_;
  at::Device device_;
  std::chrono::milliseconds timeout_;
  FailureDiagnosis diagnosis_;
  std::unique_ptr<internal::SharedMemoryChannel> shared_memory_;
  mutable std::atomic<int64_t> collectives_started_{0};
};

// Every rank's `strings`, by group rank (any bytes, empty strings included).
absl::StatusOr<std::vector<std::vector<std::string>>> AllGatherStrings(const ProcessGroup& group,
                                                                       const std::vector<std::string>& strings);

// Whether any rank of `group` failed: every rank gets `local` back when it
// failed itself, otherwise an error naming the lowest failed rank, with its
// message, when one did.
absl::Status AgreeOnFailure(const ProcessGroup& group, const absl::Status& local, const char* what);

}  // namespace trident

#endif  // TRIDENT_TOPOLOGY_PROCESS_GROUP_H_
