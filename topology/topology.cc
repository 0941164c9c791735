#include "topology/topology.h"

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <utility>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
// PyTorch's wheels define USE_C10D_GLOO but ship no Gloo headers; without them
// CPU process groups can have one rank only.
#if defined(USE_C10D_GLOO) && __has_include(<gloo/algorithm.h>)
#define TRIDENT_GLOO 1
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#include <torch/cuda.h>
#include <torch/version.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef USE_C10D_NCCL
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/logging.h"
#include "base/status.h"

namespace trident {
namespace {

std::chrono::milliseconds ToChrono(absl::Duration d) { return std::chrono::milliseconds(absl::ToInt64Milliseconds(d)); }

std::string HeartbeatKey(int rank) { return absl::StrCat("trident/heartbeat/", rank); }
std::string ArrivalKey(int rank) { return absl::StrCat("trident/arrived/", rank); }

bool IsLoopback(const std::string& host) {
  return absl::StartsWith(host, "127.") || host == "localhost" || host == "::1";
}

// Connects to (rank 0: serves) the rendezvous store.
absl::StatusOr<c10::intrusive_ptr<c10d::TCPStore>> ConnectStore(const DistributedEnv& env, bool serve,
                                                                absl::Duration timeout) {
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(env.master_port);
  options.isServer = serve;
  options.waitWorkers = false;
  options.timeout = ToChrono(timeout);
  c10::intrusive_ptr<c10d::TCPStore> store;
  absl::Status status =
      CatchExceptions(absl::StrCat(serve ? "rank 0 could not serve" : "could not reach", " the rendezvous store at ",
                                   env.master_addr, ":", env.master_port),
                      [&] { store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, options); });
  if (!status.ok()) {
    return absl::UnavailableError(absl::StrCat(
        status.message(), serve ? "; the port may be in use: choose another MASTER_PORT"
                                : "; check that rank 0 is running and MASTER_ADDR/MASTER_PORT point at it"));
  }
  return store;
}

class TcpStoreClient : public StoreClient {
 public:
  explicit TcpStoreClient(c10::intrusive_ptr<c10d::TCPStore> store) : store_(std::move(store)) {}

  absl::Status Set(const std::string& key, const std::string& value) override {
    return Call("setting", key, [&] { store_->set(key, std::vector<uint8_t>(value.begin(), value.end())); });
  }
  absl::StatusOr<std::string> Get(const std::string& key) override {
    std::vector<uint8_t> value;
    TRIDENT_RETURN_IF_ERROR(Call("reading", key, [&] { value = store_->get(key); }));
    return std::string(value.begin(), value.end());
  }
  absl::StatusOr<bool> Contains(const std::string& key) override {
    bool found = false;
    TRIDENT_RETURN_IF_ERROR(Call("looking up", key, [&] { found = store_->check({key}); }));
    return found;
  }
  absl::StatusOr<int64_t> Add(const std::string& key, int64_t delta) override {
    int64_t value = 0;
    TRIDENT_RETURN_IF_ERROR(Call("adding to", key, [&] { value = store_->add(key, delta); }));
    return value;
  }

 private:
  template <typename Fn>
  absl::Status Call(const char* what, const std::string& key, Fn&& fn) {
    return CatchExceptions(absl::StrCat(what, " '", key, "' in the rendezvous store"), std::forward<Fn>(fn));
  }

  c10::intrusive_ptr<c10d::TCPStore> store_;
};

// Heartbeats of this rank, and the diagnosis of which peers stopped sending
// theirs. With each beat it also publishes how many collectives this rank
// started on each process group (a counter per rank and group in the store),
// so that a peer waiting in a collective can name a rank, alive but blocked
// elsewhere, that never arrived.
class HeartbeatMonitor {
 public:
  HeartbeatMonitor(const DistributedEnv& env, c10::intrusive_ptr<c10d::Store> store, absl::Duration interval)
      : env_(env), store_(std::move(store)), interval_(interval) {
    thread_ = std::thread([this] { Beat(); });
  }

