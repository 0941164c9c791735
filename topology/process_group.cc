#include "topology/process_group.h"

#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <utility>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "topology/shared_memory.h"

namespace trident {
namespace {

// c10d's reduction for `op`; kAvg is a sum followed by a division.
c10d::ReduceOp ToC10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return c10d::ReduceOp(c10d::ReduceOp::SUM);
    case ReduceOp::kMax:
      return c10d::ReduceOp(c10d::ReduceOp::MAX);
    case ReduceOp::kMin:
      return c10d::ReduceOp(c10d::ReduceOp::MIN);
    case ReduceOp::kProduct:
      return c10d::ReduceOp(c10d::ReduceOp::PRODUCT);
  }
  return c10d::ReduceOp(c10d::ReduceOp::SUM);
}

// Reduces `stacked` along dim 0 with `op`.
at::Tensor ReduceLocally(const at::Tensor& stacked, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return stacked.sum(0);
    case ReduceOp::kAvg:
      return stacked.mean(0);
    case ReduceOp::kMax:
      return std::get<0>(stacked.max(0));
    case ReduceOp::kMin:
      return std::get<0>(stacked.min(0));
    case ReduceOp::kProduct:
      return stacked.prod(0);
  }
  return stacked.sum(0);
}

absl::Status CheckAverageable(const at::Tensor& tensor, ReduceOp op) {
  if (op == ReduceOp::kAvg && !at::isFloatingType(tensor.scalar_type())) {
    return absl::InvalidArgumentError(absl::StrCat("ReduceOp::kAvg needs a floating-point tensor, got ",
                                                   c10::toString(tensor.scalar_type()),
                                                   "; reduce with kSum and divide instead"));
  }
  return absl::OkStatus();
}

}  // namespace

namespace {

std::mutex communication_mutex;
std::map<std::string, CommunicationTime>& CommunicationTable() {
  static auto* table = new std::map<std::string, CommunicationTime>();
  return *table;
}

// Adds the time since `since` to `operation` (`issued`: one more operation).
void CountTime(const char* operation, std::chrono::steady_clock::time_point since, bool issued) {
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
  std::lock_guard<std::mutex> lock(communication_mutex);
  CommunicationTime& time = CommunicationTable()[operation];
  time.seconds += seconds;
  time.operations += issued ? 1 : 0;
}

}  // namespace

std::map<std::string, CommunicationTime> CommunicationTimes() {
  std::lock_guard<std::mutex> lock(communication_mutex);
  return CommunicationTable();
}

PendingWork::PendingWork() = default;
PendingWork::PendingWork(PendingWork&&) noexcept = default;
PendingWork& PendingWork::operator=(PendingWork&&) noexcept = default;
PendingWork::~PendingWork() = default;

absl::Status PendingWork::Wait() {
  if (std::exchange(done_, false)) return absl::OkStatus();
  if (shared_memory_receive_ || shared_memory_work_.valid()) {
    const auto start = std::chrono::steady_clock::now();
    const absl::Status status =
        shared_memory_receive_
            ? group_->shared_memory_->WaitReceive(*std::exchange(shared_memory_receive_, nullptr), group_->timeout())
            : shared_memory_work_.get();
    if (!status.ok()) return group_->Failure(operation_, std::string(status.message()).c_str());
    CountTime(operation_, start, /*issued=*/false);
    if (after_) std::exchange(after_, nullptr)();
    return absl::OkStatus();
  }
  if (!work_) return absl::FailedPreconditionError("PendingWork::Wait on an empty or used handle");
  c10::intrusive_ptr<c10d::Work> work = std::move(work_);
  const auto start = std::chrono::steady_clock::now();
  // On a GPU (NCCL) the wait orders the current stream after the operation
  // and returns: a timed wait would hold the host until the GPU finished it,
  // and the GPU would idle while the host queued what follows. NCCL's
  // watchdog ends the process when an operation passes the group's timeout
  // (TORCH_NCCL_BLOCKING_WAIT=1 makes the wait block and fail here instead).
  const std::chrono::milliseconds no_timeout(0);  // c10d's kNoTimeout
  const auto timeout = group_->device().is_cuda() ? no_timeout : group_->timeout();
  try {
    if (!work->wait(timeout)) return group_->Failure(operation_, "timed out");
  } catch (...) {
    return group_->Failure(operation_);
  }
  CountTime(operation_, start, /*issued=*/false);
  if (after_) std::exchange(after_, nullptr)();
  return absl::OkStatus();
}

