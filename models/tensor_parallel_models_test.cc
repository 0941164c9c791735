// The tensor-parallel gpt and llama start as slices of the single-process
// weights and compute its loss and (sliced) gradients on 2 and 4 ranks, with
// and without sequence parallelism; and the automatic tensor-parallel pass
// finds the same plan in their traced single-process modules.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "graph/model_graph.h"
#include "models/models.h"
#include "tensor_parallel/tensor_parallel.h"
#include "testing/multiprocess.h"

namespace trident {
namespace {

struct Case {
  const char* model;
  int tp;
  bool sequence_parallel;
  int overlapping_level = 0;  // 2: the blocks run sub-pipelined (RunSubPipelinedBlock)
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
    config.tp = {c.tp, rank, "tp", c.sequence_parallel, /*parallel_vocab=*/true, c.overlapping_level};
    auto sharded = CreateModel(config, 9);
    ASSERT_TRUE(sharded.ok()) << sharded.status();
    const auto shards = (*sharded)->ParameterShards();
    EXPECT_FALSE(shards.empty());
    auto full = whole->named_parameters();
    for (const auto& item : (*sharded)->named_parameters()) {
      auto spec = shards.find(item.key());
      const at::Tensor expected = spec == shards.end() ? full[item.key()] : spec->second.Slice(full[item.key()]);
      EXPECT_TRUE(torch::equal(item.value(), expected)) << "initial " << item.key();
    }

