// AdamW over a fixed list of named parameters, with PyTorch's AdamW arithmetic:
// one fused pass per float32 CPU parameter, multi-tensor (_foreach) kernels for
// the rest.
#ifndef TRIDENT_TRAINER_INTERNAL_OPTIMIZER_H_
#define TRIDENT_TRAINER_INTERNAL_OPTIMIZER_H_

#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "checkpoint/checkpoint.h"
#include "topology/topology.h"

namespace trident {
namespace internal {

struct AdamWOptions {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;  // decoupled; applied to parameters of dimension >= 2 only
};

class AdamW {
 public:
  AdamW(NamedTensors parameters, AdamWOptions options);

  // One update with learning rate `lr` from the parameters' .grad.
  void Step(double lr);
  int64_t steps() const { return steps_; }

  // The state as named tensors ("exp_avg/<name>", "exp_avg_sq/<name>", "steps"),
  // and its restoration; errors name the missing or mis-shaped entry.
  NamedTensors State() const;
  absl::Status LoadState(const SafetensorsContents& contents);

 private:
  NamedTensors parameters_;
  AdamWOptions options_;
  std::vector<at::Tensor> params_, exp_avg_, exp_avg_sq_;
  int64_t steps_ = 0;
};

// Global L2 norm of the .grad of `counted` (summed over `group` when given, so
// pipeline stages each count their own parameters once); when `max_norm` > 0
// and the norm exceeds it, scales the gradients of `parameters` down to
// `max_norm`. Returns the norm before clipping.
absl::StatusOr<double> ClipGradNorm(const std::vector<at::Tensor>& counted,
                                    const std::vector<at::Tensor>& parameters, double max_norm,
                                    const ProcessGroup* group = nullptr);

// Learning rate at `step` (0-based): linear warmup over `warmup_steps`, then
// "constant", "cosine" or "linear" decay to `min_lr` at `max_steps`.
double LearningRate(const std::string& schedule, double lr, double min_lr, int64_t warmup_steps,
                    int64_t max_steps, int64_t step);

}  // namespace internal
}  // namespace trident

#endif  // TRIDENT_TRAINER_INTERNAL_OPTIMIZER_H_