bool PendingWork::IsCompleted() const {
  return done_ || (work_ && work_->isCompleted()) ||
         (shared_memory_receive_ && group_->shared_memory_->Received(*shared_memory_receive_)) ||
         (shared_memory_work_.valid() &&
          shared_memory_work_.wait_for(std::chrono::seconds(0)) == std::future_status::ready);
}

PendingWork PendingWork::Done() {
  PendingWork done;
  done.done_ = true;
  return done;
}

ProcessGroup::ProcessGroup(std::string name, std::vector<int> global_ranks, int rank,
                           c10::intrusive_ptr<internal::C10dBackend> backend, at::Device device,
                           std::chrono::milliseconds timeout, FailureDiagnosis diagnosis)
    : name_(std::move(name)),
      global_ranks_(std::move(global_ranks)),
      rank_(rank),
      backend_(std::move(backend)),
      device_(device),
      timeout_(timeout),
      diagnosis_(std::move(diagnosis)) {
  TORCH_CHECK(backend_ || global_ranks_.size() == 1, "process group '", name_, "' of several ranks needs a backend");
}

ProcessGroup::~ProcessGroup() = default;

at::Tensor ProcessGroup::OnDevice(const at::Tensor& tensor) const {
  return tensor.device() == device_ ? tensor : tensor.to(device_);
}

at::Tensor ProcessGroup::Staged(const at::Tensor& tensor) const {
  if (device_.is_cpu() && tensor.scalar_type() == at::kBFloat16) return tensor.to(device_, at::kFloat);
  return OnDevice(tensor);
}

absl::Status ProcessGroup::Failure(const char* operation, const char* cause) const {
  const std::string context = absl::StrCat(operation, " on process group '", name_, "' (global ranks ",
                                           absl::StrJoin(global_ranks_, ","), ") failed");
  std::string message = cause != nullptr ? absl::StrCat(context, ": ", cause)
                                         : std::string(StatusFromCurrentException(context).message());
  const bool timed_out = absl::StrContains(message, "imed out") || absl::StrContains(message, "imeout");
  if (diagnosis_) {
    std::vector<int> peers;
    for (int r : global_ranks_) {
      if (r != global_ranks_[rank_]) peers.push_back(r);
    }
    std::string diagnosis = diagnosis_(*this, peers);
    if (!diagnosis.empty()) absl::StrAppend(&message, "; ", diagnosis);
  }
  return timed_out ? absl::DeadlineExceededError(message) : absl::UnavailableError(message);
}

absl::StatusOr<PendingWork> ProcessGroup::Start(const char* operation,
                                                const std::function<c10::intrusive_ptr<c10d::Work>()>& start) const {
  PendingWork pending;
  pending.group_ = this;
  pending.operation_ = operation;
  if (std::strcmp(operation, "send") != 0 && std::strcmp(operation, "recv") != 0) ++collectives_started_;
  const auto issued = std::chrono::steady_clock::now();
  try {
    pending.work_ = start();
  } catch (...) {
    return Failure(operation);
  }
  CountTime(operation, issued, /*issued=*/true);
  return pending;
}

absl::Status ProcessGroup::RunOnSharedMemory(const char* operation, const std::function<absl::Status()>& run) const {
  ++collectives_started_;
  const auto start = std::chrono::steady_clock::now();
  const absl::Status status = shared_memory_->Run(run);
  if (!status.ok()) return Failure(operation, std::string(status.message()).c_str());
  CountTime(operation, start, /*issued=*/true);
  return absl::OkStatus();
}

PendingWork ProcessGroup::StartOnSharedMemory(const char* operation, std::function<absl::Status()> run) const {
  PendingWork pending;
  pending.group_ = this;
  pending.operation_ = operation;
  ++collectives_started_;
  const auto issued = std::chrono::steady_clock::now();
  pending.shared_memory_work_ = shared_memory_->Start(std::move(run));
  CountTime(operation, issued, /*issued=*/true);
  return pending;
}