    torch::manual_seed(2);
    auto tokens = torch::randint(config.vocab_size, {2, 8}, torch::kLong);
    auto targets = torch::randint(config.vocab_size, {2, 8}, torch::kLong);
    at::Tensor expected = whole->Loss(tokens, targets);
    expected.backward();
    // The tokens go in whole; with sequence parallelism the embedding's output
    // is this rank's sequence shard.
    const int64_t overlapped_before = SubPipelinedGradientSumsOverlapped();
    at::Tensor loss = (*sharded)->Loss(tokens, targets);
    EXPECT_NEAR(loss.item<double>(), expected.item<double>(), 1e-5 * expected.item<double>());
    loss.backward();
    // Sub-pipelined, each block overlaps 3 of its 4 input-gradient sums.
    EXPECT_EQ(SubPipelinedGradientSumsOverlapped() - overlapped_before,
              c.overlapping_level == 2 ? 3 * config.n_layer : 0);
    std::vector<at::Tensor> replicated;
    for (const auto& item : (*sharded)->named_parameters()) {
      if (!shards.count(item.key())) replicated.push_back(item.value());
    }
    if (c.sequence_parallel) {
      ASSERT_TRUE(SequenceParallelGradients(replicated, "tp").ok());
    }
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
    ::testing::Values(Case{"gpt", 2, false}, Case{"gpt", 4, false}, Case{"gpt", 2, true}, Case{"gpt", 4, true},
                      Case{"llama", 2, false}, Case{"llama", 4, false}, Case{"llama", 2, true},
                      Case{"gpt", 2, false, 2}, Case{"gpt", 4, false, 2}, Case{"llama", 2, false, 2}),
    [](const auto& info) {
      return std::string(info.param.model) + "_tp" + std::to_string(info.param.tp) +
             (info.param.sequence_parallel ? "_sp" : "") +
             (info.param.overlapping_level > 0 ? "_overlap" + std::to_string(info.param.overlapping_level) : "");
    });

TEST(TensorParallelModelConfigTest, DimensionsThatDoNotDivideAreNamed) {
  ModelConfig c = SmallConfig("gpt");
  c.tp = {3, 0, "tp", false};
  EXPECT_THAT(std::string(ValidateModelConfig(c).message()), ::testing::HasSubstr("n_head=4 is not divisible by tp=3"));
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

// The automatic tensor-parallel plan of the zoo's gpt and llama, traced from
// their single-process C++ modules, equals the hand plan the zoo builds: the
// same shard of every parameter and the same collectives; and the rewritten
// graph computes the hand-built model's loss.
absl::StatusOr<std::unique_ptr<ModelGraph>> Traced(LanguageModel& model, const at::Tensor& tokens,
                                                   const at::Tensor& targets) {
  return ModelGraph::Trace(model, {tokens, targets}, [&](const std::vector<at::Tensor>& in) {
    return std::vector<at::Tensor>{model.Loss(in[0], in[1])};
  });
}

// The trident:: operators of a graph, by kind.
std::map<std::string, int> Collectives(const ModelGraph& graph) {
  std::map<std::string, int> kinds;
  for (const GraphNode& node : graph.nodes()) {
    if (node.kind.rfind("trident::", 0) == 0) ++kinds[node.kind];
  }
  return kinds;
}

class AutoPlanEqualsZooTest : public ::testing::TestWithParam<const char*> {};

TEST_P(AutoPlanEqualsZooTest, SameShardsCollectivesAndLoss) {
  const std::string name = GetParam();
  testing::RunOnRanks(2, [name](int rank) {
    auto topology = testing::JoinTopology({{"tensor", 2}});
    ASSERT_TRUE(topology.ok()) << topology.status();
    ModelConfig config = SmallConfig(name);
    if (name == "llama") config.n_kv_head = 2;  // grouped-query attention
    std::shared_ptr<LanguageModel> whole = *CreateModel(config, 9);
    config.tp = {2, rank, "tp", false};
    std::shared_ptr<LanguageModel> hand = *CreateModel(config, 9);
    const std::map<std::string, ShardSpec> hand_shards = hand->ParameterShards();

    torch::manual_seed(2);
    const at::Tensor tokens = torch::randint(config.vocab_size, {2, 8}, torch::kLong);
    const at::Tensor targets = torch::randint(config.vocab_size, {2, 8}, torch::kLong);
    auto graph = Traced(*whole, tokens, targets);
    ASSERT_TRUE(graph.ok()) << graph.status();
    auto automatic = AutoTensorParallel(**graph, config.tp);
    ASSERT_TRUE(automatic.ok()) << automatic.status();

    // Parameter by parameter.
    ASSERT_EQ(automatic->shards.size(), hand_shards.size()) << automatic->plan.Report();
    for (const auto& [parameter, spec] : hand_shards) {
      auto found = automatic->shards.find(parameter);
      ASSERT_NE(found, automatic->shards.end()) << parameter << " is split by hand only\n" << automatic->plan.Report();
      EXPECT_EQ(found->second.dim, spec.dim) << parameter;
      EXPECT_EQ(found->second.parts, spec.parts) << parameter;
      EXPECT_EQ(found->second.index, spec.index) << parameter;
      EXPECT_EQ(found->second.blocks, spec.blocks) << parameter;
    }

    // The same collectives, except that the automatic plan copies an input
    // that several column products read (q, k and v; gate and up) into the
    // region once, so its backward all-reduces that gradient once, not per
    // product; and the hand-built model's loss.
    auto rewritten = ModelGraph::Trace(automatic->parameters, {tokens, targets}, automatic->forward);
    ASSERT_TRUE(rewritten.ok()) << rewritten.status();
    auto hand_graph = Traced(*hand, tokens, targets);
    ASSERT_TRUE(hand_graph.ok()) << hand_graph.status();
    std::map<std::string, int> automatic_collectives = Collectives(**rewritten);
    std::map<std::string, int> hand_collectives = Collectives(**hand_graph);
    const std::string copy = "trident::copy_to_tp_region";
    EXPECT_EQ(automatic_collectives[copy], 2 * config.n_layer + 1);  // per block: attention, MLP; the head
    EXPECT_LE(automatic_collectives[copy], hand_collectives[copy]);
    automatic_collectives.erase(copy);
    hand_collectives.erase(copy);
    EXPECT_EQ(automatic_collectives, hand_collectives);
    auto loss = (*rewritten)->Run({tokens, targets});
    ASSERT_TRUE(loss.ok()) << loss.status();
    const double expected = hand->Loss(tokens, targets).item<double>();
    EXPECT_NEAR(loss->at(0).item<double>(), expected, 1e-5 * expected);
  });
}

INSTANTIATE_TEST_SUITE_P(Zoo, AutoPlanEqualsZooTest, ::testing::Values("gpt", "llama"));

}  // namespace
}  // namespace trident
