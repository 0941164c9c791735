// A pipeline step over 2 and 4 ranks, with each schedule, gives the loss and
// every parameter gradient of one process running the whole model on the same
// global batch.
#include "pipeline/stage_runner.h"

#include <chrono>
#include <cmath>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "partition/partition.h"
#include "testing/multiprocess.h"
#include "testing/tiny_model.h"

namespace trident {
namespace {

struct Case {
  const char* schedule;
  int stages;
  int checkpointed_layers = 0;  // per chunk; -1: all of them
  int chunks = 1;               // model chunks per rank (interleaved_1f1b)
};

// The most micro-batches a schedule keeps alive on `rank` (forward done,
// backward not), with M micro-batches.
int ExpectedPeakLive(const Case& c, int rank, int M) {
  const std::string name = c.schedule;
  const int S = c.stages;
  if (name == "gpipe") return M;
  if (name == "interleaved_1f1b") {
    const int total = M * c.chunks;
    return M == S ? total : std::min((S - rank - 1) * 2 + (c.chunks - 1) * S + 1, total);
  }
  if (name == "shifted_critical_path" && rank < S - 1) return std::min(M, S - rank + 1);
  return std::min(M, S - rank);
}

// M micro-batches of (tokens, targets).
std::vector<Batch> MicroBatches(const at::Tensor& tokens, const at::Tensor& targets, int M) {
  std::vector<Batch> batches;
  auto x = tokens.chunk(M), y = targets.chunk(M);
  for (int m = 0; m < M; ++m) batches.push_back({x[m], y[m]});
  return batches;
}

double Mean(const std::vector<double>& values) {
  double sum = 0;
  for (double v : values) sum += v;
  return sum / values.size();
}

class StageRunnerTest : public ::testing::TestWithParam<Case> {};

TEST_P(StageRunnerTest, PipelineStepEqualsOneProcess) {
  const Case c = GetParam();
  testing::RunOnRanks(c.stages, [c](int rank) {
    testing::TinyModelOptions config;
    config.n_layer = std::max(2, c.stages * c.chunks - 2);
    config.n_embd = 64;
    config.vocab_size = 256;
    config.tie_embeddings = true;  // the first and the last stage share the embedding
    const int M = 4, mb = 2, T = 16;
    torch::manual_seed(7);
    auto tokens = torch::randint(config.vocab_size, {M * mb, T}, torch::kLong);
    auto targets = torch::randint(config.vocab_size, {M * mb, T}, torch::kLong);

    auto whole = std::make_shared<testing::TinyModel>(config, 3);
    at::Tensor reference = whole->Loss(tokens, targets);
    reference.backward();

    auto topology = testing::JoinTopology({{"pipeline", c.stages}});
    ASSERT_TRUE(topology.ok()) << topology.status();
    const ProcessGroup& pipeline = **(*topology)->Group("pp");
    // Chunk k of this rank is virtual stage k * S + rank.
    const int virtual_stages = c.stages * c.chunks;
    auto bounds = *PartitionLayers("uniform", std::vector<double>(config.n_layer + 2, 1.0), virtual_stages);
    StageRunnerOptions options;
    LayerRanges ranges;
    for (int k = 0; k < c.chunks; ++k) {
      const int v = k * c.stages + rank;
      const int64_t layers = bounds[v + 1] - bounds[v];
      options.chunks.push_back({bounds[v], bounds[v + 1], c.checkpointed_layers < 0 ? layers : c.checkpointed_layers});
      ranges.emplace_back(bounds[v], bounds[v + 1]);
    }
    auto part = std::make_shared<testing::TinyModel>(config, 3, ranges);
    std::vector<std::pair<std::string, at::Tensor>> tied;
    for (const auto& item : part->named_parameters()) {
      if (item.key() == "embed.weight") tied.emplace_back(item.key(), item.value());
    }
    auto schedule = *MakeSchedule(c.schedule, c.chunks);
    if (!schedule->RecomputesOnLastStage() && rank == c.stages - 1) {
      options.chunks.back().checkpointed_layers = 0;
    }
    const std::vector<Batch> batches = MicroBatches(tokens, targets, M);
    // The boundary shapes, found by one forward (no dropout here to draw masks).
    ASSERT_TRUE(ForwardThroughStages(*part, options.chunks, &pipeline, batches[0]).ok());
    for (const StageChunk& chunk : options.chunks) {
      for (const TensorSpec& spec : chunk.received) {
        EXPECT_EQ(spec.shape, (std::vector<int64_t>{mb, T, config.n_embd}));
        EXPECT_TRUE(spec.requires_grad);
      }
    }
    const std::vector<std::vector<int>> holders(tied.size(), {0, c.stages - 1});
    options.reduce_tied_grads = [&] { return ReduceTiedGradients(tied, holders, pipeline); };
    PipelineStageRunner runner(*part, &pipeline, *schedule, options);
    auto losses = runner.RunStep(batches, {});
    ASSERT_TRUE(losses.ok()) << losses.status();
    // 1F1B keeps at most min(M, S - s) micro-batches' activations alive; GPipe all M.
    EXPECT_EQ(runner.peak_live_activations(), ExpectedPeakLive(c, rank, M));
    if (rank == c.stages - 1) {
      ASSERT_EQ(losses->size(), static_cast<size_t>(M));
      EXPECT_NEAR(Mean(*losses), reference.item<double>(), 1e-5 * reference.item<double>());
    } else {
      EXPECT_TRUE(losses->empty());
    }
    auto expected = whole->named_parameters();
    for (const auto& item : part->named_parameters()) {
      ASSERT_TRUE(item.value().grad().defined()) << item.key();
      EXPECT_TRUE(torch::allclose(item.value().grad(), expected[item.key()].grad(), 1e-4, 1e-6))
          << item.key() << " max diff "
          << (item.value().grad() - expected[item.key()].grad()).abs().max().item<double>();
    }
  });
}

INSTANTIATE_TEST_SUITE_P(SchedulesAndStages, StageRunnerTest,
                         ::testing::Values(Case{"gpipe", 2}, Case{"1f1b", 2}, Case{"gpipe", 4}, Case{"1f1b", 4},
                                           Case{"gpipe", 2, -1}, Case{"1f1b", 2, -1}, Case{"1f1b", 2, 1},
                                           Case{"pre_recompute_1f1b", 2, -1}, Case{"pre_recompute_1f1b", 4, 1},
                                           Case{"last_no_recompute_1f1b", 2, -1}, Case{"shifted_critical_path", 2, -1},
                                           Case{"shifted_critical_path", 4, 1}, Case{"zb_h1", 2}, Case{"zb_h1", 4},
                                           Case{"zb_h1", 2, 1}, Case{"interleaved_1f1b", 2, 0, 2},
                                           Case{"interleaved_1f1b", 4, 0, 2}, Case{"interleaved_1f1b", 2, 1, 3}),
                         [](const auto& info) {
                           const int ckpt = info.param.checkpointed_layers;
                           std::string name = info.param.schedule;
                           for (char& ch : name) {
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           }
                           return "s" + name + "_" + std::to_string(info.param.stages) + "x" +
                                  std::to_string(info.param.chunks) +
                                  (ckpt == 0  ? ""
                                   : ckpt < 0 ? "_RecomputeAll"
                                              : "_RecomputeFirst");
                         });

// Recomputation replays the dropout masks of the forward: with dropout on, a
// step with every layer checkpointed gives the gradients of a step without (to
// rounding; without restoring the RNG state they differ by half their size).
TEST(StageRunnerRecomputeTest, RecomputationRestoresTheRandomState) {
  testing::RunOnRanks(1, [](int) {
    testing::TinyModelOptions config;
    config.n_layer = 2;
    config.n_embd = 32;
    config.vocab_size = 256;
    config.dropout = 0.2;
    auto topology = testing::JoinTopology({{"pipeline", 1}});
    ASSERT_TRUE(topology.ok());
    const ProcessGroup& pipeline = **(*topology)->Group("pp");
    auto schedule = *MakeSchedule("1f1b");
    auto tokens = torch::randint(config.vocab_size, {4, 16}, torch::kLong);
    std::vector<std::vector<at::Tensor>> grads;
    for (int checkpointed : {0, 4}) {
      auto model = std::make_shared<testing::TinyModel>(config, 5);
      StageRunnerOptions options;
      options.chunks = {{0, 4, checkpointed}};
      options.checkpoint_num_layers = 2;
      PipelineStageRunner runner(*model, &pipeline, *schedule, options);
      torch::manual_seed(11);
      ASSERT_TRUE(runner.RunStep(MicroBatches(tokens, tokens, 2), {}).ok());
      grads.emplace_back();
      for (const auto& p : model->parameters()) grads.back().push_back(p.grad().clone());
    }
    for (size_t i = 0; i < grads[0].size(); ++i) {
      EXPECT_TRUE(torch::allclose(grads[0][i], grads[1][i], 1e-5, 1e-7))
          << i << " max diff " << (grads[0][i] - grads[1][i]).abs().max().item<double>() << " of "
          << grads[0][i].abs().max().item<double>();
    }
  });
}

}  // namespace
}  // namespace trident