  ~HeartbeatMonitor() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }

  // Publishes `group`'s progress under `key` (the group's store prefix) until Untrack.
  void Track(const ProcessGroup* group, const std::string& key) {
    std::lock_guard<std::mutex> lock(mutex_);
    tracked_.push_back({group, key, 0});
  }
  // Before the tracked groups are destroyed.
  void UntrackAll() {
    std::lock_guard<std::mutex> lock(mutex_);
    tracked_.clear();
  }

  // `group` (when given) failed in an operation: peers that stopped beating,
  // else peers that started fewer of its collectives than this rank has.
  std::string Diagnose(const std::vector<int>& peers, const ProcessGroup* group = nullptr) {
    std::vector<int64_t> before;
    std::vector<int> silent;
    absl::Status status = CatchExceptions("reading heartbeats", [&] {
      for (int peer : peers) before.push_back(store_->add(HeartbeatKey(peer), 0));
      absl::SleepFor(3 * interval_);
      for (size_t i = 0; i < peers.size(); ++i) {
        if (store_->add(HeartbeatKey(peers[i]), 0) == before[i]) silent.push_back(peers[i]);
      }
    });
    if (!status.ok()) {
      return absl::StrCat("rank 0, which serves the rendezvous store at ", env_.master_addr, ":", env_.master_port,
                          ", is unreachable: it exited or crashed; see its output");
    }
    if (!silent.empty()) {
      return absl::StrCat(silent.size() == 1 ? "rank " : "ranks ", absl::StrJoin(silent, ", "),
                          silent.size() == 1 ? " has" : " have",
                          " stopped sending heartbeats: exited, crashed or stopped (SIGSTOP); see its output");
    }
    std::string key;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (const Tracked& t : tracked_) {
        if (t.group == group) key = t.key;
      }
    }
    if (key.empty()) return "";
    const int64_t mine = group->collectives_started();
    std::vector<std::string> behind;
    CatchExceptions("reading progress", [&] {
      for (int peer : peers) {
        const int64_t theirs = store_->add(ProgressKey(peer, key), 0);
        if (theirs < mine) behind.push_back(absl::StrCat("rank ", peer, " (it started ", theirs, ")"));
      }
    }).IgnoreError();
    if (behind.empty()) return "";
    return absl::StrCat(absl::StrJoin(behind, ", "), " did not arrive at this group's collective #", mine,
                        ": alive but blocked elsewhere; see ", behind.size() == 1 ? "its" : "their", " output");
  }

 private:
  void Beat() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stop_) {
      lock.unlock();
      absl::Status status = CatchExceptions("heartbeat", [&] { store_->add(HeartbeatKey(env_.rank), 1); });
      lock.lock();
      for (Tracked& t : tracked_) {
        const int64_t started = t.group->collectives_started();
        if (!status.ok() || started == t.published) continue;
        status =
            CatchExceptions("progress", [&] { store_->add(ProgressKey(env_.rank, t.key), started - t.published); });
        t.published = started;
      }
      if (!status.ok()) return;  // the store is gone; peers diagnose that themselves
      wake_.wait_for(lock, ToChrono(interval_), [this] { return stop_; });
    }
  }

  static std::string ProgressKey(int rank, const std::string& group_key) {
    return absl::StrCat("trident/progress/", rank, "/", group_key);
  }

  struct Tracked {
    const ProcessGroup* group;
    std::string key;
    int64_t published;
  };

  DistributedEnv env_;
  c10::intrusive_ptr<c10d::Store> store_;
  absl::Duration interval_;
  std::mutex mutex_;  // guards stop_ and tracked_
  std::vector<Tracked> tracked_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::thread thread_;
};

