#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/autograd.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "amp/amp.h"
#include "base/memory_counter.h"
#include "base/rng.h"
#include "base/status.h"
#include "google/protobuf/text_format.h"
#include "pipeline/weight_gradients.h"
#include "strategy/internal/profile.h"
#include "zero/zero.h"

namespace trident {
namespace internal {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double Since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

int64_t Bytes(const Values& values) {
  int64_t bytes = 0;
  for (const at::Tensor& t : values) bytes += t.defined() ? t.numel() * t.element_size() : 0;
  return bytes;
}

// The straight line through the first and the last point (never decreasing).
Linear Fit(const std::vector<int64_t>& sizes, const std::vector<double>& values) {
  Linear line;
  const double b0 = static_cast<double>(sizes.front()), b1 = static_cast<double>(sizes.back());
  const double slope = b1 > b0 ? std::max(0.0, (values.back() - values.front()) / (b1 - b0)) : values.front() / b0;
  line.set_per_sample(slope);
  line.set_base(std::max(0.0, values.front() - slope * b0));
  return line;
}

// One forward and backward of a layer, measured.
struct LayerRun {
  double forward = 0, backward = 0;
  int64_t kept = 0, transient = 0, output = 0;
  int64_t split_held = 0;  // with `split`: held between the backward's input and weight halves
  Values outputs;          // detached, floating ones requiring gradients (the next layer's input)
};

// One forward and backward of layer `i`, timed, and with `count` its bytes
// counted (the counter's lock per allocation stays out of timed runs); with
// `split` the backward runs as a zero-bubble schedule runs it, input half
// then weight half.
absl::StatusOr<LayerRun> RunLayerOnce(LayerSequence& part, int64_t i, bool last, const Values& inputs,
                                      const Batch& batch, const LossFunction& loss, const PrecisionPolicy& precision,
                                      bool count, bool split = false) {
  MemoryCounter& counter = MemoryCounter::Install();
  if (!count) MemoryCounter::Uninstall();
  LayerRun run;
  TRIDENT_RETURN_IF_ERROR(CatchExceptions(absl::StrCat("profiling layer ", i, " (", part.LayerName(i), ")"), [&] {
    c10::AutoGradMode grad(true);
    const int64_t before = counter.live_bytes();
    auto start = Clock::now();
    Values outputs;
    at::Tensor scalar;
    {
      AutocastScope autocast(precision, at::kCPU);
      outputs = part.RunLayer(i, inputs, batch);
      if (last) scalar = loss ? loss(batch, outputs) : part.Loss(outputs, batch);
    }
    run.forward = Since(start);
    run.kept = counter.live_bytes() - before;
    run.output = Bytes(outputs);
    const int64_t at_backward = counter.live_bytes();
    counter.ResetPeak();
    start = Clock::now();
    std::vector<at::Tensor> roots, grads;
    if (last) {
      roots.push_back(scalar);
    } else {
      for (const at::Tensor& t : outputs) {
        if (t.defined() && t.requires_grad()) {
          roots.push_back(t);
          grads.push_back(at::ones_like(t));
        }
      }
    }
    internal::DeferredWeightGradients deferred;
    internal::DeferredWeightGradients::Parameters parameters;
    for (const auto& [name, p] : part.LayerParameters(i)) parameters.insert(p.unsafeGetTensorImpl());
    const bool deferring = split && !roots.empty() && deferred.Defer(roots, parameters);
    if (!roots.empty()) torch::autograd::backward(roots, grads, /*keep_graph=*/deferring);
    if (deferring) {
      run.split_held = std::max<int64_t>(0, counter.live_bytes() - at_backward);
      deferred.Run();
    }
    run.backward = Since(start);
    run.transient = std::max<int64_t>(0, counter.peak_bytes() - at_backward);
    for (const at::Tensor& t : outputs) {
      at::Tensor next = t.defined() ? t.detach() : t;
      if (next.defined() && next.is_floating_point()) next.requires_grad_(true);
      run.outputs.push_back(next);
    }
  }));
  return run;
}

// Bytes from two counted runs (the first, also the warm-up, splits its
// backward to count what that holds), times the median of seven uncounted
// runs: a layer measured once stands for every layer like it. Every rank of
// `world` starts each timed run together, so that each is timed with all
// ranks busy (where ranks share cores, a rank timed alone runs up to twice
// as fast).
absl::StatusOr<LayerRun> MeasureLayer(LayerSequence& part, int64_t i, bool last, const Values& inputs,
                                      const Batch& batch, const LossFunction& loss, const PrecisionPolicy& precision,
                                      const ProcessGroup& world) {
  TRIDENT_ASSIGN_OR_RETURN(LayerRun split, RunLayerOnce(part, i, last, inputs, batch, loss, precision, true, true));
  TRIDENT_ASSIGN_OR_RETURN(LayerRun result, RunLayerOnce(part, i, last, inputs, batch, loss, precision, true));
  result.split_held = split.split_held;
  std::vector<double> forward, backward;
  for (int r = 0; r < 7; ++r) {
    TRIDENT_RETURN_IF_ERROR(world.Barrier());
    TRIDENT_ASSIGN_OR_RETURN(LayerRun run, RunLayerOnce(part, i, last, inputs, batch, loss, precision, false));
    forward.push_back(run.forward);
    backward.push_back(run.backward);
  }
  std::sort(forward.begin(), forward.end());
  std::sort(backward.begin(), backward.end());
  result.forward = forward[forward.size() / 2];
  result.backward = backward[backward.size() / 2];
  return result;
}

// What makes two layers cost the same: their name with digits masked, their
// parameters' shapes and dtypes, and their inputs' shapes.
std::string Signature(const std::string& name, const NamedTensors& parameters, const Values& inputs,
                      const std::string& flops) {
  std::string masked = name;
  for (char& c : masked) {
    if (c >= '0' && c <= '9') c = '#';
  }
  std::ostringstream s;
  s << masked << "|" << flops;
  for (const auto& [n, p] : parameters) s << "|" << p.sizes() << p.scalar_type();
  s << "|in";
  for (const at::Tensor& t : inputs) {
    if (t.defined()) s << t.sizes() << t.scalar_type();
  }
  return s.str();
}

struct Measured {
  std::vector<LayerRun> fp32, bf16;  // per micro-batch size
};

// Profiles every layer of the source built for `tp`, one layer built at a
// time; layers that cost the same as an earlier one reuse its measurements.
absl::Status ProfileLayers(const ProfileRequest& request, const TensorParallelism& tp, bool bf16,
                           const ProcessGroup& world, ModelProfile* profile) {
  ModelContext context;
  context.tp = tp;
  context.seed = request.plan.seed();
  TRIDENT_ASSIGN_OR_RETURN(ModelSource made, request.make_source(context));
  if (made.kind != ModelSource::Kind::kLayers && request.plan.trace().method() != TraceSpec::layers && tp.size > 1) {
    return absl::InvalidArgumentError(
        "the search does not profile automatic tensor parallelism of traced models yet; give --tp explicitly");
  }
  const std::vector<int64_t>& sizes = request.micro_batch_sizes;
  std::vector<Batch> batches;
  for (int64_t b : sizes) batches.push_back(BatchRows(request.batch, 0, b));
  // Per micro-batch size: a traced graph holds its example's shapes.
  std::vector<SourceLayers> sources;
  for (size_t k = 0; k < sizes.size(); ++k) {
    if (k > 0 && sources[0].forward_flops.empty()) break;
    TRIDENT_ASSIGN_OR_RETURN(SourceLayers layers, LayersOf(made, request.plan, batches[k]));
    if (k > 0 && layers.layers.num_layers != sources[0].layers.num_layers) {
      return absl::InternalError(absl::StrCat("the traced model splits into ", sources[0].layers.num_layers,
                                              " shards at micro-batch size ", sizes[0], " but ",
                                              layers.layers.num_layers, " at ", sizes[k]));
    }
    sources.push_back(std::move(layers));
  }
  const bool traced = !sources[0].forward_flops.empty();
  const ModelSource& source = sources[0].layers;
  profile->set_builds_deferred(source.build_deferred || sources[0].values_deferred);
  TRIDENT_ASSIGN_OR_RETURN(PrecisionPolicy fp32, MakePrecisionPolicy("fp32", ""));
  TRIDENT_ASSIGN_OR_RETURN(PrecisionPolicy bf16_policy, MakePrecisionPolicy("bf16", ""));
  std::vector<Values> inputs(sizes.size()), inputs_bf16(sizes.size());
  std::map<std::string, Measured> measured;
  const bool first_profile = profile->layers_size() == 0;
  for (int64_t i = 0; i < source.num_layers; ++i) {
    TRIDENT_ASSIGN_OR_RETURN(std::shared_ptr<LayerSequence> part, source.build({{i, i + 1}}));
    const bool last = i + 1 == source.num_layers;
    NamedTensors parameters;
    TRIDENT_RETURN_IF_ERROR(
        CatchExceptions("listing the layer's parameters", [&] { parameters = part->LayerParameters(i); }));
    const std::string flops = traced ? absl::StrCat(sources[0].forward_flops[i]) : "";
    const std::string signature = Signature(part->LayerName(i), parameters, inputs[0], flops);
    auto found = measured.find(signature);
    if (found == measured.end()) {
      Measured m;
      for (size_t k = 0; k < sizes.size(); ++k) {
        std::shared_ptr<LayerSequence> sized = part;
        if (k > 0 && traced) {
          TRIDENT_ASSIGN_OR_RETURN(sized, sources[k].layers.build({{i, i + 1}}));
        }
        TRIDENT_ASSIGN_OR_RETURN(LayerRun run,
                                 MeasureLayer(*sized, i, last, inputs[k], batches[k], source.loss, fp32, world));
        m.fp32.push_back(std::move(run));
        if (bf16) {
          TRIDENT_ASSIGN_OR_RETURN(LayerRun run16, MeasureLayer(*sized, i, last, inputs_bf16[k], batches[k],
                                                                source.loss, bf16_policy, world));
          m.bf16.push_back(std::move(run16));
        }
      }
      found = measured.emplace(signature, std::move(m)).first;
    }
    const Measured& m = found->second;
    if (first_profile) {
      ProfiledLayer* layer = profile->add_layers();
      layer->set_name(part->LayerName(i));
      int64_t rows = 0;
      for (const at::Tensor& x : inputs[0]) {
        if (x.defined() && x.is_floating_point() && x.dim() > 0) {
          rows = x.numel() / std::max<int64_t>(1, x.size(-1)) / sizes[0];
          break;
        }
      }
      layer->set_rows_per_sample(rows);
      if (traced) layer->set_partition_flops(sources[0].forward_flops[i]);
    }
    if (profile->layers(i).name() != part->LayerName(i)) {
      return absl::InternalError(absl::StrCat("layer ", i, " is '", part->LayerName(i), "' at tp=", tp.size, " but '",
                                              profile->layers(i).name(), "' at tp=1"));
    }
    LayerShard* shard = profile->mutable_layers(i)->add_shards();
    shard->set_tp(static_cast<int>(tp.size));
    if (tp.sequence_parallel) shard->set_sequence_parallel(true);
    for (const auto& [name, p] : parameters) {
      ProfiledParameter* q = shard->add_parameters();
      q->set_name(name);
      q->set_numel(p.numel());
      q->set_element_size(static_cast<int>(p.element_size()));
      q->set_dim(static_cast<int>(p.dim()));
    }
    auto fit = [&](const std::vector<LayerRun>& runs, auto value) {
      std::vector<double> y;
      for (const LayerRun& r : runs) y.push_back(static_cast<double>(value(r)));
      return Fit(sizes, y);
    };
    *shard->mutable_forward_seconds() = fit(m.fp32, [](const LayerRun& r) { return r.forward; });
    *shard->mutable_backward_seconds() = fit(m.fp32, [](const LayerRun& r) { return r.backward; });
    *shard->mutable_kept_bytes() = fit(m.fp32, [](const LayerRun& r) { return r.kept; });
    *shard->mutable_backward_transient_bytes() = fit(m.fp32, [](const LayerRun& r) { return r.transient; });
    *shard->mutable_output_bytes() = fit(m.fp32, [](const LayerRun& r) { return r.output; });
    *shard->mutable_split_held_bytes() = fit(m.fp32, [](const LayerRun& r) { return r.split_held; });
    if (bf16) {
      *shard->mutable_bf16_forward_seconds() = fit(m.bf16, [](const LayerRun& r) { return r.forward; });
      *shard->mutable_bf16_backward_seconds() = fit(m.bf16, [](const LayerRun& r) { return r.backward; });
      *shard->mutable_bf16_kept_bytes() = fit(m.bf16, [](const LayerRun& r) { return r.kept; });
    }
    for (size_t k = 0; k < sizes.size(); ++k) {
      inputs[k] = m.fp32[k].outputs;
      if (bf16) inputs_bf16[k] = m.bf16[k].outputs;
    }
  }
  return absl::OkStatus();
}

// Times `op` over `group` for tensors of `bytes` (the whole tensor): the
// fastest of two runs after a warm-up, all ranks starting together.
absl::StatusOr<double> TimeCollective(const ProcessGroup& group, const std::string& op, int64_t bytes) {
  const int64_t n = std::max<int64_t>(group.size(), bytes / 4 / group.size() * group.size());
  at::Tensor full = at::ones({n});
  at::Tensor chunk = at::ones({n / group.size()});
  double best = 1e30;
  for (int r = 0; r < 3; ++r) {
    TRIDENT_RETURN_IF_ERROR(group.Barrier());
    const auto start = Clock::now();
    if (op == "all_reduce") {
      TRIDENT_RETURN_IF_ERROR(group.AllReduce(full));
    } else if (op == "all_gather") {
      TRIDENT_RETURN_IF_ERROR(group.AllGather(chunk, 0).status());
    } else if (op == "reduce_scatter") {
      TRIDENT_RETURN_IF_ERROR(group.ReduceScatter(full, 0).status());
    } else {  // send_recv: half a round trip between ranks 0 and 1
      if (group.rank() == 0) {
        TRIDENT_RETURN_IF_ERROR(group.Send(full, 1));
        TRIDENT_RETURN_IF_ERROR(group.Recv(full, 1));
      } else if (group.rank() == 1) {
        TRIDENT_RETURN_IF_ERROR(group.Recv(full, 0));
        TRIDENT_RETURN_IF_ERROR(group.Send(full, 0));
      }
    }
    const double seconds = op == "send_recv" ? Since(start) / 2 : Since(start);
    if (r > 0) best = std::min(best, seconds);
  }
  return best;
}

absl::Status ProfileCollectives(const ProfileRequest& request, Topology* topology, ModelProfile* profile) {
  const int world = topology->world_size();
  std::vector<int64_t> sizes;
  for (int64_t bytes = 4 << 10; bytes <= request.max_collective_bytes; bytes *= 8) sizes.push_back(bytes);
  for (int g = 2; g <= world; ++g) {
    if (world % g != 0) continue;
    TRIDENT_RETURN_IF_ERROR(topology->Reshape({{"probe", g}, {"rest", world / g}}));
    TRIDENT_ASSIGN_OR_RETURN(ProcessGroup * group, topology->Group("probe"));
    std::vector<std::string> ops = {"all_reduce", "all_gather", "reduce_scatter"};
    if (g == 2) ops.push_back("send_recv");
    for (const std::string& op : ops) {
      CollectiveCurve* curve = profile->add_collectives();
      curve->set_op(op);
      curve->set_group_size(g);
      for (int64_t bytes : sizes) {
        TRIDENT_ASSIGN_OR_RETURN(double seconds, TimeCollective(*group, op, bytes));
        curve->add_bytes(static_cast<double>(bytes));
        curve->add_seconds(seconds);
      }
    }
  }
  return topology->Reshape({});
}

absl::Status ProfileOptimizer(const OptimizerFactory& make_optimizer, ModelProfile* profile) {
  return CatchExceptions("profiling the optimizer", [&] {
    const int64_t n = 1 << 20;
    at::Tensor p = at::zeros({1024, n / 1024}).requires_grad_(true);
    p.mutable_grad() = at::full_like(p, 1e-3);
    std::unique_ptr<torch::optim::Optimizer> optimizer = make_optimizer({{p}});
    profile->set_optimizer_state_per_element(static_cast<int>(OptimizerStateBytes(*optimizer, n * 4) / (n * 4)));
    double best = 1e30;
    for (int r = 0; r < 3; ++r) {
      const auto start = Clock::now();
      optimizer->step();
      if (r > 0) best = std::min(best, Since(start));
    }
    profile->set_optimizer_seconds_per_element(best / n);
  });
}

// Rank 0's `text` on every rank of `group`.
absl::StatusOr<std::string> BroadcastText(const ProcessGroup& group, const std::string& text) {
  at::Tensor length = at::full({1}, static_cast<int64_t>(text.size()), at::kLong);
  TRIDENT_RETURN_IF_ERROR(group.Broadcast(length, 0));
  at::Tensor bytes = at::zeros({length.item<int64_t>()}, at::kByte);
  if (group.rank() == 0 && !text.empty()) std::memcpy(bytes.data_ptr(), text.data(), text.size());
  if (bytes.numel() > 0) TRIDENT_RETURN_IF_ERROR(group.Broadcast(bytes, 0));
  return std::string(static_cast<const char*>(bytes.data_ptr()), bytes.numel());
}

absl::StatusOr<ModelProfile> ShareRankZeros(const ProcessGroup& world, const ModelProfile& profile) {
  std::string text;
  if (world.rank() == 0) google::protobuf::TextFormat::PrintToString(profile, &text);
  TRIDENT_ASSIGN_OR_RETURN(text, BroadcastText(world, text));
  ModelProfile shared;
  if (!google::protobuf::TextFormat::ParseFromString(text, &shared)) {
    return absl::InternalError("the profile rank 0 sent does not parse");
  }
  return shared;
}

}  // namespace

Batch BatchRows(const Batch& batch, int64_t first, int64_t count) {
  Batch rows;
  for (const at::Tensor& t : batch) rows.push_back(t.dim() > 0 ? t.narrow(0, first, count) : t);
  return rows;
}

absl::StatusOr<ModelProfile> ProfileModel(const ProfileRequest& request, Topology* topology) {
  const auto start = Clock::now();
  // The layers count their bytes through MemoryCounter, which costs a lock per
  // allocation: it stays in front of the allocator only while profiling.
  struct CounterOff {
    ~CounterOff() { MemoryCounter::Uninstall(); }
  } counter_off;
  const at::Tensor rng = CpuRngState();
  const int world = topology->world_size();
  ModelProfile profile;
  profile.set_fingerprint(request.fingerprint);
  profile.set_baseline_rss_bytes(ResidentBytes());
  profile.set_has_bf16(request.bf16);
  profile.set_ranks_per_node(topology->env().local_world_size);
  cpu_set_t cores;
  profile.set_cores_per_node(sched_getaffinity(0, sizeof(cores), &cores) == 0
                                 ? CPU_COUNT(&cores)
                                 : static_cast<int>(std::thread::hardware_concurrency()));
  if (topology->rank() == 0) {
    absl::StatusOr<DiskBandwidth> disk = MeasureOffloadBandwidth(request.plan.zero().offload_dir());
    if (disk.ok()) {
      profile.set_disk_write_bytes_per_second(disk->write_bytes_per_second);
      profile.set_disk_read_bytes_per_second(disk->read_bytes_per_second);
    }
  }
  for (int64_t b : request.micro_batch_sizes) profile.add_micro_batch_sizes(b);
  TRIDENT_RETURN_IF_ERROR(topology->Reshape({}));
  absl::Status layers = ProfileLayers(request, TensorParallelism{}, request.bf16, topology->world(), &profile);
  TRIDENT_RETURN_IF_ERROR(AgreeOnFailure(topology->world(), layers, "profiling the model's layers"));
  profile.add_tensor_parallel_degrees(1);
  for (int tp : request.tp_degrees) {
    if (tp <= 1 || world % tp != 0) continue;
    TRIDENT_RETURN_IF_ERROR(topology->Reshape({{"tensor", tp}, {"data", world / tp}}));
    TRIDENT_ASSIGN_OR_RETURN(ProcessGroup * group, topology->Group("tensor"));
    for (bool sequence_parallel : {false, true}) {
      ModelProfile with_tp = profile;
      absl::Status sharded = ProfileLayers(request, TensorParallelism{tp, group->rank(), "tp", sequence_parallel},
                                           /*bf16=*/false, topology->world(), &with_tp);
      // A degree the model's shapes do not divide fails on every rank alike: it is left out.
      if (!AgreeOnFailure(topology->world(), sharded, "profiling tensor parallelism").ok()) break;
      profile = std::move(with_tp);
      if (sequence_parallel) {
        profile.add_sequence_parallel_degrees(tp);
      } else {
        profile.add_tensor_parallel_degrees(tp);
      }
    }
  }
  TRIDENT_RETURN_IF_ERROR(ProfileCollectives(request, topology, &profile));
  TRIDENT_RETURN_IF_ERROR(
      AgreeOnFailure(topology->world(), ProfileOptimizer(request.make_optimizer, &profile), "profiling the optimizer"));
  SetCpuRngState(rng);
  profile.set_profile_seconds(Since(start));
  return ShareRankZeros(topology->world(), profile);
}

absl::StatusOr<ModelProfile> CachedProfile(const ProfileRequest& request, const std::string& cache_dir,
                                           Topology* topology, bool* from_cache) {
  const fs::path path = fs::path(cache_dir) / absl::StrCat(std::hash<std::string>()(request.fingerprint), ".pbtxt");
  ModelProfile cached;
  bool hit = false;
  if (topology->rank() == 0 && fs::exists(path)) {
    std::ifstream in(path);
    std::stringstream text;
    text << in.rdbuf();
    hit = google::protobuf::TextFormat::ParseFromString(text.str(), &cached) &&
          cached.fingerprint() == request.fingerprint;
  }
  at::Tensor flag = at::full({1}, hit ? 1 : 0, at::kLong);
  TRIDENT_RETURN_IF_ERROR(topology->world().Broadcast(flag, 0));
  *from_cache = flag.item<int64_t>() == 1;
  if (*from_cache) return ShareRankZeros(topology->world(), cached);
  TRIDENT_ASSIGN_OR_RETURN(ModelProfile profile, ProfileModel(request, topology));
  if (topology->rank() == 0) {
    std::error_code error;
    fs::create_directories(cache_dir, error);
    std::string text;
    google::protobuf::TextFormat::PrintToString(profile, &text);
    std::ofstream out(path);
    out << text;
    if (!out) LOG(WARNING) << "could not cache the strategy profile in " << path << "; it is measured again next time";
  }
  return profile;
}

double CollectiveSeconds(const ModelProfile& profile, const std::string& op, int group_size, double bytes) {
  if (group_size <= 1 || bytes <= 0) return 0;
  for (const CollectiveCurve& curve : profile.collectives()) {
    if (curve.op() != op || curve.group_size() != group_size || curve.bytes_size() < 2) continue;
    int k = 1;
    while (k + 1 < curve.bytes_size() && curve.bytes(k) < bytes) ++k;
    const double x0 = curve.bytes(k - 1), x1 = curve.bytes(k);
    const double y0 = curve.seconds(k - 1), y1 = curve.seconds(k);
    return std::max(y0 * 0.5, y0 + (y1 - y0) * (bytes - x0) / (x1 - x0));
  }
  return 0;
}

}  // namespace internal
}  // namespace trident