absl::Status ProcessGroup::Run(const char* operation,
                               const std::function<c10::intrusive_ptr<c10d::Work>()>& start) const {
  TRIDENT_ASSIGN_OR_RETURN(PendingWork pending, Start(operation, start));
  return pending.Wait();
}

absl::Status ProcessGroup::AllReduce(at::Tensor& tensor, ReduceOp op) const {
  TRIDENT_RETURN_IF_ERROR(CheckAverageable(tensor, op));
  if (local()) return absl::OkStatus();
  std::vector<at::Tensor> tensors = {Staged(tensor.is_contiguous() ? tensor : tensor.contiguous())};
  if (internal::SharedMemoryChannel* channel = SharedMemoryFor(tensors[0])) {
    TRIDENT_RETURN_IF_ERROR(
        RunOnSharedMemory("all_reduce", [&] { return channel->AllReduce(tensors[0], op, timeout_); }));
  } else {
    c10d::AllreduceOptions options;
    options.reduceOp = ToC10d(op);
    options.timeout = timeout_;
    TRIDENT_RETURN_IF_ERROR(Run("all_reduce", [&] { return backend_->allreduce(tensors, options); }));
  }
  if (op == ReduceOp::kAvg) tensors[0].div_(size());
  if (!tensors[0].is_same(tensor)) tensor.copy_(tensors[0]);
  return absl::OkStatus();
}

absl::StatusOr<std::string> ProcessGroup::ConnectSharedMemory() {
  const char* setting = std::getenv("TRIDENT_SHARED_MEMORY");
  const bool wanted = setting == nullptr || std::string(setting) != "0";
  if (local() || !device_.is_cpu() || size() > internal::SharedMemoryChannel::kMaxRanks || !wanted) return "";
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  std::unique_ptr<internal::SharedMemoryChannel> channel;
  std::string failure;  // this rank's
  if (rank_ == 0) {
    auto created = internal::SharedMemoryChannel::Create(size());
    if (created.ok())
      channel = *std::move(created);
    else
      failure = std::string(created.status().message());
  }
  TRIDENT_ASSIGN_OR_RETURN(auto offers,
                           AllGatherStrings(*this, {host, channel ? channel->name() : "",
                                                    channel ? std::to_string(channel->nonce()) : "", failure}));
  for (const auto& offer : offers) {
    if (offer[0] != offers[0][0]) return "";  // ranks on several hosts: sockets it is
  }
  if (offers[0][1].empty()) return absl::StrCat("rank ", global_ranks_[0], ": ", offers[0][3]);
  if (rank_ != 0) {
    auto opened = internal::SharedMemoryChannel::Open(offers[0][1], std::stoull(offers[0][2]), rank_, size());
    if (opened.ok())
      channel = *std::move(opened);
    else
      failure = std::string(opened.status().message());
  }
  TRIDENT_ASSIGN_OR_RETURN(auto outcomes, AllGatherStrings(*this, {failure}));
  for (size_t r = 0; r < outcomes.size(); ++r) {
    if (!outcomes[r][0].empty()) return absl::StrCat("rank ", global_ranks_[r], ": ", outcomes[r][0]);
  }
  channel->Connected(global_ranks_);
  shared_memory_ = std::move(channel);
  return "";
}

absl::StatusOr<PendingWork> ProcessGroup::IAllReduce(at::Tensor& tensor) const {
  if (!tensor.is_contiguous()) {
    return absl::InvalidArgumentError(
        absl::StrCat("all_reduce on process group '", name_, "': IAllReduce needs a contiguous tensor"));
  }
  if (local()) return PendingWork::Done();
  std::vector<at::Tensor> tensors = {Staged(tensor)};
  PendingWork pending;
  if (internal::SharedMemoryChannel* channel = SharedMemoryFor(tensors[0])) {
    pending = StartOnSharedMemory("all_reduce", [channel, staged = tensors[0], timeout = timeout_]() mutable {
      return channel->AllReduce(staged, ReduceOp::kSum, timeout);
    });
  } else {
    c10d::AllreduceOptions options;
    options.timeout = timeout_;
    TRIDENT_ASSIGN_OR_RETURN(pending, Start("all_reduce", [&] { return backend_->allreduce(tensors, options); }));
  }
  if (!tensors[0].is_same(tensor)) pending.after_ = [tensor, staged = tensors[0]]() mutable { tensor.copy_(staged); };
  return pending;
}

