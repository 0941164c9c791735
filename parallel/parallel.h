// parallel: Parallelize(model source, plan, topology, example batch) -> ParallelModel,
// this rank's part of any model, ready to step.
//
// A model source is a LayerSequence (the zoo, or a user's layers, built whole
// or one pipeline stage at a time), any torch::nn::Module with a forward
// (traced into a ModelGraph), or a TorchScript file saved from Python. The
// plan says how to lay it out: dp x tp x pp, virtual stages and schedule, how
// to split and partition it, recomputation, ZeRO, precision and device.
// Traced models are cut into shards (farthest_min_deps / nearest_min_deps)
// that run as a LayerSequence, so every layout works the same for both; stage
// boundaries carry whatever tensors cross them (skip connections, masks,
// position ids), and each stage reads only the batch fields it needs.
//
//   ParallelPlan plan;
//   plan.set_dp(2);
//   plan.set_pp(2);
//   plan.set_micro_batch_size(4);
//   plan.set_num_micro_batches(4);
//   TRIDENT_ASSIGN_OR_RETURN(OptimizerFactory adamw, MakeOptimizerFactory("adamw", {}));
//   TRIDENT_ASSIGN_OR_RETURN(auto model, Parallelize(ModelSource::FromModule(net, forward),
//                                                    plan, topology.get(), example, adamw));
//   model->ZeroGrad();
//   TRIDENT_ASSIGN_OR_RETURN(double loss, model->ForwardBackward(micro_batches));
//   TRIDENT_ASSIGN_OR_RETURN(double norm, model->ClipGradNorm(1.0));
//   TRIDENT_RETURN_IF_ERROR(model->Step(/*lr=*/1e-3));
//
// The loss is the model's own (a forward returning the loss, or a tuple whose
// first scalar is the loss: nnScaler's end-to-end convention) or a
// LossFunction given with the source (ATorch's loss_func(input, output)).
#ifndef TRIDENT_PARALLEL_PARALLEL_H_
#define TRIDENT_PARALLEL_PARALLEL_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "amp/amp.h"
#include "base/host_copy.h"
#include "base/registry.h"
#include "base/tensors.h"
#include "base/text_proto.h"  // SetStrings and ParseEnum for the plan's fields
#include "checkpoint/checkpoint.h"
#include "graph/graph.h"
#include "lora/lora.h"
#include "parallel/optimizer.h"
#include "parallel/plan.pb.h"
#include "pipeline/pipeline.h"
#include "tensor_parallel/tensor_parallel.h"
#include "topology/topology.h"
#include "zero/zero.h"
#include "zero/zero.pb.h"

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace trident {

// The scalar loss of a micro-batch from the model's outputs (ATorch's
// loss_func(input, output)).
using LossFunction = std::function<at::Tensor(const Batch& batch, const Values& outputs)>;
// Built-ins: "cross_entropy" (outputs[0] logits [..., C] against the class ids
// in the batch's last field, mean over all positions; ids below 0 are
// ignored) and "mse" (outputs[0] against the last field, mean). Users register
// their own.
Registry<LossFunction>& LossRegistry();

// Where the model comes from.
struct ModelSource {
  enum class Kind { kLayers, kModule, kTorchScript };
  Kind kind = Kind::kLayers;

  // kLayers: `num_layers` layers; `build` makes a part holding (at least) the
  // layers in `ranges`, with the same weights whichever part is built (so each
  // pipeline rank builds only its own stage), or the whole model for empty
  // ranges. `build` may be called more than once.
  int64_t num_layers = 0;
  std::function<absl::StatusOr<std::shared_ptr<LayerSequence>>(const LayerRanges& ranges)> build;
  // Optional, kLayers: `build` with the parameters' memory reserved but not
  // written, their values drawn by the part's MaterializeLayer. ZeRO stage 3
  // on CPU builds with it: each layer's values are drawn, sliced to this
  // rank's chunk and freed before the next, so no rank holds the whole model.
  std::function<absl::StatusOr<std::shared_ptr<LayerSequence>>(const LayerRanges& ranges)> build_deferred;

  // kModule: a module and its forward over the batch fields it is given (see
  // plan.trace().input_names); traced with the JIT tracer, or run eagerly as
  // one layer with trace_method "none".
  std::shared_ptr<torch::nn::Module> module;
  std::function<Values(const Values& inputs)> forward;

  // kTorchScript: a file saved with torch.jit.save; forward(inputs...) is
  // called with the batch fields, in order (or as input_names select them).
  std::string torchscript_path;

  // The loss from (batch, outputs) when the model does not compute its own.
  LossFunction loss;
  // Tensor-parallel parameters of a built part, by name, and how each is a
  // slice of the single-process parameter (unset: every parameter replicated).
  std::function<std::map<std::string, ShardSpec>(LayerSequence& part)> shards;
  // Second names of stored parameters (GPT's "lm_head.weight" ->
  // "transformer.wte.weight"), written by exports and read by LoadWeights.
  std::map<std::string, std::string> aliases;
  // Training FLOPs (forward and backward) of one sample given the model's
  // parameter count. Unset: 6 per parameter per element of the first batch
  // field (a token), or the traced graph's own count.
  std::function<double(int64_t parameters)> flops_per_sample;
  // Token models: the longest sequence and the vocabulary (what token data
  // must match), and whether outputs[0] of the last layer are next-token
  // logits [B, T, vocab / tp] (so text can be sampled).
  int64_t sequence_length = 0;
  int64_t vocab_size = 0;
  bool returns_logits = false;

  static ModelSource FromLayers(std::shared_ptr<LayerSequence> layers);
  static ModelSource FromLayerBuilder(
      int64_t num_layers, std::function<absl::StatusOr<std::shared_ptr<LayerSequence>>(const LayerRanges&)> build);
  static ModelSource FromModule(std::shared_ptr<torch::nn::Module> module,
                                std::function<Values(const Values&)> forward);
  static ModelSource FromTorchScript(std::string path);
};

// ParallelPlan, how to lay a model out, is a message of parallel/plan.proto.

// The topology mesh of `plan`: its three axes with their sizes in
// plan.axis_order() (TopologyOptions::mesh_axes or Topology::Reshape, with
// plan.rank_order()).
std::vector<MeshAxis> PlanMeshAxes(const ParallelPlan& plan);

// Which layers of virtual stage v (of V, the last being V - 1) recompute their
// forward in backward under `recompute`, one flag per name in `layer_names`:
// every one (full), those its layers name or prefix (selected), stage_aware's
// share of the first ones, none for "none" or on the last stage unless
// `last_stage_recomputes` (the schedule's RecomputesOnLastStage). Parallelize
// and the strategy's cost model both plan recomputation with it.
std::vector<bool> RecomputedLayers(const RecomputeSpec& recompute, int v, int V,
                                   const std::vector<std::string>& layer_names, bool last_stage_recomputes);

// Checks `plan` alone (before any rank starts): sizes, names, pairs that do not
// go together. Parallelize checks it again with the model.
absl::Status ValidatePlan(const ParallelPlan& plan);

// Checks `source` against `plan` without building anything (before any rank
// starts): cuts that the source cannot take, too few layers for the stages,
// tensor parallelism on traced models, a missing TorchScript file.
absl::Status CheckSource(const ModelSource& source, const ParallelPlan& plan);

// The layers Parallelize runs `source` as under `plan`, whole: a layer source
// as it is; a module with trace_method "layers" as its LayerSequence; a
// traced source (trace_method "jit") as its graph's shards, traced on
// `example` (one micro-batch, on the CPU) and cut by plan's split_method,
// shard_count and leaf_modules, its loss inside (the first scalar of the last
// shard's outputs). `forward_flops` holds each traced shard's forward FLOPs
// on `example` (what the "cost" partition weighs it by); it is empty for
// layer sources. The automatic strategy search profiles models through it.
struct SourceLayers {
  ModelSource layers;  // kind kLayers
  std::vector<double> forward_flops;
  // A TorchScript file loaded without its parameter values (read layer by
  // layer by the ranks that keep them, as a layer source's build_deferred
  // draws them): Parallelize never holds the whole model under this plan.
  bool values_deferred = false;
};
absl::StatusOr<SourceLayers> LayersOf(const ModelSource& source, const ParallelPlan& plan, const Batch& example);

class ParallelModel;

// Builds this rank's part of `source` under `plan` on `topology` (whose axes
// "data", "tensor" and "pipeline" must have the plan's sizes; missing axes
// count as size 1). `example` is one micro-batch (shapes as in training): it
// traces graphs and finds the stage boundaries' shapes. `make_optimizer`
// builds the optimizer over this rank's parameters (or ZeRO's chunks). Every
// rank calls it; an error on one rank reaches all. It changes nothing
// process-wide: a program that wants the fastest fp32 CPU products calls
// UseBestCpuKernels (kernels/kernels.h) once first, as `train` does.
absl::StatusOr<std::unique_ptr<ParallelModel>> Parallelize(ModelSource source, ParallelPlan plan, Topology* topology,
                                                           const Batch& example, OptimizerFactory make_optimizer);

class ParallelModel {
 public:
  ~ParallelModel();

  // One training step's forward and backward over this rank's micro-batches
  // (plan.num_micro_batches() of them; empty batches where ReadsData() is
  // false), with every gradient reduction (data-parallel, sequence-parallel,
  // tied between stages) done. Returns the loss over the global batch (per
  // plan.reduction().loss()), the same on every rank.
  absl::StatusOr<double> ForwardBackward(const std::vector<Batch>& micro_batches);
  // The same, with the loss read when the caller asks: on GPUs with data or
  // pipeline parallelism the loss is reduced there, behind the backward, so
  // a loop that reads it after queuing Step keeps the GPU busy meanwhile.
  absl::StatusOr<PendingScalar> ForwardBackwardWithoutWaiting(const std::vector<Batch>& micro_batches);
  void ZeroGrad();
  // With loss scaling: removes the scale from the gradients and updates the
  // scaler. Returns true (the step must be skipped, the scale lowered) when
  // some rank's gradients hold inf or NaN; every rank gets the same answer.
  absl::StatusOr<bool> UnscaleGradients();
  // The global gradient norm (each stored value counted once), clipping to
  // `max_norm` when it is positive and exceeded.
  absl::StatusOr<double> ClipGradNorm(double max_norm);
  // The same, with the norm read when the caller asks: on a GPU the norm and
  // the clipping are queued there, so a loop that reads the norm after
  // queuing Step does not leave the GPU idle while it queues the update.
  absl::StatusOr<PendingScalar> ClipGradNormWithoutWaiting(double max_norm);
  absl::Status Step(double lr);

  // Forward only: the loss over the global batch (mean), the same on every rank.
  absl::StatusOr<double> EvaluateLoss(const std::vector<Batch>& micro_batches);
  // Forward only through every stage, shapes free (sampling): the last
  // layer's outputs on the rank of the last stage, nothing elsewhere.
  absl::StatusOr<Values> Forward(const Batch& batch);
  // Training or evaluation behaviour (dropout) of the layers that have one.
  void SetTraining(bool training);

  // Whether this rank's stages read batch fields (else pass empty batches).
  bool ReadsData() const;
  // This rank's stored parameters under their single-process names (shards
  // and stage parts of them; under ZeRO-3 empty until gathered). Under ZeRO
  // 1 and 2 it first waits for the last Step's all-gathers (which the next
  // forward's layers would finish).
  const NamedTensors& parameters() const;
  // How this rank's tensor-parallel parameters slice the full ones.
  const std::map<std::string, ShardSpec>& shard_specs() const;
  // Gives ZeRO-3's sharded parameters their full values (to save, load or
  // export) and shards them again (`keep_changes` keeps what was written).
  absl::Status GatherFullParameters();
  absl::Status ReleaseFullParameters(bool keep_changes);
  // Copies weights by single-process name (or alias), slicing full tensors to
  // this rank's shards. Errors name a missing or mis-shaped tensor.
  absl::Status LoadWeights(const SafetensorsContents& weights);
  // The whole single-process model (shards joined, stages merged through the
  // process groups, aliases included) on global rank 0; empty elsewhere. Every
  // rank calls it.
  absl::StatusOr<NamedTensors> FullWeights();
  // Layout-free checkpoints. This rank's parameters (and with `optimizer`
  // its optimizer and loss-scaler state) as pieces of the single-process
  // tensors, each with its slice: parameters under their names, Adam's,
  // AdamW's and SGD's state as "optimizer/<parameter>/<exp_avg|...|step>",
  // ZeRO's chunks as per-parameter parts (never whole buckets), the loss
  // scaler as "amp/...". Other optimizers' state is stored as they serialize
  // it, under a name that holds Layout(), and resumes only in that layout.
  // `deduplicate` leaves out what another rank writes identically
  // (data-parallel replicas, replicated parameters on tensor-parallel ranks
  // other than the first, tied copies on later stages).
  // Pieces are views of the model's tensors on its device (no copies): copy
  // or write them before the next step.
  absl::StatusOr<std::vector<SlicedTensor>> CheckpointPieces(bool optimizer, bool deduplicate) const;
  // Loads the slices this rank holds from a checkpoint of any layout (and
  // with `optimizer` the optimizer and loss-scaler state; parameters saved
  // before their first update get none).
  absl::Status LoadCheckpointPieces(const CheckpointReader& reader, bool optimizer);
  // "dp2_tp2sp_pp2x1_zero1": the plan's layout, for names and logs.
  std::string Layout() const;

  const ParallelPlan& plan() const;
  const ModelSource& source() const;
  Topology& topology() const;
  int stage() const;   // this rank's pipeline stage
  int stages() const;  // plan.pp()
  // Groups of this rank (nullptr where the axis has one rank).
  const ProcessGroup* data_parallel_group() const;
  const ProcessGroup* tensor_parallel_group() const;
  const ProcessGroup* pipeline_group() const;
  LayerSequence& layers();  // this rank's part
  // Parameters of the whole single-process model (tied ones once).
  int64_t num_parameters() const;
  double flops_per_sample() const;
  MemoryReport Memory() const;
  std::optional<double> loss_scale() const;
  // The stage plan (layers or shards per virtual stage), for logs.
  std::string Describe() const;
  // The pipeline instructions of the last ForwardBackward with their times.
  const std::vector<TimelineEvent>& timeline() const;

 private:
  friend absl::StatusOr<std::unique_ptr<ParallelModel>> Parallelize(ModelSource, ParallelPlan, Topology*, const Batch&,
                                                                    OptimizerFactory);
  class Impl;
  explicit ParallelModel(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Every rank's `pieces` sent through `group` (no shared filesystem) to group
// rank 0, which returns the whole tensors they make up, in the order first
// seen (rank 0's own first); other ranks get an empty list. Every rank calls it.
absl::StatusOr<NamedTensors> MergePieces(const ProcessGroup& group, const std::vector<SlicedTensor>& pieces);

// Models by name, for configs and the `train` binary. A factory gets the
// model's arguments and the parallel context (tensor-parallel place, seed)
// and returns its source; the zoo registers gpt, llama and mlp this way.
struct ModelContext {
  TensorParallelism tp;  // the shard to build (size 1: whole)
  uint64_t seed = 1;
  int64_t data_vocab_size = 0;  // of the training data, when it has a tokenizer
};
using ModelFactory = std::function<absl::StatusOr<ModelSource>(const ComponentArgs& args, const ModelContext& context)>;
Registry<ModelFactory>& ModelRegistry();

}  // namespace trident

#endif  // TRIDENT_PARALLEL_PARALLEL_H_
