// The tensor-parallel gpt and llama start as slices of the single-process
// weights and compute its loss and (sliced) gradients on 2 and 4 ranks, with
// and without sequence parallelism.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "models/models.h"
#include "testing/multiprocess.h"

namespace trident {
namespace {

struct Case {
  const char* model;
  int tp;
  bool sequence_parallel;
};

class TensorParallelModelTest : public ::testing::TestWithParam<Case> {};

ModelConfig SmallConfig(const std::string& model) {
  ModelConfig c = *PresetModelConfig(model, model + "-tiny");
  c.n_layer = 2;
  c.n_embd = 32;
  c.n_head = 4;
  c.block_size = 8;
  c.vocab_size = 64;
  if (model == "llama") c.n_kv_head = 4;
  return c;
}

TEST_P(TensorParallelModelTest, LossAndGradientsEqualOneProcess) {
  const Case c = GetParam();
  testing::RunOnRanks(c.tp, [c](int rank) {
    auto topology = testing::JoinTopology({{"tensor", c.tp}});
    ASSERT_TRUE(topology.ok()) << topology.status();
    ModelConfig config = SmallConfig(c.model);
    auto whole = *CreateModel(config, 9);
    config.tp = {c.tp, rank, "tp", c.sequence_parallel};
    auto sharded = CreateModel(config, 9);
    ASSERT_TRUE(sharded.ok()) << sharded.status();
    const auto shards = (*sharded)->ParameterShards();
    EXPECT_FALSE(shards.empty());
    auto full = whole->named_parameters();
    for (const auto& item : (*sharded)->named_parameters()) {
      auto spec = shards.find(item.key());
      const at::Tensor expected =
          spec == shards.end() ? full[item.key()] : spec->second.Slice(full[item.key()]);
      EXPECT_TRUE(torch::equal(item.value(), expected)) << "initial " << item.key();
    }

    torch::manual_seed(2);
    auto tokens = torch::randint(config.vocab_size, {2, 8}, torch::kLong);
    auto targets = torch::randint(config.vocab_size, {2, 8}, torch::kLong);
    at::Tensor expected = whole->Loss(tokens, targets);
    expected.backward();
    // The tokens go in whole; with sequence parallelism the embedding's output
    // is this rank's sequence shard.
    at::Tensor loss = (*sharded)->Loss(tokens, targets);
    EXPECT_NEAR(loss.item<double>(), expected.item<double>(), 1e-5 * expected.item<double>());
    loss.backward();
    std::vector<at::Tensor> replicated;
    for (const auto& item : (*sharded)->named_parameters()) {
      if (!shards.count(item.key())) replicated.push_back(item.value());
    }
    if (c.sequence_parallel) ASSERT_TRUE(SequenceParallelGradients(replicated, "tp").ok());
    for (const auto& item : (*sharded)->named_parameters()) {
      auto spec = shards.find(item.key());
      const at::Tensor reference = full[item.key()].grad();
      const at::Tensor want = spec == shards.end() ? reference : spec->second.Slice(reference);
      ASSERT_TRUE(item.value().grad().defined()) << item.key();
      const double diff = (item.value().grad() - want).abs().max().item<double>();
      EXPECT_LE(diff, 1e-5 * std::max(1e-3, want.abs().max().item<double>()))
          << item.key() << " gradient differs by " << diff;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(
    ModelsAndRanks, TensorParallelModelTest,
    ::testing::Values(Case{"gpt", 2, false}, Case{"gpt", 4, false}, Case{"gpt", 2, true},
                      Case{"gpt", 4, true}, Case{"llama", 2, false}, Case{"llama", 4, false},
                      Case{"llama", 2, true}),
    [](const auto& info) {
      return std::string(info.param.model) + "_tp" + std::to_string(info.param.tp) +
             (info.param.sequence_parallel ? "_sp" : "");
    });

TEST(TensorParallelModelConfigTest, DimensionsThatDoNotDivideAreNamed) {
  ModelConfig c = SmallConfig("gpt");
  c.tp = {3, 0, "tp", false};
  EXPECT_THAT(std::string(ValidateModelConfig(c).message()),
              ::testing::HasSubstr("n_head=4 is not divisible by tp=3"));
  c.n_head = 3;
  c.n_embd = 33;
  EXPECT_THAT(std::string(ValidateModelConfig(c).message()),
              ::testing::HasSubstr("vocab_size=64 is not divisible by tp=3; set vocab_size to a "
                                   "multiple of tp"));
  c = SmallConfig("llama");
  c.n_kv_head = 2;
  c.tp = {4, 0, "tp", false};
  EXPECT_THAT(std::string(ValidateModelConfig(c).message()),
              ::testing::HasSubstr("n_kv_head=2 is not divisible by tp=4"));
  c = SmallConfig("gpt");
  c.block_size = 6;
  c.tp = {4, 0, "tp", true};
  EXPECT_THAT(std::string(ValidateModelConfig(c).message()),
              ::testing::HasSubstr("block_size (sequence parallelism)=6 is not divisible by tp=4"));
  c = SmallConfig("mlp");
  c.tp = {2, 0, "tp", false};
  EXPECT_THAT(std::string(ValidateModelConfig(c).message()),
              ::testing::HasSubstr("model 'mlp' has no tensor-parallel form"));
}

}  // namespace
}  // namespace trident