absl::Status ProcessGroup::Broadcast(at::Tensor& tensor, int root) const {
  TRIDENT_RETURN_IF_ERROR(CheckPeer(root, "broadcast"));
  if (local()) return absl::OkStatus();
  std::vector<at::Tensor> tensors = {Staged(tensor.is_contiguous() ? tensor : tensor.contiguous())};
  c10d::BroadcastOptions options;
  options.rootRank = root;
  options.timeout = timeout_;
  TRIDENT_RETURN_IF_ERROR(Run("broadcast", [&] { return backend_->broadcast(tensors, options); }));
  if (!tensors[0].is_same(tensor)) tensor.copy_(tensors[0]);
  return absl::OkStatus();
}

absl::StatusOr<at::Tensor> ProcessGroup::AllGather(const at::Tensor& input, int64_t dim) const {
  if (local()) return input.clone(at::MemoryFormat::Contiguous);
  if (internal::SharedMemoryChannel* channel = SharedMemoryFor(input)) {  // any dtype: nothing is reduced
    const at::Tensor contiguous = input.contiguous();
    std::vector<at::Tensor> parts;
    for (int r = 0; r < size(); ++r) parts.push_back(at::empty_like(contiguous));
    TRIDENT_RETURN_IF_ERROR(
        RunOnSharedMemory("all_gather", [&] { return channel->AllGather(contiguous, parts, timeout_); }));
    return at::cat(parts, dim);
  }
  std::vector<at::Tensor> inputs = {Staged(input.contiguous())};
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < size(); ++r) outputs[0].push_back(at::empty_like(inputs[0]));
  c10d::AllgatherOptions options;
  options.timeout = timeout_;
  TRIDENT_RETURN_IF_ERROR(Run("all_gather", [&] { return backend_->allgather(outputs, inputs, options); }));
  return at::cat(outputs[0], dim).to(input.device(), input.scalar_type());
}

absl::StatusOr<PendingWork> ProcessGroup::IAllGather(const at::Tensor& input, at::Tensor& output) const {
  if (!output.is_contiguous() || output.numel() != input.numel() * size()) {
    return absl::InvalidArgumentError(absl::StrCat("all_gather on process group '", name_,
                                                   "': IAllGather needs a contiguous output of "
                                                   "size() times the input's elements"));
  }
  std::vector<at::Tensor> rows;
  for (const at::Tensor& row : output.view({size(), -1}).unbind(0)) rows.push_back(row.view(input.sizes()));
  return IAllGather(input, std::move(rows));
}

absl::StatusOr<PendingWork> ProcessGroup::IAllGather(const at::Tensor& input, std::vector<at::Tensor> outputs) const {
  const bool fits =
      static_cast<int>(outputs.size()) == size() &&
      std::all_of(outputs.begin(), outputs.end(), [&](const at::Tensor& output) {
        return output.is_contiguous() && output.sizes() == input.sizes() && output.scalar_type() == input.scalar_type();
      });
  if (!input.is_contiguous() || !fits) {
    return absl::InvalidArgumentError(absl::StrCat("all_gather on process group '", name_,
                                                   "': IAllGather needs a contiguous input and one "
                                                   "contiguous output of its shape and type per rank (",
                                                   size(), ")"));
  }
  if (local()) {
    outputs[0].copy_(input);
    return PendingWork::Done();
  }
  internal::SharedMemoryChannel* channel = SharedMemoryFor(input);
  if (channel && std::all_of(outputs.begin(), outputs.end(), [](const at::Tensor& t) { return t.is_cpu(); })) {
    return StartOnSharedMemory("all_gather", [channel, input, outputs, timeout = timeout_] {
      return channel->AllGather(input, outputs, timeout);
    });
  }
  std::vector<at::Tensor> inputs = {Staged(input)};
  std::vector<std::vector<at::Tensor>> staged(1);
  for (const at::Tensor& output : outputs) staged[0].push_back(Staged(output));
  c10d::AllgatherOptions options;
  options.timeout = timeout_;
  TRIDENT_ASSIGN_OR_RETURN(PendingWork pending,
                           Start("all_gather", [&] { return backend_->allgather(staged, inputs, options); }));
  if (!staged[0].front().is_same(outputs.front())) {  // staged elsewhere (another device or type)
    pending.after_ = [outputs, parts = staged[0]]() mutable {
      for (size_t r = 0; r < outputs.size(); ++r) outputs[r].copy_(parts[r]);
    };
  }
  return pending;
}

