// AutoAccelerate on two real ranks: the search profiles a small GPT, ranks the
// layouts, dry-runs the best and hands back a model that trains with the
// losses of one process on the same batches and initial weights; the
// strategy it saved reloads; a memory limit nothing fits is one clear error
// on every rank.
#include <cstdlib>
#include <fstream>
#include <tuple>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "strategy/strategy.h"
#include "testing/multiprocess.h"

namespace trident {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kGlobalBatch = 8;
constexpr int kSteps = 4;

// 64 samples of 16 random tokens (vocabulary 64), the same on every rank.
class RandomTokens : public Dataset {
 public:
  RandomTokens() {
    at::manual_seed(11);
    tokens_ = at::randint(64, {64, 17}, at::kLong);
  }
  int64_t size() const override { return tokens_.size(0); }
  absl::StatusOr<Batch> Get(const std::vector<int64_t>& indices) const override {
    at::Tensor rows = tokens_.index_select(0, at::tensor(indices, at::kLong));
    return Batch{rows.narrow(1, 0, 16).contiguous(), rows.narrow(1, 1, 16).contiguous()};
  }
  std::vector<std::string> field_names() const override { return {"input_ids", "labels"}; }
  int64_t tokens_per_sample() const override { return 16; }

 private:
  at::Tensor tokens_;
};

SourceFactory SmallGpt() {
  return [](const ModelContext& context) -> absl::StatusOr<ModelSource> {
    TRIDENT_ASSIGN_OR_RETURN(ModelFactory factory, ModelRegistry().Find("gpt"));
    return factory(
        ComponentArgs(
            "model 'gpt'",
            {{"n_layer", "4"}, {"n_head", "4"}, {"n_embd", "32"}, {"block_size", "16"}, {"vocab_size", "64"}}),
        context);
  };
}

OptimizerFactory AdamW() { return *MakeOptimizerFactory("adamw", ComponentArgs("optimizer 'adamw'", {})); }

std::string TmpFile(const std::string& name) { return absl::StrCat(std::getenv("TEST_TMPDIR"), "/", name); }

// Trains `model` for kSteps on the micro-batches `batches(step)` gives and
// writes the losses to `path` (from rank 0).
template <typename Batches>
void TrainAndRecord(ParallelModel& model, Batches batches, int rank, const std::string& path) {
  std::ofstream out;
  if (rank == 0) out.open(path);
  out.precision(17);
  for (int64_t step = 0; step < kSteps; ++step) {
    absl::StatusOr<std::vector<Batch>> micro = batches(step);
    ASSERT_TRUE(micro.ok()) << micro.status();
    model.ZeroGrad();
    absl::StatusOr<double> loss = model.ForwardBackward(*micro);
    ASSERT_TRUE(loss.ok()) << loss.status();
    ASSERT_TRUE(model.ClipGradNorm(1.0).ok());
    ASSERT_TRUE(model.Step(1e-3).ok());
    if (rank == 0) out << *loss << "\n";
  }
}

std::vector<double> ReadLosses(const std::string& path) {
  std::vector<double> losses;
  std::ifstream in(path);
  for (double l; in >> l;) losses.push_back(l);
  return losses;
}

TEST(AutoAccelerateTest, TrainsWithTheLossesOfOneProcess) {
  auto dataset = std::make_shared<RandomTokens>();
  // One process, the whole global batch as one micro-batch.
  testing::RunOnRanks(1, [&](int rank) {
    auto topology = testing::JoinTopology({{"data", 1}});
    ASSERT_TRUE(topology.ok()) << topology.status();
    ParallelPlan plan;
    plan.set_micro_batch_size(kGlobalBatch);
    SetStrings(plan.mutable_trace()->mutable_batch_fields(), dataset->field_names());
    auto source = SmallGpt()(ModelContext{});
    ASSERT_TRUE(source.ok()) << source.status();
    BatchSampler sampler(dataset->size(), kGlobalBatch, plan.seed(), /*shuffle=*/true);
    auto global = [&](int64_t step) -> absl::StatusOr<std::vector<Batch>> {
      std::vector<int64_t> rows;
      for (int64_t j = 0; j < kGlobalBatch; ++j) rows.push_back(sampler.SampleIndex(step, j));
      TRIDENT_ASSIGN_OR_RETURN(Batch batch, dataset->Get(rows));
      return std::vector<Batch>{batch};
    };
    auto model = Parallelize(*std::move(source), plan, topology->get(), (*global(0))[0], AdamW());
    ASSERT_TRUE(model.ok()) << model.status();
    TrainAndRecord(**model, global, rank, TmpFile("one_process"));
  });

  const std::string saved = TmpFile("chosen.pbtxt");
  testing::RunOnRanks(2, [&](int rank) {
    auto topology = testing::JoinTopology({{"data", 2}});
    ASSERT_TRUE(topology.ok()) << topology.status();
    AutoAccelerateOptions options;
    options.profile_cache_dir = TmpFile("profiles");
    options.model_fingerprint = "small gpt";
    options.dry_runs = 2;
    options.dry_run_steps = 1;
    options.save_strategy_to_file = saved;
    auto run = AutoAccelerate(SmallGpt(), dataset, kGlobalBatch, AdamW(), topology->get(), options);
    ASSERT_TRUE(run.ok()) << run.status();
    EXPECT_GT(run->search.considered, 10);
    EXPECT_FALSE(run->strategy.fingerprint().empty());
    int dry_run = 0;
    for (const CandidateReport& candidate : run->search.ranked) dry_run += candidate.measured_step_s > 0;
    EXPECT_EQ(dry_run, 2);
    TrainAndRecord(*run->model, run->micro_batches, rank, TmpFile("auto"));
    if (rank == 0) std::ofstream(TmpFile("chosen_plan")) << DescribePlan(run->search.plan);

    // The saved strategy is the one chosen: reloaded, it lays out the same plan.
    auto strategy = LoadStrategy(saved);
    ASSERT_TRUE(strategy.ok()) << strategy.status();
    ParallelPlan reapplied;
    ASSERT_TRUE(ApplyStrategy(*strategy, 2, &reapplied).ok()) << StrategyToText(*strategy);
    const ParallelPlan& chosen = run->search.plan;
    EXPECT_EQ(std::make_tuple(reapplied.dp(), reapplied.tp(), reapplied.pp(), reapplied.zero().stage(),
                              reapplied.precision().mode(), reapplied.recompute().method()),
              std::make_tuple(chosen.dp(), chosen.tp(), chosen.pp(), chosen.zero().stage(), chosen.precision().mode(),
                              chosen.recompute().method()))
        << StrategyToText(*strategy);
    if (chosen.pp() > 1) {
      EXPECT_EQ(reapplied.pipeline().schedule(), chosen.pipeline().schedule());
    }

    // Nothing fits 1 MB: the error names the smallest requirement found, on both ranks.
    options.memory_limit_bytes = 1 << 20;
    options.save_strategy_to_file.clear();
    auto refused = AutoAccelerate(SmallGpt(), dataset, kGlobalBatch, AdamW(), topology->get(), options);
    ASSERT_FALSE(refused.ok());
    EXPECT_THAT(std::string(refused.status().message()), HasSubstr("no strategy fits the memory limit of 1 MB"));
    EXPECT_THAT(std::string(refused.status().message()), HasSubstr("the smallest found"));
  });

  std::string chosen;
  std::getline(std::ifstream(TmpFile("chosen_plan")), chosen);
  const std::vector<double> one = ReadLosses(TmpFile("one_process")), automatic = ReadLosses(TmpFile("auto"));
  ASSERT_EQ(one.size(), static_cast<size_t>(kSteps));
  ASSERT_EQ(automatic.size(), one.size()) << chosen;
  for (size_t i = 0; i < one.size(); ++i)
    EXPECT_NEAR(automatic[i], one[i], 1e-5 * std::abs(one[i])) << chosen << " step " << i;
}

}  // namespace
}  // namespace trident
