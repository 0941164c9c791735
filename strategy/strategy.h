// strategy: the reference design's auto_accelerate in C++. A Strategy is an
// ordered list of optimization methods (strategy.proto); applied to a
// ParallelPlan it sets the layout, precision, ZeRO stage, recomputation and
// pipeline schedule. Loaded from a file it is the semi-automatic mode; chosen
// by the search (search.h) it is the fully automatic one.
//
//   TRIDENT_ASSIGN_OR_RETURN(Strategy strategy, LoadStrategy("zero2_bf16.pbtxt"));
//   ParallelPlan plan;
//   TRIDENT_RETURN_IF_ERROR(ApplyStrategy(strategy, /*world_size=*/4, &plan));
//   TRIDENT_RETURN_IF_ERROR(SaveStrategy(StrategyFromPlan(plan), "in_use.pbtxt"));
#ifndef TRIDENT_STRATEGY_STRATEGY_H_
#define TRIDENT_STRATEGY_STRATEGY_H_

#include <string>

#include "absl/status/statusor.h"
#include "parallel/parallel.h"
#include "strategy/strategy.pb.h"

namespace trident {

// Reads a text-format Strategy; errors name the file and the line.
absl::StatusOr<Strategy> LoadStrategy(const std::string& path);
absl::Status SaveStrategy(const Strategy& strategy, const std::string& path);
std::string StrategyToText(const Strategy& strategy);

// Applies `strategy`'s methods, in order, to `plan` for `world_size` ranks.
// Errors (before any rank starts) name the method, the field or the pair of
// methods at fault: an unknown method, a field another method owns, sizes
// that do not divide the world, amp_native with half, zero1 with fsdp, fsdp
// with zb_h1, a pipeline_parallel without pipeline ranks, ...
absl::Status ApplyStrategy(const Strategy& strategy, int world_size, ParallelPlan* plan);

// The strategy `plan` amounts to (what --save_strategy writes).
Strategy StrategyFromPlan(const ParallelPlan& plan);

// The ranks `strategy` lays out: the product of its parallel_mode sizes
// (data counted as given, 1 when absent), or `fallback` without parallel_mode.
int StrategyWorldSize(const Strategy& strategy, int fallback);

// A short one-line description ("dp2 x pp2 zb_h1 M4 zero2 bf16 recompute=full").
std::string DescribePlan(const ParallelPlan& plan);

}  // namespace trident

#endif  // TRIDENT_STRATEGY_STRATEGY_H_
