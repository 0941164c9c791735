#include "strategy/internal/cost_model.h"

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "amp/amp.h"
#include "base/status.h"
#include "partition/partition.h"
#include "pipeline/pipeline.h"
#include "strategy/internal/profile.h"
#include "zero/zero.h"

namespace trident {
namespace internal {
namespace {

double At(const Linear& line, int64_t b) { return line.base() + line.per_sample() * static_cast<double>(b); }

absl::StatusOr<const LayerShard*> ShardFor(const ProfiledLayer& layer, int tp, bool sequence_parallel = false) {
  for (const LayerShard& shard : layer.shards()) {
    if (shard.tp() == tp && shard.sequence_parallel() == sequence_parallel) return &shard;
  }
  return absl::InvalidArgumentError(absl::StrCat("tp=", tp, sequence_parallel ? " with sequence parallelism" : "",
                                                 " was not profiled (the model's shapes do not divide it)"));
}

// One layer's costs at the plan's micro-batch size, tensor-parallel degree and precision.
struct LayerCost {
  const LayerShard* shard = nullptr;
  const LayerShard* whole = nullptr;  // tp 1
  double forward = 0, backward = 0;
  double kept = 0, transient = 0, output = 0;
  double split_held = 0;  // between a split backward's halves
};

// A pipeline rank's view of the plan: its chunks' layers and what they cost.
struct RankView {
  std::vector<std::pair<int64_t, int64_t>> chunks;  // [first, end) per chunk
  std::vector<std::vector<bool>> recomputed;        // per chunk, per layer
};

class PlanCosts {
 public:
  static absl::StatusOr<PlanCosts> Make(const ModelProfile& profile, const ParallelPlan& plan) {
    PlanCosts c(profile, plan);
    TRIDENT_ASSIGN_OR_RETURN(c.precision_, MakePrecisionPolicy(plan.precision().mode(), plan.precision().table()));
    const bool bf16 = c.precision_.compute == at::kBFloat16;
    if (bf16 && !profile.has_bf16()) {
      return absl::InvalidArgumentError("bf16 was not profiled (precision changes were not allowed)");
    }
    for (int i = 0; i < profile.layers_size(); ++i) {
      LayerCost cost;
      TRIDENT_ASSIGN_OR_RETURN(cost.shard,
                               ShardFor(profile.layers(i), plan.tp(), plan.tensor_parallel().sequence_parallel()));
      TRIDENT_ASSIGN_OR_RETURN(cost.whole, ShardFor(profile.layers(i), 1));
      const LayerShard* shard = cost.shard;
      const LayerShard* whole = cost.whole;
      const int64_t b = plan.micro_batch_size();
      cost.forward = At(shard->forward_seconds(), b);
      cost.backward = At(shard->backward_seconds(), b);
      cost.kept = At(shard->kept_bytes(), b);
      cost.transient = At(shard->backward_transient_bytes(), b);
      cost.output = At(shard->output_bytes(), b);
      cost.split_held = At(shard->split_held_bytes(), b);
      if (bf16) {  // tp 1's bf16 / fp32 ratio applied to this degree
        auto ratio = [&](const Linear& low, const Linear& full) {
          const double f = At(full, b);
          return f > 0 ? At(low, b) / f : 1.0;
        };
        cost.forward *= ratio(whole->bf16_forward_seconds(), whole->forward_seconds());
        cost.backward *= ratio(whole->bf16_backward_seconds(), whole->backward_seconds());
        cost.kept *= ratio(whole->bf16_kept_bytes(), whole->kept_bytes());
      }
      c.layers_.push_back(cost);
    }
    TRIDENT_ASSIGN_OR_RETURN(c.bounds_, StageBoundaries(profile, plan));
    TRIDENT_ASSIGN_OR_RETURN(c.schedule_,
                             MakeSchedule(plan.pp() > 1 ? plan.pipeline().schedule() : "1f1b", plan.virtual_stages()));
    TRIDENT_RETURN_IF_ERROR(c.schedule_->Check(plan.pp(), static_cast<int>(plan.num_micro_batches())));
    for (int s = 0; s < plan.pp(); ++s) c.ranks_.push_back(c.View(s));
    return c;
  }

