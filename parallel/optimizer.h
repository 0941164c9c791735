// Optimizers for Parallelize: a registry of torch::optim optimizers by name
// (the same factory builds the optimizer over whole parameters under plain
// data parallelism and over ZeRO's chunks), Trident's fused AdamW and
// learning-rate schedules.
//
//   TRIDENT_ASSIGN_OR_RETURN(OptimizerFactory make, MakeOptimizerFactory("adamw",
//       ComponentArgs("optimizer 'adamw'", {{"weight_decay", "0.1"}})));
//   // Parallelize(source, plan, topology, example, make) builds it over this rank's part.
//
// A user optimizer registers like the built-ins:
//   static const bool kLion = OptimizerRegistry().Register("lion", MakeLionFactory);
#ifndef TRIDENT_PARALLEL_OPTIMIZER_H_
#define TRIDENT_PARALLEL_OPTIMIZER_H_

#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/optim/adamw.h>

#include "absl/status/statusor.h"
#include "base/registry.h"
#include "zero/zero.h"

namespace trident {

// AdamW with PyTorch's arithmetic and state (AdamWParamState, so save/load,
// ZeRO and memory reports treat it as torch::optim::AdamW), updating each
// contiguous float32 CPU parameter in one fused pass (the unfused form reads
// and writes every tensor about nine times) and, with LibTorch 2, all GPU
// parameters of a device and dtype in one multi-tensor kernel; other tensors
// take the unfused path.
class FusedAdamW : public torch::optim::AdamW {
 public:
  using torch::optim::AdamW::AdamW;
  torch::Tensor step(LossClosure closure = nullptr) override;
};

// Makes an OptimizerFactory from a config's arguments (errors name a bad or
// unknown argument).
using OptimizerMaker = std::function<absl::StatusOr<OptimizerFactory>(const ComponentArgs& args)>;
// Built-ins: "adamw" (FusedAdamW; beta1 0.9, beta2 0.999, eps 1e-8,
// weight_decay 0.01 on group 0 only), "adam" (torch::optim::Adam, same
// arguments, no decay) and "sgd" (momentum 0, weight_decay 0 on group 0).
Registry<OptimizerMaker>& OptimizerRegistry();
absl::StatusOr<OptimizerFactory> MakeOptimizerFactory(const std::string& type, const ComponentArgs& args);

// Sets every param group's learning rate.
void SetLearningRate(torch::optim::Optimizer& optimizer, double lr);

// Learning-rate schedules by name (config's lr_scheduler): the rate after
// warmup at `progress` (0 when warmup ends, 1 at max_steps) between `lr` and
// `min_lr`. Built in: constant, cosine, linear.
using LrSchedule = std::function<double(double lr, double min_lr, double progress)>;
Registry<LrSchedule>& LrScheduleRegistry();

// Learning rate at `step` (0-based): linear warmup over `warmup_steps`, then
// `schedule` to `min_lr` at `max_steps`. Errors when `schedule` is unknown.
absl::StatusOr<double> LearningRate(const std::string& schedule, double lr, double min_lr, int64_t warmup_steps,
                                    int64_t max_steps, int64_t step);

}  // namespace trident

#endif  // TRIDENT_PARALLEL_OPTIMIZER_H_