// Waits until every rank has announced itself in `store`, naming the missing ranks on timeout.
// Rank 0 publishes its timeout error so that ranks still waiting report the same one.
absl::Status AwaitAllRanks(c10d::Store& store, const DistributedEnv& env, absl::Duration timeout) {
  constexpr char kFailureKey[] = "trident/rendezvous_failure";
  const absl::Time deadline = absl::Now() + timeout;
  const std::string lost_store = absl::StrCat("lost the rendezvous store at ", env.master_addr, ":", env.master_port,
                                              " while waiting for all ranks: rank 0 exited; see its output");
  TRIDENT_RETURN_IF_ERROR(CatchExceptions("announcing this rank to the rendezvous store", [&] {
    store.set(ArrivalKey(env.rank), std::vector<uint8_t>{1});
    store.add("trident/arrivals", 1);
  }));
  while (true) {
    int64_t arrived = 0;
    std::string published_failure;
    absl::Status polled = CatchExceptions("", [&] {
      arrived = store.add("trident/arrivals", 0);
      if (store.check({kFailureKey})) {
        std::vector<uint8_t> bytes = store.get(kFailureKey);
        published_failure.assign(bytes.begin(), bytes.end());
      }
    });
    if (!polled.ok()) return absl::UnavailableError(lost_store);
    if (arrived >= env.world_size) return absl::OkStatus();
    if (!published_failure.empty()) return absl::DeadlineExceededError(published_failure);
    if (absl::Now() > deadline) {
      std::vector<int> missing;
      absl::Status listed = CatchExceptions("", [&] {
        for (int r = 0; r < env.world_size; ++r) {
          if (!store.check({ArrivalKey(r)})) missing.push_back(r);
        }
      });
      if (!listed.ok()) return absl::UnavailableError(lost_store);
      const std::string failure = absl::StrCat(
          "rendezvous at ", env.master_addr, ":", env.master_port, " timed out after ", absl::FormatDuration(timeout),
          ": rank", missing.size() == 1 ? " " : "s ", absl::StrJoin(missing, ", "), " of ", env.world_size,
          " never arrived; start every rank with the same MASTER_ADDR, MASTER_PORT and "
          "WORLD_SIZE, or raise the rendezvous timeout");
      if (env.rank == 0) {
        (void)CatchExceptions("",
                              [&] { store.set(kFailureKey, std::vector<uint8_t>(failure.begin(), failure.end())); });
        absl::SleepFor(absl::Seconds(1));  // keep serving while the others read it
      }
      return absl::DeadlineExceededError(failure);
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
}

std::mutex& RegistryMutex() {
  static std::mutex* mutex = new std::mutex;
  return *mutex;
}
Topology* live_topology = nullptr;  // guarded by RegistryMutex()

}  // namespace

class Topology::Impl {
 public:
  TopologyOptions options;
  c10::intrusive_ptr<c10d::Store> store;
  std::unique_ptr<HeartbeatMonitor> heartbeat;
#ifdef TRIDENT_GLOO
  std::shared_ptr<::gloo::transport::Device> gloo_device;
#endif
  std::vector<std::unique_ptr<ProcessGroup>> groups;
  int generation = 0;  // Reshape calls so far: keeps the groups' store keys apart
};

std::string AxisAlias(absl::string_view axis) {
  static const auto* aliases = new std::map<std::string, std::string, std::less<>>{
      {"tensor", "tp"}, {"pipeline", "pp"}, {"data", "dp"}, {"sequence", "sp"}, {"context", "cp"}, {"expert", "ep"}};
  auto it = aliases->find(axis);
  return it == aliases->end() ? "" : it->second;
}

Topology::Topology(DistributedEnv env, DeviceMesh mesh)
    : env_(std::move(env)), mesh_(std::move(mesh)), impl_(std::make_unique<Impl>()) {}

Topology::~Topology() {
  {
    std::lock_guard<std::mutex> lock(RegistryMutex());
    if (live_topology == this) live_topology = nullptr;
  }
  impl_->heartbeat.reset();
  impl_->groups.clear();
}

absl::StatusOr<std::unique_ptr<Topology>> Topology::CreateFromEnvironment(TopologyOptions options) {
  TRIDENT_ASSIGN_OR_RETURN(DistributedEnv env, DistributedEnvFromEnvironment());
  return Create(env, std::move(options));
}

absl::StatusOr<std::unique_ptr<Topology>> Topology::Create(const DistributedEnv& env, TopologyOptions options) {
  std::vector<MeshAxis> axes = options.mesh_axes;
  if (axes.empty()) axes = {{"data", env.world_size}};
  TRIDENT_ASSIGN_OR_RETURN(DeviceMesh mesh, DeviceMesh::Create(axes, env.world_size, options.rank_order));
  {
    std::lock_guard<std::mutex> lock(RegistryMutex());
    if (live_topology != nullptr) {
      return absl::FailedPreconditionError(
          "a Topology already exists in this process; destroy it before creating another");
    }
  }
  std::unique_ptr<Topology> topology(new Topology(env, std::move(mesh)));
  Impl& impl = *topology->impl_;
  impl.options = options;

  bool use_nccl = options.backend == CommBackend::kNccl;
  if (options.backend == CommBackend::kAuto) use_nccl = torch::cuda::device_count() > 0;
#ifndef USE_C10D_NCCL
  if (use_nccl) {
    return absl::FailedPreconditionError(
        "the NCCL backend was requested but this LibTorch has no NCCL; use CommBackend::kGloo "
        "or build against a CUDA LibTorch (tools/gpu/CMakeLists.txt)");
  }
#else
  if (use_nccl) c10::cuda::set_device(env.local_rank % torch::cuda::device_count());
#endif
  topology->backend_name_ = use_nccl ? "nccl" : "gloo";

  TRIDENT_ASSIGN_OR_RETURN(auto store, ConnectStore(env, /*serve=*/env.rank == 0, options.rendezvous_timeout));
  impl.store = store;
  TRIDENT_RETURN_IF_ERROR(AwaitAllRanks(*store, env, options.rendezvous_timeout));
  TRIDENT_ASSIGN_OR_RETURN(auto heartbeat_store, ConnectStore(env, /*serve=*/false, absl::Seconds(10)));
  impl.heartbeat = std::make_unique<HeartbeatMonitor>(env, heartbeat_store, options.heartbeat_interval);

#ifdef TRIDENT_GLOO
  if (!use_nccl && (env.world_size > 1 || options.connect_one_rank_groups)) {
    TRIDENT_RETURN_IF_ERROR(CatchExceptions("creating the Gloo transport", [&] {
      if (const char* interface = std::getenv("GLOO_SOCKET_IFNAME")) {
        impl.gloo_device = c10d::ProcessGroupGloo::createDeviceForInterface(interface);
      } else if (IsLoopback(env.master_addr)) {
        impl.gloo_device = c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
      } else {
        impl.gloo_device = c10d::ProcessGroupGloo::createDefaultDevice();
      }
    }));
  }
#endif

  TRIDENT_RETURN_IF_ERROR(topology->ConnectGroups());
  {
    std::lock_guard<std::mutex> lock(RegistryMutex());
    if (live_topology != nullptr) {
      return absl::FailedPreconditionError("a Topology was created concurrently in this process");
    }
    live_topology = topology.get();
  }
  return topology;
}

absl::Status Topology::ConnectGroups() {
  std::vector<std::string> all_axes;
  for (const MeshAxis& axis : mesh_.axes()) all_axes.push_back(axis.name);
  // The world's group ranks are the global ranks, whatever the rank order.
  TRIDENT_ASSIGN_OR_RETURN(world_, AddGroup(all_axes, /*by_global_rank=*/true));
  groups_by_name_["world"] = world_;
  for (const std::string& axis : all_axes) {
    TRIDENT_ASSIGN_OR_RETURN(ProcessGroup * group, GroupSpanning({axis}));
    std::string alias = AxisAlias(axis);
    if (!alias.empty()) groups_by_name_[alias] = group;
  }
  // Return only once every rank has connected all of its groups, so that no rank
  // starts work (or exits) while another is still connecting.
  return world_->Barrier();
}

absl::Status Topology::Reshape(std::vector<MeshAxis> mesh_axes, std::vector<int> rank_order) {
  if (mesh_axes.empty()) mesh_axes = {{"data", env_.world_size}};
  TRIDENT_ASSIGN_OR_RETURN(DeviceMesh mesh, DeviceMesh::Create(mesh_axes, env_.world_size, std::move(rank_order)));
  // Every rank is done with the old groups before any is torn down.
  TRIDENT_RETURN_IF_ERROR(world_->Barrier());
  groups_by_name_.clear();
  world_ = nullptr;
  impl_->heartbeat->UntrackAll();
  impl_->groups.clear();
  mesh_ = std::move(mesh);
  ++impl_->generation;
  return ConnectGroups();
}

absl::StatusOr<std::unique_ptr<StoreClient>> Topology::ConnectStoreClient() const {
  TRIDENT_ASSIGN_OR_RETURN(auto store, ConnectStore(env_, /*serve=*/false, absl::Seconds(10)));
  return std::unique_ptr<StoreClient>(new TcpStoreClient(std::move(store)));
}

absl::StatusOr<ProcessGroup*> Topology::AddGroup(const std::vector<std::string>& axes, bool by_global_rank) {
  std::vector<int> ranks = mesh_.GroupRanks(axes, env_.rank);
  if (by_global_rank) std::sort(ranks.begin(), ranks.end());
  return AddGroupOfRanks(absl::StrJoin(axes, "+"), ranks);
}

absl::StatusOr<ProcessGroup*> Topology::AddGroupOfRanks(const std::string& name, const std::vector<int>& ranks) {
  const int group_rank = static_cast<int>(std::find(ranks.begin(), ranks.end(), env_.rank) - ranks.begin());
  Impl& impl = *impl_;
  const std::chrono::milliseconds timeout = ToChrono(impl.options.timeout);
  const std::string group_key = absl::StrCat(impl.generation, "/", name, "/", absl::StrJoin(ranks, ","));
  auto store = c10::make_intrusive<c10d::PrefixStore>(absl::StrCat("trident/pg/", group_key), impl.store);
  // A group of one rank needs no backend: its collectives are identities, done
  // here (TopologyOptions::connect_one_rank_groups).
  c10::intrusive_ptr<internal::C10dBackend> backend;
  const bool local = ranks.size() == 1 && !impl.options.connect_one_rank_groups;
  absl::Status connected =
      local ? absl::OkStatus()
            : CatchExceptions(
                  absl::StrCat("connecting process group '", name, "' (global ranks ", absl::StrJoin(ranks, ","), ")"),
                  [&] {
                    if (backend_name_ == "gloo") {
#ifdef TRIDENT_GLOO
                      auto options = c10d::ProcessGroupGloo::Options::create(timeout);
                      options->devices = {impl.gloo_device};
                      backend = c10::make_intrusive<c10d::ProcessGroupGloo>(store, group_rank,
                                                                            static_cast<int>(ranks.size()), options);
#else
                      throw std::runtime_error(
                          "this LibTorch ships without Gloo's headers (PyTorch's wheels), so CPU process groups "
                          "can have one rank only; train on GPUs (device=cuda, NCCL) or build against a "
                          "LibTorch with Gloo (Debian's, or PyTorch built from source)");
#endif
                    } else {
#ifdef USE_C10D_NCCL
                      auto options = c10d::ProcessGroupNCCL::Options::create();
                      options->timeout = timeout;
                      backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, group_rank,
                                                                            static_cast<int>(ranks.size()), options);
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
                      // The group's GPU, so that NCCL need not guess it from the global rank.
                      backend->setBoundDeviceId(at::Device(at::kCUDA, c10::cuda::current_device()));
#endif
#endif
                    }
                  });
  HeartbeatMonitor* heartbeat = impl.heartbeat.get();
  if (!connected.ok()) {
    std::vector<int> peers;
    for (int r : ranks) {
      if (r != env_.rank) peers.push_back(r);
    }
    const std::string diagnosis = heartbeat->Diagnose(peers);
    return absl::UnavailableError(diagnosis.empty() ? connected.message()
                                                    : absl::StrCat(connected.message(), "; ", diagnosis));
  }
  const at::Device device =
      backend_name_ == "nccl"
          ? at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(env_.local_rank %
                                                                std::max<int64_t>(1, torch::cuda::device_count())))
          : at::Device(at::kCPU);
  impl.groups.push_back(
      std::make_unique<ProcessGroup>(name, ranks, group_rank, backend, device, timeout,
                                     [heartbeat](const ProcessGroup& failed, const std::vector<int>& peers) {
                                       return heartbeat->Diagnose(peers, &failed);
                                     }));
  ProcessGroup* group = impl.groups.back().get();
  if (!local) {
    TRIDENT_ASSIGN_OR_RETURN(std::string unshared, group->ConnectSharedMemory());
    if (!unshared.empty()) {
      LOG(WARNING) << "process group '" << name << "' reduces through sockets: its ranks share this host, but "
                   << "shared memory could not be set up (" << unshared << "); free or enlarge /dev/shm "
                   << "(docker: --shm-size) to use it, or set TRIDENT_SHARED_MEMORY=0 to keep the sockets quietly";
    }
  }
  heartbeat->Track(group, group_key);
  groups_by_name_[name] = group;
  return group;
}