  const ParallelPlan& plan() const { return plan_; }
  const RankView& rank(int s) const { return ranks_[s]; }
  const LayerCost& layer(int64_t i) const { return layers_[i]; }
  const PipelineSchedule& schedule() const { return *schedule_; }

  // The parameters rank `s` stores, once each by name, in the order Parallelize lists them.
  std::vector<const ProfiledParameter*> Parameters(int s) const {
    std::vector<const ProfiledParameter*> list;
    std::set<std::string> seen;
    for (const auto& [first, end] : ranks_[s].chunks) {
      for (int64_t i = first; i < end; ++i) {
        for (const ProfiledParameter& p : layers_[i].shard->parameters()) {
          if (seen.insert(p.name()).second) list.push_back(&p);
        }
      }
    }
    return list;
  }
  int64_t ElementSize(const ProfiledParameter& p) const {
    return precision_.param == at::kFloat ? p.element_size() : static_cast<int64_t>(c10::elementSize(precision_.param));
  }
  int64_t ParameterBytes(int s) const {
    int64_t bytes = 0;
    for (const ProfiledParameter* p : Parameters(s)) bytes += p->numel() * ElementSize(*p);
    return bytes;
  }
  // Bytes of rank `s`'s parameters that every tensor-parallel rank holds
  // whole (norms, row-parallel biases): sequence parallelism sums their
  // gradients over the group.
  int64_t ReplicatedBytes(int s) const {
    std::map<std::string, int64_t> whole;
    for (const auto& [first, end] : ranks_[s].chunks) {
      for (int64_t i = first; i < end; ++i) {
        for (const ProfiledParameter& p : layers_[i].whole->parameters()) whole[p.name()] = p.numel();
      }
    }
    int64_t bytes = 0;
    for (const ProfiledParameter* p : Parameters(s)) {
      if (whole[p->name()] == p->numel()) bytes += p->numel() * ElementSize(*p);
    }
    return bytes;
  }
  int64_t ParameterCount(int s) const {
    int64_t count = 0;
    for (const ProfiledParameter* p : Parameters(s)) count += p->numel();
    return count;
  }
  // Bytes a chunk keeps per micro-batch between its forward and backward:
  // its received input, every layer's saved tensors, and of a recomputed
  // segment (up to checkpoint_num_layers layers) only its output.
  double Kept(int s, size_t c) const {
    const auto [first, end] = ranks_[s].chunks[c];
    double bytes = first > 0 ? layers_[first - 1].output : 0;
    ForSegments(s, c, [&](int64_t i, bool recomputed, bool segment_end, double) {
      if (!recomputed) bytes += layers_[i].kept;
      if (recomputed && segment_end) bytes += layers_[i].output;
    });
    return bytes;
  }
  // What the chunk's split backward holds from its input half to its weight half.
  double SplitHeld(int s, size_t c) const {
    double bytes = 0;
    ForSegments(s, c, [&](int64_t i, bool, bool, double) { bytes += layers_[i].split_held; });
    return bytes;
  }
  // The scratch of the chunk's backward: a layer's backward, on top of the
  // recomputed segment it belongs to.
  double Scratch(int s, size_t c) const {
    double scratch = 0;
    ForSegments(s, c, [&](int64_t i, bool, bool, double segment) {
      scratch = std::max(scratch, segment + layers_[i].transient);
    });
    return scratch;
  }
  // Seconds per micro-batch on rank `s`.
  double Forward(int s) const {
    return Sum(s, [](const LayerCost& l, bool) { return l.forward; });
  }
  double Backward(int s) const {
    return Sum(s, [](const LayerCost& l, bool) { return l.backward; });
  }
  double Recompute(int s) const {
    return Sum(s, [](const LayerCost& l, bool recomputed) { return recomputed ? l.forward : 0.0; });
  }

