#include "parallel/parameter_update.h"

#include <cmath>
#include <unordered_set>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "absl/strings/str_cat.h"
#include "base/host_copy.h"
#include "base/status.h"
#include "parallel/gradient_reducer.h"
#include "parallel/optimizer.h"
#include "tensor_parallel/tensor_parallel.h"

namespace trident {
namespace {

int64_t Bytes(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

// The gradients `parameters` hold (backward may not have reached them all).
std::vector<at::Tensor> DefinedGrads(const std::vector<at::Tensor>& parameters) {
  std::vector<at::Tensor> grads;
  for (const at::Tensor& p : parameters) {
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  return grads;
}

// Group 0: the parameters weight decay applies to (matrices); group 1: the others.
std::vector<std::vector<at::Tensor>> DecayGroups(const NamedTensors& parameters) {
  std::vector<std::vector<at::Tensor>> groups(2);
  for (const auto& [name, p] : parameters) groups[p.dim() >= 2 ? 0 : 1].push_back(p);
  return groups;
}

class PlainDataParallel : public ParameterUpdate {
 public:
  static absl::StatusOr<std::unique_ptr<ParameterUpdate>> Create(ParameterUpdateOptions o) {
    std::unique_ptr<PlainDataParallel> plain(new PlainDataParallel());
    plain->options_ = std::move(o);
    for (const auto& [name, p] : plain->options_.parameters) plain->list_.push_back(p);
    plain->reducer_ = std::make_unique<GradientReducer>(plain->options_.parameters, plain->options_.data_parallel,
                                                        plain->options_.zero.bucket_bytes(),
                                                        plain->options_.zero.gradient_predivide_factor());
    TRIDENT_RETURN_IF_ERROR(CatchExceptions("building the optimizer", [&] {
      plain->optimizer_ = plain->options_.make_optimizer(DecayGroups(plain->options_.parameters));
    }));
    return std::unique_ptr<ParameterUpdate>(std::move(plain));
  }
  void ZeroGrad() override { reducer_->ZeroGrad(); }
  void PrepareForBackward(bool last) override { reducer_->PrepareForBackward(last); }
  absl::Status FinishBackward() override { return reducer_->FinishBackward(); }
  bool LocalGradientsNonFinite() const override {
    for (const at::Tensor& p : list_) {
      if (p.grad().defined() && !at::isfinite(p.grad()).all().item<bool>()) return true;
    }
    return false;
  }
  void ScaleGradients(double factor) override {
    std::vector<at::Tensor> grads = DefinedGrads(list_);  // one multi-tensor kernel, not one per parameter
    if (!grads.empty()) at::_foreach_mul_(grads, factor);
  }
  void ScaleGradients(const at::Tensor& factor) override { MultiplyWithoutReading(DefinedGrads(list_), factor); }
  at::Tensor LocalSquaredGradNorm() const override {
    const std::vector<at::Tensor> grads = DefinedGrads(options_.counted);
    if (grads.empty()) return at::zeros({1}, at::kDouble);
    c10::NoGradGuard no_grad;
    return at::stack(at::_foreach_norm(grads)).to(at::kDouble).pow(2).sum().reshape({1});
  }
  const ProcessGroup* NormGroup() const override { return options_.norm_group; }
  absl::Status SumOverTensorParallel(const std::vector<at::Tensor>& parameters) override {
    if (options_.tensor_parallel == nullptr) return absl::OkStatus();
    return SequenceParallelGradients(parameters, options_.tensor_parallel->name());
  }
  absl::Status Step(double lr) override {
    return CatchExceptions("the optimizer step", [&] {
      SetLearningRate(*optimizer_, lr);
      optimizer_->step();
    });
  }
  NamedTensors State() const override { return SerializeOptimizer(*optimizer_, "optimizer"); }
  absl::Status LoadState(const NamedTensors& state) override {
    return DeserializeOptimizer(state, "optimizer", *optimizer_);
  }
  absl::StatusOr<std::vector<ParameterPart>> Parts() const override {
    std::vector<ParameterPart> parts;
    for (const at::Tensor& p : list_) parts.push_back({p, p.sizes().vec(), 0, p.numel(), p, 0, false, p});
    return parts;
  }
  torch::optim::Optimizer& optimizer() override { return *optimizer_; }
  MemoryReport Memory() const override {
    MemoryReport report;
    for (const at::Tensor& p : list_) {
      report.parameter_bytes += Bytes(p);
      report.gradient_bytes += Bytes(p);
    }
    report.optimizer_bytes = OptimizerStateBytes(*optimizer_, report.parameter_bytes);
    return report;
  }

 private:
  PlainDataParallel() = default;
  ParameterUpdateOptions options_;
  std::vector<at::Tensor> list_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  std::unique_ptr<GradientReducer> reducer_;
};

class Zero : public ParameterUpdate {
 public:
  static absl::StatusOr<std::unique_ptr<ParameterUpdate>> Create(ParameterUpdateOptions o) {
    std::unique_ptr<Zero> zero(new Zero());
    zero->options_ = std::move(o);
    const ParameterUpdateOptions& options = zero->options_;
    std::unordered_set<const c10::TensorImpl*> counted, keep;
    for (const at::Tensor& p : options.counted) counted.insert(p.unsafeGetTensorImpl());
    for (const at::Tensor& p : options.keep_full_gradient) keep.insert(p.unsafeGetTensorImpl());
    for (const auto& [name, p] : options.parameters) {
      if (ZeroKeepsWhole(options.zero, name)) keep.insert(p.unsafeGetTensorImpl());
    }
    ZeroOptions zero_options;
    zero_options.spec = options.zero;
    zero_options.layers = options.layers;
    zero_options.layer_indices = options.layer_indices;
    zero_options.replicas = options.zero_replicas;
    zero_options.rank = options.world != nullptr ? options.world->rank() : 0;
    zero_options.keep_full_gradient = [keep](const at::Tensor& p) { return keep.count(p.unsafeGetTensorImpl()) > 0; };
    zero_options.counted_in_norm = [counted](const at::Tensor& p) {
      return counted.count(p.unsafeGetTensorImpl()) > 0;
    };
    const ProcessGroup* shards = options.zero_shards != nullptr ? options.zero_shards : options.data_parallel;
    TRIDENT_ASSIGN_OR_RETURN(zero->zero_, ZeroOptimizer::Create(DecayGroups(options.parameters), shards, zero_options,
                                                                options.make_optimizer));
    return std::unique_ptr<ParameterUpdate>(std::move(zero));
  }
  void ZeroGrad() override { zero_->ZeroGrad(); }
  void PrepareForBackward(bool last) override { zero_->PrepareForBackward(last); }
  absl::Status FinishBackward() override { return zero_->FinishBackward(); }
  bool LocalGradientsNonFinite() const override { return zero_->LocalGradientsNonFinite(); }
  void ScaleGradients(double factor) override { zero_->ScaleGradients(factor); }
  void ScaleGradients(const at::Tensor& factor) override { zero_->ScaleGradients(factor); }
  absl::Status SumOverTensorParallel(const std::vector<at::Tensor>& parameters) override {
    if (options_.tensor_parallel == nullptr) return absl::OkStatus();
    return zero_->SumGradientsOver(*options_.tensor_parallel, parameters);
  }
  at::Tensor LocalSquaredGradNorm() const override { return zero_->LocalSquaredGradNorm(); }
  // Each rank holds its chunk of every gradient: the sum runs over all ranks.
  const ProcessGroup* NormGroup() const override { return options_.world; }
  absl::Status Step(double lr) override { return zero_->Step(lr); }
  NamedTensors State() const override { return zero_->State(); }
  absl::Status LoadState(const NamedTensors& state) override { return zero_->LoadState(state); }
  MemoryReport Memory() const override { return zero_->Memory(); }
  absl::StatusOr<std::vector<ParameterPart>> Parts() const override { return zero_->ChunkParts(); }
  torch::optim::Optimizer& optimizer() override { return zero_->optimizer(); }
  absl::StatusOr<std::map<std::string, at::Tensor>> OptimizerStateOf(const at::Tensor& updated) override {
    return zero_->ChunkState(updated);
  }
  absl::Status SetOptimizerStateOf(const at::Tensor& updated, const std::map<std::string, at::Tensor>& state) override {
    return zero_->SetChunkState(updated, state);
  }
  absl::Status GatherFullParameters() override { return zero_->GatherAllParameters(); }
  absl::Status WaitForUpdatedParameters() override { return zero_->WaitForUpdatedParameters(); }
  absl::Status ReleaseFullParameters(bool keep_changes) override { return zero_->ReleaseAllParameters(keep_changes); }

 private:
  Zero() = default;
  ParameterUpdateOptions options_;
  std::unique_ptr<ZeroOptimizer> zero_;
};

}  // namespace

absl::StatusOr<PendingScalar> ParameterUpdate::ClipGradNorm(double max_norm) {
  at::Tensor squares = LocalSquaredGradNorm();
  const ProcessGroup* group = NormGroup();
  if (group != nullptr && group->size() > 1) TRIDENT_RETURN_IF_ERROR(group->AllReduce(squares));
  if (squares.is_cpu()) {
    const double norm = std::sqrt(squares.item<double>());
    if (max_norm > 0 && norm > max_norm) ScaleGradients(max_norm / (norm + 1e-6));
    return PendingScalar(at::full({1}, norm, at::kDouble));
  }
  // On a device the clipping factor is computed there as on the host (in
  // double; 1 where the norm is within max_norm), so nothing waits for the GPU.
  const at::Tensor norm = squares.sqrt();
  if (max_norm > 0) {
    ScaleGradients(at::where(norm > max_norm, at::full_like(norm, max_norm).div(norm + 1e-6), at::ones_like(norm)));
  }
  return PendingScalar(norm);
}

absl::StatusOr<std::unique_ptr<ParameterUpdate>> MakeParameterUpdate(ParameterUpdateOptions options) {
  if (!options.make_optimizer) {
    return absl::InvalidArgumentError("no optimizer factory given (see parallel/optimizer.h)");
  }
  if (options.zero.stage() == 0) return PlainDataParallel::Create(std::move(options));
  if (options.data_parallel == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("zero_stage=", options.zero.stage(),
                                                   " shards over the data-parallel group, and this run has "
                                                   "none (dp=1); use zero_stage=0 or dp > 1"));
  }
  return Zero::Create(std::move(options));
}

}  // namespace trident
