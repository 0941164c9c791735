// amp: mixed precision. A precision policy in the spirit of the reference
// design's table (the dtype of parameters, buffers and inputs, and of the
// compute), autocast scopes, and dynamic loss scaling with the reference
// design's parameters.
//
//   fp32       everything fp32
//   bf16       bf16 compute (autocast), fp32 parameters = master weights and
//              optimizer states
//   fp16       fp16 compute (autocast, GPU), fp32 master weights, dynamic loss
//              scaling
//   pure_bf16  parameters and buffers stored in bf16, the optimizer works on them
//   pure_fp16  the same in fp16, with loss scaling
//
// A table "param=bf16,buffer=fp32,input=bf16" overrides the stored dtype per
// tensor kind (input: floating-point model inputs; token ids stay integers).
#ifndef TRIDENT_AMP_AMP_H_
#define TRIDENT_AMP_AMP_H_

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>
#include <torch/nn/module.h>

#include "absl/status/statusor.h"
#include "amp/amp.pb.h"
#include "base/registry.h"
#include "base/tensors.h"

namespace trident {

struct PrecisionPolicy {
  std::string mode = "fp32";
  at::ScalarType compute = at::kFloat;  // autocast dtype; kFloat: no autocast
  at::ScalarType param = at::kFloat;
  at::ScalarType buffer = at::kFloat;
  at::ScalarType input = at::kFloat;
  bool loss_scaling = false;  // fp16 modes
};

// Precision modes by name (plan's precision): each sets a policy's dtypes and
// loss scaling from the fp32 policy. The five above are built in.
using PrecisionMode = std::function<void(PrecisionPolicy& policy)>;
Registry<PrecisionMode>& PrecisionModeRegistry();

// `mode` from PrecisionModeRegistry; `table` (may be empty) overrides tensor
// kinds. Errors name the unknown mode, kind or dtype.
absl::StatusOr<PrecisionPolicy> MakePrecisionPolicy(const std::string& mode, const std::string& table);

// Stores `module`'s parameters and buffers in the policy's dtypes.
void ApplyPrecision(torch::nn::Module& module, const PrecisionPolicy& policy);

// Autocast to policy.compute on `device` while alive (nothing for fp32).
class AutocastScope {
 public:
  AutocastScope(const PrecisionPolicy& policy, c10::DeviceType device);
  ~AutocastScope();
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  bool active_ = false;
  c10::DeviceType device_;
  bool was_enabled_ = false;
  at::ScalarType was_dtype_ = at::kFloat;
};

class LossScaler {
 public:
  explicit LossScaler(LossScalerSpec options);
  double scale() const { return scale_; }
  // After a step whose gradients overflowed on some rank (`overflow`) or not:
  // lowers the scale (after `hysteresis` overflows, never below the minimum)
  // or raises it after `loss_scale_window` clean steps. Static scales never
  // change.
  void Update(bool overflow);
  // The scale and its counters, for checkpoints ("amp/..." names).
  NamedTensors State() const;
  absl::Status LoadState(const NamedTensors& state);

 private:
  LossScalerSpec options_;
  double scale_;
  int hysteresis_left_;
  int64_t clean_steps_ = 0;  // since the last overflow or raise
};

}  // namespace trident

#endif  // TRIDENT_AMP_AMP_H_