absl::StatusOr<ProcessGroup*> Topology::Group(absl::string_view name) const {
  auto it = groups_by_name_.find(std::string(name));
  if (it != groups_by_name_.end()) return it->second;
  std::vector<std::string> names;
  for (const auto& entry : groups_by_name_) names.push_back(entry.first);
  return absl::NotFoundError(absl::StrCat("no process group named '", name, "'; this topology (", mesh_.ToString(),
                                          ") has ", absl::StrJoin(names, ", ")));
}

absl::StatusOr<ProcessGroup*> Topology::GroupSpanning(const std::vector<std::string>& axes) {
  for (const std::string& axis : axes) {
    if (!mesh_.HasAxis(axis)) {
      return absl::InvalidArgumentError(absl::StrCat("mesh ", mesh_.ToString(), " has no axis '", axis, "'"));
    }
  }
  auto existing = groups_by_name_.find(absl::StrJoin(axes, "+"));
  if (existing != groups_by_name_.end()) return existing->second;
  return AddGroup(axes);
}

absl::StatusOr<Topology::SplitGroups> Topology::SplitAxis(const std::string& axis, int block_size) {
  TRIDENT_ASSIGN_OR_RETURN(ProcessGroup * whole, GroupSpanning({axis}));
  if (block_size < 1 || whole->size() % block_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat("blocks of ", block_size, " ranks do not divide the ", whole->size(),
                                                   " ranks of axis '", axis, "'"));
  }
  const std::string block_name = absl::StrCat(axis, ".block", block_size);
  const std::string across_name = absl::StrCat(axis, ".across", block_size);
  auto block = groups_by_name_.find(block_name);
  if (block != groups_by_name_.end()) return SplitGroups{block->second, groups_by_name_.at(across_name)};
  const std::vector<int>& members = whole->global_ranks();
  const int first = whole->rank() / block_size * block_size, column = whole->rank() % block_size;
  std::vector<int> in_block(members.begin() + first, members.begin() + first + block_size), across;
  for (int i = column; i < whole->size(); i += block_size) across.push_back(members[i]);
  SplitGroups split;
  TRIDENT_ASSIGN_OR_RETURN(split.block, AddGroupOfRanks(block_name, in_block));
  TRIDENT_ASSIGN_OR_RETURN(split.across, AddGroupOfRanks(across_name, across));
  return split;
}

absl::StatusOr<ProcessGroup*> FindProcessGroup(absl::string_view name) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  if (live_topology == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("process group '", name,
                     "' was requested but this process has no Topology; create "
                     "one with Topology::Create before running distributed operators"));
  }
  return live_topology->Group(name);
}

}  // namespace trident