absl::StatusOr<at::Tensor> ProcessGroup::ReduceScatter(const at::Tensor& input, int64_t dim, ReduceOp op) const {
  TRIDENT_RETURN_IF_ERROR(CheckAverageable(input, op));
  const int64_t dims = input.dim();
  if (dims == 0 || dim < -dims || dim >= dims) {
    return absl::InvalidArgumentError(absl::StrCat("reduce_scatter on process group '", name_, "': dim ", dim,
                                                   " is out of range for a ", dims, "-d tensor"));
  }
  if (dim < 0) dim += dims;
  if (input.size(dim) % size() != 0) {
    return absl::InvalidArgumentError(absl::StrCat("reduce_scatter on process group '", name_, "': dimension ", dim,
                                                   " of size ", input.size(dim), " is not divisible by the group size ",
                                                   size(), "; pad the tensor or choose a size that divides"));
  }
  if (local()) return input.clone(at::MemoryFormat::Contiguous);
  at::Tensor chunks = Staged(input.movedim(dim, 0).contiguous());
  std::vector<int64_t> shape = chunks.sizes().vec();
  shape[0] /= size();
  at::Tensor reduced;
  if (internal::SharedMemoryChannel* channel = SharedMemoryFor(chunks)) {
    reduced = at::empty(shape, chunks.options());
    TRIDENT_RETURN_IF_ERROR(
        RunOnSharedMemory("reduce_scatter", [&] { return channel->ReduceScatter(chunks, reduced, op, timeout_); }));
    if (op == ReduceOp::kAvg) reduced.div_(size());
  } else if (NativeReduceScatter()) {
    reduced = at::empty(shape, chunks.options());
    c10d::ReduceScatterOptions options;
    options.reduceOp = ToC10d(op);
    options.timeout = timeout_;
    TRIDENT_RETURN_IF_ERROR(
        Run("reduce_scatter", [&] { return backend_->_reduce_scatter_base(reduced, chunks, options); }));
    if (op == ReduceOp::kAvg) reduced.div_(size());
  } else {
    // NOTE: Gloo has no reduce-scatter; an all-to-all of the chunks followed
    // by a local reduction moves the same bytes as a ring reduce-scatter.
    shape.insert(shape.begin(), size());
    chunks = chunks.view(shape);
    at::Tensor received = at::empty_like(chunks);
    c10d::AllToAllOptions options;
    options.timeout = timeout_;
    std::vector<int64_t> equal_splits;
    TRIDENT_RETURN_IF_ERROR(Run("reduce_scatter", [&] {
      return backend_->alltoall_base(received, chunks, equal_splits, equal_splits, options);
    }));
    reduced = ReduceLocally(received, op);
  }
  return reduced.movedim(0, dim).contiguous().to(input.device(), input.scalar_type());
}

