#include "trainer/internal/parameter_update.h"

#include <cmath>
#include <unordered_set>

#include <ATen/ATen.h>
#include <torch/optim/adamw.h>

#include "absl/strings/str_format.h"
#include "base/status.h"
#include "tensor_parallel/tensor_parallel.h"
#include "trainer/internal/gradient_reducer.h"
#include "zero/zero.h"

namespace trident {
namespace internal {
namespace {

int64_t Bytes(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

class PlainDataParallel : public ParameterUpdate {
 public:
  explicit PlainDataParallel(ParameterUpdateOptions o)
      : options_(std::move(o)), optimizer_(options_.parameters, options_.adam) {
    for (const auto& [name, p] : options_.parameters) list_.push_back(p);
    reducer_ = std::make_unique<GradientReducer>(list_, options_.data_parallel, options_.bucket_bytes,
                                                 options_.gradient_predivide_factor);
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
    for (const at::Tensor& p : list_) {
      if (p.grad().defined()) p.grad().mul_(factor);
    }
  }
  absl::StatusOr<double> ClipGradNorm(double max_norm) override {
    return internal::ClipGradNorm(options_.counted, list_, max_norm, options_.norm_group);
  }
  absl::Status SumOverTensorParallel(const std::vector<at::Tensor>& parameters) override {
    if (options_.tensor_parallel == nullptr) return absl::OkStatus();
    return SequenceParallelGradients(parameters, "tp");
  }
  absl::Status Step(double lr) override {
    optimizer_.Step(lr);
    return absl::OkStatus();
  }
  NamedTensors State() const override { return optimizer_.State(); }
  absl::Status LoadState(const SafetensorsContents& contents) override {
    return optimizer_.LoadState(contents);
  }
  std::string MemoryReport() const override {
    int64_t bytes = 0;
    for (const at::Tensor& p : list_) bytes += Bytes(p);
    return absl::StrFormat("parameters %.1f MB, gradients %.1f MB, optimizer state %.1f MB",
                           bytes / 1e6, bytes / 1e6, 2 * bytes / 1e6);
  }

 private:
  ParameterUpdateOptions options_;
  std::vector<at::Tensor> list_;
  AdamW optimizer_;
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
    // AdamW's decoupled weight decay applies to matrices only, as in plain training.
    std::vector<std::vector<at::Tensor>> groups(2);
    for (const auto& [name, p] : options.parameters) groups[p.dim() >= 2 ? 0 : 1].push_back(p);
    ZeroOptions zero_options;
    zero_options.stage = options.zero_stage;
    zero_options.reduce_bucket_bytes = options.bucket_bytes;
    zero_options.allgather_bucket_bytes = options.zero_allgather_bucket_bytes;
    zero_options.allow_untested_optimizer = options.zero_allow_untested_optimizer;
    zero_options.gradient_predivide_factor = options.gradient_predivide_factor;
    zero_options.layers = options.layers;
    zero_options.layer_indices = options.layer_indices;
    zero_options.keep_full_gradient = [keep](const at::Tensor& p) {
      return keep.count(p.unsafeGetTensorImpl()) > 0;
    };
    zero_options.counted_in_norm = [counted](const at::Tensor& p) {
      return counted.count(p.unsafeGetTensorImpl()) > 0;
    };
    const AdamWOptions adam = options.adam;
    TRIDENT_ASSIGN_OR_RETURN(
        zero->zero_,
        ZeroOptimizer::Create(
            groups, options.data_parallel, zero_options,
            [adam](const std::vector<std::vector<at::Tensor>>& shards) {
              std::vector<torch::optim::OptimizerParamGroup> param_groups;
              for (size_t g = 0; g < shards.size(); ++g) {
                auto group_options = std::make_unique<torch::optim::AdamWOptions>(0.0);
                group_options->betas({adam.beta1, adam.beta2}).eps(adam.eps);
                group_options->weight_decay(g == 0 ? adam.weight_decay : 0.0);
                param_groups.emplace_back(shards[g], std::move(group_options));
              }
              return std::unique_ptr<torch::optim::Optimizer>(new torch::optim::AdamW(param_groups));
            }));
    return std::unique_ptr<ParameterUpdate>(std::move(zero));
  }
  void ZeroGrad() override { zero_->ZeroGrad(); }
  void PrepareForBackward(bool last) override { zero_->PrepareForBackward(last); }
  absl::Status FinishBackward() override { return zero_->FinishBackward(); }
  bool LocalGradientsNonFinite() const override { return zero_->LocalGradientsNonFinite(); }
  void ScaleGradients(double factor) override { zero_->ScaleGradients(factor); }
  absl::Status SumOverTensorParallel(const std::vector<at::Tensor>& parameters) override {
    if (options_.tensor_parallel == nullptr) return absl::OkStatus();
    return zero_->SumGradientsOver(*options_.tensor_parallel, parameters);
  }
  absl::StatusOr<double> ClipGradNorm(double max_norm) override {
    // Each rank holds its chunk of every gradient: the sum runs over all ranks.
    at::Tensor squares = at::full({1}, zero_->LocalSquaredGradNorm(), at::kDouble);
    if (options_.world->size() > 1) TRIDENT_RETURN_IF_ERROR(options_.world->AllReduce(squares));
    const double norm = std::sqrt(squares.item<double>());
    if (max_norm > 0 && norm > max_norm) zero_->ScaleGradients(max_norm / (norm + 1e-6));
    return norm;
  }
  absl::Status Step(double lr) override { return zero_->Step(lr); }
  NamedTensors State() const override { return zero_->State(); }
  absl::Status LoadState(const SafetensorsContents& contents) override {
    return zero_->LoadState(contents.tensors);
  }
  std::string MemoryReport() const override { return zero_->Memory().ToString(); }
  absl::Status GatherFullParameters() override { return zero_->GatherAllParameters(); }
  absl::Status ReleaseFullParameters(bool keep_changes) override {
    return zero_->ReleaseAllParameters(keep_changes);
  }

 private:
  Zero() = default;
  ParameterUpdateOptions options_;
  std::unique_ptr<ZeroOptimizer> zero_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ParameterUpdate>> MakeParameterUpdate(ParameterUpdateOptions options) {
  if (options.zero_stage == 0) return std::unique_ptr<ParameterUpdate>(new PlainDataParallel(std::move(options)));
  return Zero::Create(std::move(options));
}

}  // namespace internal
}  // namespace trident
