// Training runs for the trainer's tests: a small GPT on a byte corpus,
// trained on several ranks as separate processes (testing/multiprocess.h),
// and loss comparisons. Test-only.
#ifndef TRIDENT_TRAINER_INTERNAL_TRAINING_RUNS_H_
#define TRIDENT_TRAINER_INTERNAL_TRAINING_RUNS_H_

#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "trainer/trainer.h"

namespace trident::testing {

// Sets flag `name` of `config` (a dotted path, or a flat alias with its
// conversion: SetFlag(&c, "checkpoint_layers", "h.0,h.1")) from `value`'s
// text; a bad flag fails the test where it is set.
void SetFlag(TrainerConfig* config, const std::string& name, const std::string& value);
inline void SetFlag(TrainerConfig* config, const std::string& name, const char* value) {
  SetFlag(config, name, std::string(value));
}
inline void SetFlag(TrainerConfig* config, const std::string& name, bool value) {
  SetFlag(config, name, std::string(value ? "true" : "false"));
}
template <typename Number, typename = std::enable_if_t<std::is_arithmetic_v<Number>>>
void SetFlag(TrainerConfig* config, const std::string& name, Number value) {
  SetFlag(config, name, absl::StrCat(value));
}

// TEST_TMPDIR (or /tmp).
std::string TestDir();
// A small byte-level corpus in TEST_TMPDIR/data, made once per test process.
std::string DataDir();
// gpt-tiny with 2 layers of width 64, global batch 8 over `dp` ranks, 20 steps.
TrainerConfig SmallConfig(int dp);
// Trains `config` on dp * tp * pp ranks and hands rank 0's result to
// `on_rank0` (in rank 0's process).
void TrainEverywhere(const TrainerConfig& config, const std::function<void(const TrainResult&)>& on_rank0);
// The per-step losses of TrainEverywhere (through TEST_TMPDIR/`tag`.txt).
std::vector<double> TrainOnRanks(const TrainerConfig& config, const std::string& tag);
// Trains `config` 20 steps saving at step 10 (under TEST_TMPDIR/`tag`), then
// from step 10 again: expects the resumed steps to equal the straight run's
// bit for bit.
void ExpectResumeIsBitExact(TrainerConfig config, const std::string& tag);
// Compares per-step losses to `relative` tolerance and prints the largest difference.
void ExpectSameLosses(const std::vector<double>& expected, const std::vector<double>& actual, double relative);

}  // namespace trident::testing

#endif  // TRIDENT_TRAINER_INTERNAL_TRAINING_RUNS_H_