 private:
  PlanCosts(const ModelProfile& profile, const ParallelPlan& plan) : profile_(&profile), plan_(plan) {}

  template <typename Fn>
  double Sum(int s, Fn value) const {
    double total = 0;
    for (size_t c = 0; c < ranks_[s].chunks.size(); ++c) {
      const auto [first, end] = ranks_[s].chunks[c];
      for (int64_t i = first; i < end; ++i) total += value(layers_[i], ranks_[s].recomputed[c][i - first]);
    }
    return total;
  }

  // Calls fn(layer, recomputed, last of its segment, bytes the segment
  // rematerialises up to this layer) for the chunk's layers in order, with
  // the stage runner's segments.
  template <typename Fn>
  void ForSegments(int s, size_t c, Fn fn) const {
    const auto [first, end] = ranks_[s].chunks[c];
    const std::vector<bool>& recomputed = ranks_[s].recomputed[c];
    double segment = 0;
    int64_t length = 0;
    for (int64_t i = first; i < end; ++i) {
      const bool r = recomputed[i - first];
      if (!r || length == plan_.recompute().num_layers()) segment = 0, length = 0;
      if (r) {
        segment += layers_[i].kept - layers_[i].output;
        ++length;
      }
      const bool next_joins = i + 1 < end && recomputed[i + 1 - first] && length < plan_.recompute().num_layers();
      fn(i, r, r && !next_joins, segment);
    }
  }

  // Rank s's chunks and which of their layers recompute (as ParallelModel plans it).
  RankView View(int s) const {
    RankView view;
    const int V = plan_.pp() * plan_.virtual_stages();
    for (int c = 0; c < plan_.virtual_stages(); ++c) {
      const int v = c * plan_.pp() + s;
      const int64_t first = bounds_[v], end = bounds_[v + 1];
      std::vector<std::string> names;
      for (int64_t i = first; i < end; ++i) names.push_back(profile_->layers(i).name());
      std::vector<bool> recomputed =
          RecomputedLayers(plan_.recompute(), v, V, names, schedule_->RecomputesOnLastStage());
      view.chunks.emplace_back(first, end);
      view.recomputed.push_back(recomputed);
    }
    return view;
  }