namespace trident {
namespace {

// A stage that dies mid-step: its neighbour's step fails with an error naming
// it, long before the operation timeout.
TEST(StageRunnerFailureTest, DeadStageIsNamedByItsNeighbour) {
  testing::MultiProcessResult result = testing::SpawnRanks(2, [](int rank) {
    testing::TinyModelOptions config;
    config.n_layer = 2;
    auto topology = testing::JoinTopology({{"pipeline", 2}});
    ASSERT_TRUE(topology.ok()) << topology.status();
    const ProcessGroup& pipeline = **(*topology)->Group("pp");
    auto part = std::make_shared<testing::TinyModel>(config, 1, LayerRanges{{rank * 2, rank * 2 + 2}});
    if (rank == 1) _exit(3);
    auto schedule = *MakeSchedule("1f1b");
    StageRunnerOptions options;
    options.chunks = {{0, 2}};
    options.chunks[0].sent = {{{2, 8, config.n_embd}, at::kFloat, true}};
    PipelineStageRunner runner(*part, &pipeline, *schedule, options);
    auto tokens = torch::randint(config.vocab_size, {2, 8}, torch::kLong);
    const auto start = std::chrono::steady_clock::now();
    auto loss = runner.RunStep({{tokens, tokens}, {tokens, tokens}}, {});
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
    ASSERT_FALSE(loss.ok());
    EXPECT_THAT(std::string(loss.status().message()), ::testing::HasSubstr("rank 1"));
  });
  EXPECT_EQ(result.ranks[1].exit_code, 3);
  EXPECT_EQ(result.ranks[0].exit_code, 0) << result.ranks[0].output;
}

}  // namespace
}  // namespace trident