absl::StatusOr<PendingWork> ProcessGroup::IReduceScatter(const at::Tensor& input, at::Tensor& output) const {
  if (!input.is_contiguous() || !output.is_contiguous() || input.numel() != output.numel() * size()) {
    return absl::InvalidArgumentError(absl::StrCat("reduce_scatter on process group '", name_,
                                                   "': IReduceScatter needs contiguous tensors and an "
                                                   "input of size() times the output's elements"));
  }
  if (local()) {
    output.copy_(input.view(output.sizes()));
    return PendingWork::Done();
  }
  const at::Tensor staged = Staged(input);
  if (internal::SharedMemoryChannel* channel = SharedMemoryFor(staged)) {
    const bool in_place = output.is_cpu() && output.scalar_type() == staged.scalar_type();
    at::Tensor reduced = in_place ? output : at::empty(output.sizes(), staged.options());
    PendingWork pending =
        StartOnSharedMemory("reduce_scatter", [channel, staged, reduced, timeout = timeout_]() mutable {
          return channel->ReduceScatter(staged, reduced, ReduceOp::kSum, timeout);
        });
    if (!in_place) pending.after_ = [output, reduced]() mutable { output.copy_(reduced); };
    return pending;
  }
  if (NativeReduceScatter()) {
    at::Tensor chunks = staged.view({-1});
    const bool in_place = output.device() == chunks.device() && output.scalar_type() == chunks.scalar_type();
    at::Tensor reduced = in_place ? output.view({-1}) : at::empty({output.numel()}, chunks.options());
    c10d::ReduceScatterOptions options;
    options.timeout = timeout_;
    TRIDENT_ASSIGN_OR_RETURN(PendingWork pending, Start("reduce_scatter", [&] {
                               return backend_->_reduce_scatter_base(reduced, chunks, options);
                             }));
    if (!in_place) pending.after_ = [output, reduced]() mutable { output.copy_(reduced.view(output.sizes())); };
    return pending;
  }
  // As ReduceScatter: an all-to-all of the chunks, reduced here once it arrived.
  at::Tensor chunks = staged.view({size(), -1});
  at::Tensor received = at::empty_like(chunks);
  c10d::AllToAllOptions options;
  options.timeout = timeout_;
  std::vector<int64_t> equal_splits;
  TRIDENT_ASSIGN_OR_RETURN(PendingWork pending, Start("reduce_scatter", [&] {
                             return backend_->alltoall_base(received, chunks, equal_splits, equal_splits, options);
                           }));
  pending.after_ = [output, received, chunks]() mutable {
    if (output.scalar_type() == received.scalar_type()) {  // summed into place, as ReduceLocally sums
      at::Tensor flat = output.view({-1});
      at::sum_out(flat, received, /*dim=*/0);
    } else {
      output.copy_(ReduceLocally(received, ReduceOp::kSum).view(output.sizes()));
    }
  };
  return pending;
}

absl::Status ProcessGroup::Barrier() const {
  c10d::BarrierOptions options;
  options.timeout = timeout_;
  if (local()) return absl::OkStatus();
  return Run("barrier", [&] { return backend_->barrier(options); });
}

absl::Status ProcessGroup::CheckPeer(int peer, const char* operation) const {
  if (peer < 0 || peer >= size()) {
    return absl::InvalidArgumentError(absl::StrCat(operation, " on process group '", name_, "': peer rank ", peer,
                                                   " is outside the group of size ", size()));
  }
  return absl::OkStatus();
}

absl::Status ProcessGroup::CheckMessagePeer(int peer, const char* operation) const {
  if (size() == 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(operation, " on process group '", name_, "': a group of one rank has no peer"));
  }
  return CheckPeer(peer, operation);
}

internal::SharedMemoryChannel* ProcessGroup::MailboxFor(const at::Tensor& tensor, int peer) const {
  const bool fits =
      tensor.numel() * static_cast<int64_t>(tensor.element_size()) <= internal::SharedMemoryChannel::kMaxMessageBytes;
  return fits && peer != rank_ ? SharedMemoryFor(tensor) : nullptr;
}

absl::StatusOr<PendingWork> ProcessGroup::ISend(const at::Tensor& tensor, int dst, int tag) const {
  TRIDENT_RETURN_IF_ERROR(CheckMessagePeer(dst, "send"));
  if (internal::SharedMemoryChannel* channel = MailboxFor(tensor, dst)) {
    PendingWork pending;
    pending.group_ = this;
    pending.operation_ = "send";
    const auto issued = std::chrono::steady_clock::now();
    pending.shared_memory_work_ = channel->Send(tensor.contiguous(), dst, tag, timeout_);
    CountTime("send", issued, /*issued=*/true);
    return pending;
  }
  // The c10d work keeps the (possibly copied) tensor alive until it completes.
  std::vector<at::Tensor> tensors = {OnDevice(tensor.contiguous())};
  return Start("send", [&] { return backend_->send(tensors, dst, tag); });
}