  const ModelProfile* profile_;
  ParallelPlan plan_;
  PrecisionPolicy precision_;
  std::vector<LayerCost> layers_;
  std::vector<int64_t> bounds_;
  std::unique_ptr<PipelineSchedule> schedule_;
  std::vector<RankView> ranks_;
};

// The bucket layout ZeroOptimizer builds on rank `s` (as ParallelModel feeds it).
absl::StatusOr<ZeroLayout> ZeroLayoutOf(const PlanCosts& costs, int s, std::vector<ZeroParameter>* planned) {
  const ParallelPlan& plan = costs.plan();
  std::set<std::string> elsewhere;  // names other pipeline ranks hold: tied
  for (int other = 0; other < plan.pp(); ++other) {
    if (other == s) continue;
    for (const ProfiledParameter* p : costs.Parameters(other)) elsewhere.insert(p->name());
  }
  std::map<std::string, int> index_of;
  std::vector<std::string> names;
  std::vector<int64_t> numels;
  for (int group : {0, 1}) {  // weight-decay group (matrices) first
    for (const ProfiledParameter* p : costs.Parameters(s)) {
      if ((p->dim() >= 2 ? 0 : 1) != group) continue;
      index_of[p->name()] = static_cast<int>(planned->size());
      names.push_back(p->name());
      numels.push_back(p->numel());
      planned->push_back(
          {p->numel(), costs.ElementSize(*p), group,
           plan.zero().stage() == 1 || elsewhere.count(p->name()) > 0 || ZeroKeepsWhole(plan.zero(), p->name())});
    }
  }
  std::vector<std::pair<int64_t, std::vector<int>>> layer_reads;
  if (plan.zero().stage() == 3) {
    for (const auto& [first, end] : costs.rank(s).chunks) {
      for (int64_t i = first; i < end; ++i) {
        layer_reads.emplace_back(i, std::vector<int>());
        for (const ProfiledParameter& p : costs.layer(i).shard->parameters()) {
          layer_reads.back().second.push_back(index_of.at(p.name()));
        }
      }
    }
  }
  TRIDENT_ASSIGN_OR_RETURN(const int shard_group_size, ZeroShardGroupSize(plan.zero(), plan.dp()));
  return PlanZeroBuckets(*planned, plan.zero().stage(), ZeroBucketBytes(plan.zero()), shard_group_size,
                         PlanGatherUnits(plan.zero(), layer_reads, names, numels).reads);
}

// The most bytes rank `s` holds for backward at once, walking its schedule:
// a forward adds its chunk's activations, a backward (the weight half, when
// split) releases them; a backward's scratch comes on top while it runs.
double PeakActivations(const PlanCosts& costs, int s) {
  const ParallelPlan& plan = costs.plan();
  const size_t chunks = costs.rank(s).chunks.size();
  std::vector<double> kept(chunks), scratch(chunks), split_held(chunks);
  for (size_t c = 0; c < chunks; ++c) {
    kept[c] = costs.Kept(s, c);
    scratch[c] = costs.Scratch(s, c);
    split_held[c] = costs.SplitHeld(s, c);
  }
  double held = 0, peak = 0;
  for (const Instruction& inst :
       costs.schedule().Instructions(s, plan.pp(), static_cast<int>(plan.num_micro_batches()))) {
    const size_t c = static_cast<size_t>(inst.chunk);
    switch (inst.op) {
      case Op::kForward:
        held += kept[c];
        peak = std::max(peak, held);
        break;
      case Op::kBackward:
      case Op::kBackwardInput:
        peak = std::max(peak, held + scratch[c]);
        if (inst.op == Op::kBackward) held -= kept[c];
        if (inst.op == Op::kBackwardInput) held += split_held[c];
        peak = std::max(peak, held);
        break;
      case Op::kBackwardWeight:
        held -= kept[c] + split_held[c];
        break;
      default:
        break;
    }
  }
  return peak;
}

// Reading `read` and writing `written` bytes of offload files, at the
// profile's measured bandwidth (free where it was not measured).
double DiskSeconds(const ModelProfile& profile, double read, double written) {
  double seconds = 0;
  if (profile.disk_read_bytes_per_second() > 0) seconds += read / profile.disk_read_bytes_per_second();
  if (profile.disk_write_bytes_per_second() > 0) seconds += written / profile.disk_write_bytes_per_second();
  return seconds;
}

// Layers were timed with every rank of a node busy at once. Where a node has
// more ranks than cores, ranks share the cores only while they are busy
// together: a pipeline's ranks, idle in its bubbles, run faster than profiled.
// The factor scales the pipeline by the share of a core the ranks busy on
// average get, against the share they had when profiled (the profiler
// starts every timed run on all ranks at once).
double OversubscriptionFactor(const ModelProfile& profile, const ParallelPlan& plan, double bubble_fraction) {
  const double ranks = profile.ranks_per_node(), cores = profile.cores_per_node();
  if (plan.device() != ParallelPlan::cpu || cores <= 0 || ranks <= cores) return 1;
  const double busy = ranks * (1 - bubble_fraction);
  return std::max(1.0, busy / cores) / (ranks / cores);
}

}  // namespace

absl::StatusOr<std::vector<int64_t>> StageBoundaries(const ModelProfile& profile, const ParallelPlan& plan) {
  std::vector<LayerProfile> units;
  for (const ProfiledLayer& layer : profile.layers()) {
    TRIDENT_ASSIGN_OR_RETURN(const LayerShard* shard,
                             ShardFor(layer, plan.tp(), plan.tensor_parallel().sequence_parallel()));
    LayerProfile unit;
    unit.name = layer.name();
    int64_t matrix_scalars = 0;
    for (const ProfiledParameter& p : shard->parameters()) {
      unit.parameter_names.push_back(p.name());
      unit.parameters += p.numel();
      unit.parameter_bytes += p.numel() * p.element_size();
      if (p.dim() >= 2) matrix_scalars += p.numel();
    }
    unit.forward_flops = layer.has_partition_flops()
                             ? layer.partition_flops()
                             : 2.0 * static_cast<double>(layer.rows_per_sample()) * static_cast<double>(matrix_scalars);
    units.push_back(std::move(unit));
  }
  PartitionOptions options;
  options.num_stages = plan.pp() * plan.virtual_stages();
  options.partition_method = plan.pipeline().partition_method();
  options.custom_split_points.assign(plan.pipeline().custom_split_points().begin(),
                                     plan.pipeline().custom_split_points().end());
  TRIDENT_ASSIGN_OR_RETURN(Plan stages, PlanStages(units, options));
  return std::vector<int64_t>(stages.boundaries().begin(), stages.boundaries().end());
}

absl::StatusOr<MemoryPrediction> PredictMemory(const ModelProfile& profile, const ParallelPlan& plan) {
  TRIDENT_ASSIGN_OR_RETURN(PlanCosts costs, PlanCosts::Make(profile, plan));
  MemoryPrediction prediction;
  const int state_per_element = profile.optimizer_state_per_element();
  for (int s = 0; s < plan.pp(); ++s) {
    MemoryReport state;
    int64_t transient = 0;
    const int64_t activations = static_cast<int64_t>(PeakActivations(costs, s));
    const int64_t parameter_bytes = costs.ParameterBytes(s);
    if (plan.zero().stage() == 0) {
      state.parameter_bytes = state.gradient_bytes = parameter_bytes;
      state.optimizer_bytes = state_per_element * parameter_bytes;  // gradients live in the reducer's buckets
    } else {
      std::vector<ZeroParameter> planned;
      TRIDENT_ASSIGN_OR_RETURN(ZeroLayout layout, ZeroLayoutOf(costs, s, &planned));
      TRIDENT_ASSIGN_OR_RETURN(const int shard_group_size, ZeroShardGroupSize(plan.zero(), plan.dp()));
      state = ZeroLayoutMemory(layout, shard_group_size, state_per_element);
      int64_t largest_unit = 0, largest_bucket = 0;  // a unit's buckets; one bucket
      for (const auto& [layer, buckets] : layout.layer_buckets) {
        int64_t bytes = 0;
        for (int b : buckets) bytes += layout.buckets[b].numel * layout.buckets[b].element_size;
        largest_unit = std::max(largest_unit, bytes);
      }
      for (const ZeroBucket& b : layout.buckets) largest_bucket = std::max(largest_bucket, b.numel * b.element_size);
      const int64_t largest = std::max(largest_unit, largest_bucket);
      if (plan.zero().offload_optimizer() == ZeroSpec::disk) {
        // In its file; in memory the state of the bucket updated, the next
        // read and the last written.
        state.offloaded_optimizer_bytes = std::exchange(state.optimizer_bytes, 0);
        transient += std::min<int64_t>(state.offloaded_optimizer_bytes,
                                       3 * state_per_element * largest / std::max(1, shard_group_size));
      }
      if (plan.zero().stage() == 3 && plan.zero().offload_params() == ZeroSpec::disk) {
        // The sharded chunks in their file; in memory those of the layers
        // gathered and the one read ahead.
        int64_t sharded = 0;
        for (const ZeroBucket& b : layout.buckets) {
          if (b.sharded) sharded += b.numel / shard_group_size * b.element_size;
        }
        state.offloaded_parameter_bytes = sharded;
        state.parameter_bytes -= sharded;
        transient += std::min<int64_t>(sharded, (2 + ZeroPrefetchDepth(plan.zero())) * largest / shard_group_size);
      }
      if (plan.zero().stage() == 3) {
        // Backward: the bucket read and those prefetched gathered, and
        // max_inflight_reduce_scatters whole gradients (the one being made
        // counts). Forward: the units running and prefetched, before any
        // chunk gradient exists. With one micro-batch the chunk gradients
        // are made as backward frees the activations (Step frees them
        // again), so the peak is the end of forward (activations, no chunk
        // gradients) or of backward (the gradients, no activations); with
        // more, later micro-batches run beside the gradients of the first.
        const int depth = ZeroPrefetchDepth(plan.zero());
        const int64_t backward = (1 + depth + plan.zero().max_inflight_reduce_scatters()) * largest_bucket;
        const int64_t forward = (1 + depth) * largest_unit;
        transient += plan.num_micro_batches() == 1
                         ? std::max(backward, forward + activations - state.gradient_bytes) - activations
                         : std::max(backward, forward);
      } else {  // the step's all-gather
        transient += std::min(plan.zero().allgather_bucket_bytes(), parameter_bytes);
      }
    }
    prediction.state.push_back(state);
    prediction.activations.push_back(activations);
    prediction.transient.push_back(transient);
    prediction.tensor_peak.push_back(state.total() + activations + transient);
    prediction.max_tensor_peak = std::max(prediction.max_tensor_peak, prediction.tensor_peak.back());
    // ZeRO-3 builds the stage unsharded and copies it into its buckets
    // before sharding, unless the model draws its values layer by layer;
    // the allocator keeps what that freed (measured on gpt2-124m dp2: 600 MB
    // more resident than plain dp once built).
    const int64_t retained = plan.zero().stage() == 3 && !profile.builds_deferred() ? 2 * parameter_bytes : 0;
    // The process holds more than its tensors' bytes: the allocator's free
    // lists and fragmentation (measured resident over predicted tensor bytes
    // on gpt2-124m, 2 ranks: 1.07 at dp2, 1.17 at pp2, 1.18 at tp2). ZeRO-3's
    // state is flat chunks, each one allocation of its exact size: resident
    // as it is (llama-1b at dp4: 4,070 MiB predicted, 4,041-4,081 measured).
    constexpr double kAllocatorOverhead = 1.2;
    const int64_t exact = plan.zero().stage() == 3 ? state.total() : 0;
    const double rest = static_cast<double>(prediction.tensor_peak.back() + retained - exact);
    prediction.max_resident =
        std::max(prediction.max_resident, exact + static_cast<int64_t>(kAllocatorOverhead * rest));
  }
  prediction.max_resident += profile.baseline_rss_bytes();
  return prediction;
}

absl::StatusOr<TimePrediction> PredictStepTime(const ModelProfile& profile, const ParallelPlan& plan) {
  TRIDENT_ASSIGN_OR_RETURN(PlanCosts costs, PlanCosts::Make(profile, plan));
  const int S = plan.pp(), dp = plan.dp();
  SimulationOptions sim;
  sim.num_stages = S;
  sim.num_micro_batches = static_cast<int>(plan.num_micro_batches());
  sim.forward_seconds.clear();
  sim.backward_seconds.clear();
  sim.recompute_seconds.clear();
  std::vector<double> after(S, 0), optimizer(S, 0);
  double message_bytes = 0;
  for (int s = 0; s < S; ++s) {
    double forward = costs.Forward(s), backward = costs.Backward(s);
    const int64_t parameter_bytes = costs.ParameterBytes(s);
    if (plan.zero().stage() > 0) {
      std::vector<ZeroParameter> planned;
      TRIDENT_ASSIGN_OR_RETURN(ZeroLayout layout, ZeroLayoutOf(costs, s, &planned));
      TRIDENT_ASSIGN_OR_RETURN(const int shard_group_size, ZeroShardGroupSize(plan.zero(), dp));
      // Offload files: a sharded chunk is read for forward, for backward and
      // for the update, and written after it; the state is read and written
      // around the update (on an I/O thread, beside it).
      const bool params_on_disk = plan.zero().stage() == 3 && plan.zero().offload_params() == ZeroSpec::disk;
      double update_read_bytes = 0, update_written_bytes = 0;
      for (const ZeroBucket& bucket : layout.buckets) {
        const double bytes = static_cast<double>(bucket.numel * bucket.element_size), chunk = bytes / shard_group_size;
        if (bucket.sharded) {  // stage 3: gathered for forward and for backward
          forward += CollectiveSeconds(profile, "all_gather", dp, bytes);
          backward += CollectiveSeconds(profile, "all_gather", dp, bytes);
        }
        if (bucket.sharded && params_on_disk) {
          forward += DiskSeconds(profile, chunk, 0);
          backward += DiskSeconds(profile, chunk, 0);
          update_read_bytes += chunk;
          update_written_bytes += chunk;
        }
        if (plan.zero().offload_optimizer() == ZeroSpec::disk) {
          update_read_bytes += profile.optimizer_state_per_element() * chunk;
          update_written_bytes += profile.optimizer_state_per_element() * chunk;
        }
        if (bucket.keep_full) {
          after[s] += CollectiveSeconds(profile, "reduce_scatter", dp, bytes);
        } else {  // reduced as each micro-batch's backward fills it
          backward += CollectiveSeconds(profile, "reduce_scatter", dp, bytes);
        }
        if (!bucket.sharded) after[s] += CollectiveSeconds(profile, "all_gather", dp, bytes);
      }
      optimizer[s] =
          std::max(profile.optimizer_seconds_per_element() * static_cast<double>(costs.ParameterCount(s)) / dp,
                   DiskSeconds(profile, update_read_bytes, update_written_bytes));
    } else {
      for (int64_t left = parameter_bytes; left > 0; left -= plan.zero().bucket_bytes()) {
        after[s] += CollectiveSeconds(profile, "all_reduce", dp,
                                      static_cast<double>(std::min(left, plan.zero().bucket_bytes())));
      }
      optimizer[s] = profile.optimizer_seconds_per_element() * static_cast<double>(costs.ParameterCount(s));
    }
    if (plan.tensor_parallel().sequence_parallel()) {
      after[s] += CollectiveSeconds(profile, "all_reduce", plan.tp(), static_cast<double>(costs.ReplicatedBytes(s)));
    }
    sim.forward_seconds.push_back(forward);
    sim.backward_seconds.push_back(backward);
    sim.recompute_seconds.push_back(costs.Recompute(s));
    for (const auto& [first, end] : costs.rank(s).chunks) {
      if (end < profile.layers_size()) message_bytes = std::max(message_bytes, costs.layer(end - 1).output);
    }
  }
  sim.comm_seconds = CollectiveSeconds(profile, "send_recv", 2, message_bytes);
  TRIDENT_ASSIGN_OR_RETURN(SimulationResult pipeline, Simulate(costs.schedule(), sim));
  TimePrediction prediction;
  prediction.pipeline_seconds = pipeline.makespan * OversubscriptionFactor(profile, plan, pipeline.bubble_fraction);
  prediction.message_seconds = sim.comm_seconds;
  for (int s = 0; s < S; ++s) {
    const double rank_compute = sim.num_micro_batches * (sim.forward_seconds[s] + sim.backward_seconds[s]);
    prediction.compute_seconds = std::max(prediction.compute_seconds, rank_compute);
    prediction.reduction_seconds = std::max(prediction.reduction_seconds, after[s]);
    prediction.optimizer_seconds = std::max(prediction.optimizer_seconds, optimizer[s]);
  }
  prediction.step_seconds = prediction.pipeline_seconds + prediction.reduction_seconds + prediction.optimizer_seconds;
  return prediction;
}

}  // namespace internal
}  // namespace trident