absl::StatusOr<PendingWork> ProcessGroup::IRecv(at::Tensor& tensor, int src, int tag) const {
  TRIDENT_RETURN_IF_ERROR(CheckMessagePeer(src, "recv"));
  if (!tensor.is_contiguous()) {
    return absl::InvalidArgumentError(absl::StrCat("recv on process group '", name_,
                                                   "' needs a contiguous tensor; pass tensor.contiguous()"
                                                   " and copy the result"));
  }
  if (internal::SharedMemoryChannel* channel = MailboxFor(tensor, src)) {
    PendingWork pending;
    pending.group_ = this;
    pending.operation_ = "recv";
    pending.shared_memory_receive_ = channel->PostReceive(tensor, src, tag);
    CountTime("recv", std::chrono::steady_clock::now(), /*issued=*/true);
    return pending;
  }
  std::vector<at::Tensor> tensors = {OnDevice(tensor)};
  TRIDENT_ASSIGN_OR_RETURN(PendingWork pending, Start("recv", [&] { return backend_->recv(tensors, src, tag); }));
  if (!tensors[0].is_same(tensor)) pending.after_ = [tensor, staged = tensors[0]]() mutable { tensor.copy_(staged); };
  return pending;
}

absl::Status ProcessGroup::Send(const at::Tensor& tensor, int dst, int tag) const {
  TRIDENT_ASSIGN_OR_RETURN(PendingWork pending, ISend(tensor, dst, tag));
  return pending.Wait();
}

absl::Status ProcessGroup::Recv(at::Tensor& tensor, int src, int tag) const {
  TRIDENT_ASSIGN_OR_RETURN(PendingWork pending, IRecv(tensor, src, tag));
  return pending.Wait();
}

namespace {

std::string Text(const at::Tensor& bytes) {
  return std::string(static_cast<const char*>(bytes.data_ptr()), bytes.numel());
}

}  // namespace

absl::StatusOr<std::vector<std::vector<std::string>>> AllGatherStrings(const ProcessGroup& group,
                                                                       const std::vector<std::string>& strings) {
  std::string joined;  // each string as "<length>:<bytes>", so any bytes survive
  for (const std::string& text : strings) absl::StrAppend(&joined, text.size(), ":", text);
  at::Tensor length = at::full({1}, static_cast<int64_t>(joined.size()), at::kLong);
  TRIDENT_ASSIGN_OR_RETURN(at::Tensor lengths, group.AllGather(length, 0));
  const int64_t longest = lengths.max().item<int64_t>();
  at::Tensor padded = at::zeros({longest}, at::kByte);
  if (!joined.empty())
    padded.narrow(0, 0, joined.size())
        .copy_(at::from_blob(const_cast<char*>(joined.data()), {static_cast<int64_t>(joined.size())}, at::kByte));
  TRIDENT_ASSIGN_OR_RETURN(at::Tensor all, group.AllGather(padded.view({1, longest}), 0));
  std::vector<std::vector<std::string>> gathered;
  for (int r = 0; r < group.size(); ++r) {
    const std::string text = Text(all[r].narrow(0, 0, lengths[r].item<int64_t>()).contiguous());
    std::vector<std::string> parts;
    for (size_t at = 0; at < text.size();) {
      const size_t colon = text.find(':', at);
      const size_t size = std::stoull(text.substr(at, colon - at));
      parts.push_back(text.substr(colon + 1, size));
      at = colon + 1 + size;
    }
    gathered.push_back(std::move(parts));
  }
  return gathered;
}

absl::Status AgreeOnFailure(const ProcessGroup& group, const absl::Status& local, const char* what) {
  TRIDENT_ASSIGN_OR_RETURN(auto messages, AllGatherStrings(group, {local.ok() ? "" : std::string(local.message())}));
  if (!local.ok()) return local;
  for (size_t r = 0; r < messages.size(); ++r) {
    if (!messages[r][0].empty()) {
      return absl::AbortedError(
          absl::StrCat("rank ", group.global_ranks()[r], " failed while ", what, ": ", messages[r][0]));
    }
  }
  return absl::OkStatus();
}

}  // namespace trident
