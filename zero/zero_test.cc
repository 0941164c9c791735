// ZeRO stages 1 and 2 take the steps plain data parallelism takes, with each
// rank holding its share of the optimizer state (and gradients).
#include "zero/zero.h"

#include <cstdlib>
#include <numeric>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "base/memory_counter.h"
#include "testing/multiprocess.h"
#include "testing/tiny_model.h"

namespace trident {
namespace {

using ::testing::HasSubstr;

// Two residual blocks of width 32 over a vocabulary of 64.
testing::TinyModelOptions Tiny() {
  testing::TinyModelOptions options;
  options.n_layer = 2;
  options.n_embd = 32;
  options.vocab_size = 64;
  return options;
}

std::shared_ptr<testing::TinyModel> Build(const testing::TinyModelOptions& options, bool defer_values = false) {
  return std::make_shared<testing::TinyModel>(options, /*seed=*/5, LayerRanges{}, defer_values);
}

// Decayed (matrices) and not decayed parameters, as the trainer groups them.
std::vector<std::vector<at::Tensor>> Groups(torch::nn::Module& model) {
  std::vector<std::vector<at::Tensor>> groups(2);
  for (const auto& p : model.parameters()) groups[p.dim() >= 2 ? 0 : 1].push_back(p);
  return groups;
}

std::unique_ptr<torch::optim::Optimizer> MakeAdamW(const std::vector<std::vector<at::Tensor>>& groups) {
  std::vector<torch::optim::OptimizerParamGroup> param_groups;
  for (size_t g = 0; g < groups.size(); ++g) {
    auto options = std::make_unique<torch::optim::AdamWOptions>(1e-3);
    options->weight_decay(g == 0 ? 0.1 : 0.0);
    param_groups.emplace_back(groups[g], std::move(options));
  }
  return std::make_unique<torch::optim::AdamW>(param_groups);
}

struct Case {
  int stage, ranks, accumulation;
};

class ZeroParityTest : public ::testing::TestWithParam<Case> {};

// Each rank trains on its share of the batch; plain data parallelism averages
// whole gradients, ZeRO reduce-scatters them into chunks. Both take the same
// steps (to rounding: the sums add in another order, and Adam's normalisation
// turns that into weight differences of about 1e-6 at lr 1e-3) for 5 steps.
TEST_P(ZeroParityTest, StepsEqualPlainDataParallelism) {
  const Case c = GetParam();
  testing::RunOnRanks(c.ranks, [c](int rank) {
    auto topology = testing::JoinTopology({{"data", c.ranks}});
    ASSERT_TRUE(topology.ok()) << topology.status();
    const ProcessGroup& dp = **(*topology)->Group("dp");
    auto plain = Build(Tiny());
    auto sharded = Build(Tiny());
    auto plain_optimizer = MakeAdamW(Groups(*plain));
    ZeroOptions options;
    options.spec.set_stage(c.stage);
    options.layers = sharded.get();
    for (int64_t i = 0; i < sharded->NumLayers(); ++i) options.layer_indices.push_back(i);
    options.spec.set_reduce_bucket_bytes(16 << 10);    // several buckets
    options.spec.set_allgather_bucket_bytes(8 << 10);  // gathered a few at a time
    // Reduced and gathered in uneven slices; buckets over 12000 elements
    // (stage 3's blocks) reduced as soon as complete, smaller ones in flight.
    options.max_message_elements = 3000;
    auto zero = ZeroOptimizer::Create(Groups(*sharded), &dp, options, MakeAdamW);
    ASSERT_TRUE(zero.ok()) << zero.status();
    for (int step = 0; step < 5; ++step) {
      torch::manual_seed(100 + step);
      auto tokens = torch::randint(64, {c.ranks * c.accumulation * 2, 8}, torch::kLong);
      auto mine = tokens.chunk(c.ranks)[rank].chunk(c.accumulation);
      plain_optimizer->zero_grad();
      (*zero)->ZeroGrad();
      for (int m = 0; m < c.accumulation; ++m) {
        (plain->Loss(mine[m], mine[m]) / c.accumulation).backward();
        (*zero)->PrepareForBackward(m == c.accumulation - 1);
        (sharded->Loss(mine[m], mine[m]) / c.accumulation).backward();
      }
      for (auto& p : plain->parameters()) ASSERT_TRUE(dp.AllReduce(p.mutable_grad(), ReduceOp::kAvg).ok());
      plain_optimizer->step();
      ASSERT_TRUE((*zero)->FinishBackward().ok());
      ASSERT_TRUE((*zero)->Step(1e-3).ok());
    }
    ASSERT_TRUE((*zero)->GatherAllParameters().ok());
    auto expected = plain->named_parameters();
    for (const auto& item : sharded->named_parameters()) {
      const double diff = (item.value() - expected[item.key()]).abs().max().item<double>();
      EXPECT_LE(diff, 1e-5) << item.key();
    }
  });
}

INSTANTIATE_TEST_SUITE_P(StagesAndRanks, ZeroParityTest,
                         ::testing::Values(Case{1, 2, 1}, Case{2, 2, 1}, Case{1, 4, 1}, Case{2, 4, 1}, Case{2, 2, 3},
                                           Case{3, 2, 1}, Case{3, 4, 1}, Case{3, 2, 3}),
                         [](const auto& info) {
                           return "stage" + std::to_string(info.param.stage) + "_dp" +
                                  std::to_string(info.param.ranks) + "_accumulation" +
                                  std::to_string(info.param.accumulation);
                         });

// offload_optimizer=disk: every step reads each bucket's state from the file
// and writes it back, the update is the in-memory one bit for bit, no state
// stays in memory between steps, and ChunkState reads it where it lies.
TEST(ZeroOffloadTest, DiskOffloadStreamsTheStateAndUpdatesBitIdentically) {
  testing::RunOnRanks(2, [](int rank) {
    auto topology = testing::JoinTopology({{"data", 2}});
    ASSERT_TRUE(topology.ok()) << topology.status();
    const ProcessGroup& dp = **(*topology)->Group("dp");
    auto in_memory = Build(Tiny()), offloaded = Build(Tiny());
    ZeroOptions options;
    options.spec.set_stage(2);
    options.spec.set_reduce_bucket_bytes(16 << 10);
    auto reference = ZeroOptimizer::Create(Groups(*in_memory), &dp, options, MakeAdamW);
    options.spec.set_offload_optimizer(ZeroSpec::disk);
    options.spec.set_offload_dir(std::getenv("TEST_TMPDIR"));
    options.rank = rank;
    auto zero = ZeroOptimizer::Create(Groups(*offloaded), &dp, options, MakeAdamW);
    ASSERT_TRUE(reference.ok() && zero.ok()) << zero.status();
    constexpr int kSteps = 3;
    for (int step = 0; step < kSteps; ++step) {
      torch::manual_seed(100 + step);
      auto mine = torch::randint(64, {4, 8}, torch::kLong).chunk(2)[rank];
      for (auto* z : {&*reference, &*zero}) {
        (*z)->ZeroGrad();
        (*z)->PrepareForBackward(true);
      }
      in_memory->Loss(mine, mine).backward();
      offloaded->Loss(mine, mine).backward();
      for (auto* z : {&*reference, &*zero}) {
        ASSERT_TRUE((*z)->FinishBackward().ok());
        ASSERT_TRUE((*z)->Step(1e-3).ok());
      }
    }
    auto expected = in_memory->named_parameters();
    for (const auto& item : offloaded->named_parameters()) {
      EXPECT_TRUE(at::equal(item.value(), expected[item.key()])) << item.key();
    }
    // The same buckets on both: their chunks in the same order.
    auto offloaded_parts = (*zero)->ChunkParts(), held_parts = (*reference)->ChunkParts();
    ASSERT_TRUE(offloaded_parts.ok() && held_parts.ok());
    const std::vector<ParameterPart>&parts = *offloaded_parts, &reference_parts = *held_parts;
    ASSERT_EQ(parts.size(), reference_parts.size());
    int64_t state_bytes = 0;  // Adam's two moments of this rank's chunks
    for (size_t i = 0; i < parts.size(); ++i) {
      if (i > 0 && parts[i].updated.is_same(parts[i - 1].updated)) continue;
      auto state = (*zero)->ChunkState(parts[i].updated);
      ASSERT_TRUE(state.ok()) << state.status();
      const auto held = ElementwiseState((*reference)->optimizer(), reference_parts[i].updated);
      for (const char* name : {"exp_avg", "exp_avg_sq"}) {
        EXPECT_TRUE(at::equal(state->at(name), held.at(name))) << name;
        state_bytes += held.at(name).numel() * 4;
      }
    }
    const MemoryReport memory = (*zero)->Memory();
    EXPECT_EQ(memory.offload_bytes_written, kSteps * state_bytes);
    EXPECT_EQ(memory.offload_bytes_read, (kSteps - 1) * state_bytes);
    EXPECT_EQ(memory.optimizer_bytes, 0);
    EXPECT_EQ(memory.offloaded_optimizer_bytes, state_bytes);
  });
}

// offload_params=disk (stage 3): each rank's chunks live in a file at rest,
// are read for the layer's all-gathers and around the update, and the run is
// the in-memory one bit for bit, with and without the optimizer state on disk
// too. Checkpoints see the chunks where they lie (mapped) and can overwrite
// them there; a gathered change kept on release goes back to the file.
TEST(ZeroOffloadTest, DiskOffloadedParametersStreamAndUpdateBitIdentically) {
  for (bool state_too : {false, true}) {
    testing::RunOnRanks(2, [state_too](int rank) {
      auto topology = testing::JoinTopology({{"data", 2}});
      ASSERT_TRUE(topology.ok()) << topology.status();
      const ProcessGroup& dp = **(*topology)->Group("dp");
      auto in_memory = Build(Tiny()), offloaded = Build(Tiny());
      ZeroOptions options;
      options.spec.set_stage(3);
      options.layers = in_memory.get();
      for (int64_t i = 0; i < in_memory->NumLayers(); ++i) options.layer_indices.push_back(i);
      auto reference = ZeroOptimizer::Create(Groups(*in_memory), &dp, options, MakeAdamW);
      options.layers = offloaded.get();
      options.spec.set_offload_params(ZeroSpec::disk);
      if (state_too) options.spec.set_offload_optimizer(ZeroSpec::disk);
      options.spec.set_offload_dir(std::getenv("TEST_TMPDIR"));
      options.rank = rank;
      auto zero = ZeroOptimizer::Create(Groups(*offloaded), &dp, options, MakeAdamW);
      ASSERT_TRUE(reference.ok() && zero.ok()) << zero.status();
      const MemoryReport before = (*zero)->Memory(), held = (*reference)->Memory();
      EXPECT_GT(before.offloaded_parameter_bytes, 0);
      EXPECT_EQ(before.parameter_bytes + before.offloaded_parameter_bytes, held.parameter_bytes);
      for (int step = 0; step < 3; ++step) {
        torch::manual_seed(100 + step);
        auto mine = torch::randint(64, {4, 8}, torch::kLong).chunk(2)[rank];
        for (auto* z : {&*reference, &*zero}) {
          (*z)->ZeroGrad();
          (*z)->PrepareForBackward(true);
        }
        const at::Tensor expected_loss = in_memory->Loss(mine, mine), loss = offloaded->Loss(mine, mine);
        EXPECT_TRUE(at::equal(loss, expected_loss)) << "step " << step;
        expected_loss.backward();
        loss.backward();
        for (auto* z : {&*reference, &*zero}) {
          ASSERT_TRUE((*z)->FinishBackward().ok());
          ASSERT_TRUE((*z)->Step(1e-3).ok());
        }
      }
      // What a checkpoint reads, and writes back.
      ASSERT_TRUE((*zero)->WaitForUpdatedParameters().ok());
      auto parts = (*zero)->ChunkParts(), reference_parts = (*reference)->ChunkParts();
      ASSERT_TRUE(parts.ok() && reference_parts.ok()) << parts.status();
      ASSERT_EQ(parts->size(), reference_parts->size());
      for (size_t i = 0; i < parts->size(); ++i) {
        EXPECT_EQ((*parts)[i].updated.storage().nbytes(), 0u) << "a chunk stayed in memory";
        EXPECT_TRUE(at::equal((*parts)[i].values, (*reference_parts)[i].values)) << i;
      }
      (*parts)[0].values.narrow(0, 0, 1).fill_(0.5);
      (*reference_parts)[0].values.narrow(0, 0, 1).fill_(0.5);
      parts->clear();
      for (auto [model, z] : {std::pair{offloaded.get(), zero->get()}, {in_memory.get(), reference->get()}}) {
        ASSERT_TRUE(z->GatherAllParameters().ok());
        for (auto& p : model->parameters()) p.detach().mul_(2.0);
        ASSERT_TRUE(z->ReleaseAllParameters(/*keep_changes=*/true).ok());
        ASSERT_TRUE(z->GatherAllParameters().ok());
      }
      auto expected = in_memory->named_parameters();
      for (const auto& item : offloaded->named_parameters()) {
        EXPECT_TRUE(at::equal(item.value(), expected[item.key()])) << item.key();
      }
      const MemoryReport after = (*zero)->Memory();
      // Each chunk read at least for the forward and the update of each of the
      // 3 steps (and the state for the updates of steps 2 and 3).
      const int64_t state_read = state_too ? 2 * after.offloaded_optimizer_bytes : 0;
      EXPECT_GE(after.offload_bytes_read, 3 * 2 * before.offloaded_parameter_bytes + state_read);
      EXPECT_EQ(after.offloaded_optimizer_bytes > 0, state_too);
    });
  }
}

// Wrapped layers form one unit while adjacent, a layer without parameters
// joins the unit before it, and small units merge up to min_num_params but
// never across a gap in the layer indices (another pipeline chunk).
TEST(ZeroGatherUnitsTest, WrapAndSizePoliciesMergeAdjacentLayers) {
  // Parameters: 0 wte, 1-2 h.0, 3 h.1, 4 h.2, 5 ln_f; layers 0-4 then 8.
  const std::vector<std::string> names = {"wte.weight", "h.0.a", "h.0.b", "h.1.a", "h.2.a", "ln_f.weight"};
  const std::vector<int64_t> numels = {100, 10, 10, 30, 40, 5};
  const std::vector<std::pair<int64_t, std::vector<int>>> reads = {{0, {0}}, {1, {1, 2}}, {2, {3}},
                                                                   {3, {}},  {4, {4}},    {8, {5}}};
  auto layers_of = [](const ZeroGatherUnits& units) {
    std::vector<std::vector<int64_t>> layers = units.layers;
    EXPECT_EQ(units.reads.size(), layers.size());
    for (size_t u = 0; u < layers.size(); ++u) EXPECT_EQ(units.reads[u].first, layers[u].front());
    return layers;
  };
  ZeroSpec spec;
  using Units = std::vector<std::vector<int64_t>>;
  EXPECT_EQ(layers_of(PlanGatherUnits(spec, reads, names, numels)), (Units{{0}, {1}, {2, 3}, {4}, {8}}));
  spec.add_wrap("h");
  const ZeroGatherUnits wrapped = PlanGatherUnits(spec, reads, names, numels);
  EXPECT_EQ(layers_of(wrapped), (Units{{0}, {1, 2, 3, 4}, {8}}));
  EXPECT_EQ(wrapped.reads[1].second, (std::vector<int>{1, 2, 3, 4}));
  spec.clear_wrap();
  spec.set_min_num_params(25);
  EXPECT_EQ(layers_of(PlanGatherUnits(spec, reads, names, numels)), (Units{{0}, {1, 2, 3}, {4}, {8}}));
  spec.set_min_num_params(1000);
  EXPECT_EQ(layers_of(PlanGatherUnits(spec, reads, names, numels)), (Units{{0, 1, 2, 3, 4}, {8}}));
}

TEST(ZeroGatherUnitsTest, AWrapNameThatMatchesNoLayerIsRefused) {
  testing::RunOnRanks(1, [](int) {
    auto topology = testing::JoinTopology({{"data", 1}});
    ASSERT_TRUE(topology.ok()) << topology.status();
    auto model = Build(Tiny());
    ZeroOptions options;
    options.spec.set_stage(3);
    options.spec.add_wrap("transformer.blocks");
    options.layers = model.get();
    for (int64_t i = 0; i < model->NumLayers(); ++i) options.layer_indices.push_back(i);
    auto zero = ZeroOptimizer::Create(Groups(*model), *(*topology)->Group("dp"), options, MakeAdamW);
    ASSERT_FALSE(zero.ok());
    EXPECT_THAT(std::string(zero.status().message()), HasSubstr("wrap (atorch_wrap_cls) 'transformer.blocks'"));
  });
}

TEST(ZeroOffloadTest, ParameterOffloadNeedsStageThree) {
  testing::RunOnRanks(1, [](int) {
    auto topology = testing::JoinTopology({{"data", 1}});
    ASSERT_TRUE(topology.ok()) << topology.status();
    auto model = Build(Tiny());
    ZeroOptions options;
    options.spec.set_stage(2);
    options.spec.set_offload_params(ZeroSpec::disk);
    auto zero = ZeroOptimizer::Create(Groups(*model), *(*topology)->Group("dp"), options, MakeAdamW);
    ASSERT_FALSE(zero.ok());
    EXPECT_THAT(std::string(zero.status().message()), HasSubstr("offload_params=disk needs zero_stage=3"));
  });
}

// Given the layers, Step only starts its all-gathers, and each layer finishes
// those of the buckets it reads before it runs: the embedding's first, the
// rest as the forward goes on. The weights are those of a Step that gathers
// everything before it returns (without the layers), bit for bit.
TEST(ZeroGatherTest, LayersFinishTheAllGathersStepStarted) {
  for (int stage : {1, 2}) {
    testing::RunOnRanks(2, [stage](int rank) {
      auto topology = testing::JoinTopology({{"data", 2}});
      ASSERT_TRUE(topology.ok()) << topology.status();
      const ProcessGroup& dp = **(*topology)->Group("dp");
      auto deferred = Build(Tiny());
      auto gathered = Build(Tiny());
      ZeroOptions options;
      options.spec.set_stage(stage);
      options.spec.set_reduce_bucket_bytes(16 << 10);  // several buckets
      options.max_message_elements = 3000;             // several messages
      auto at_once = ZeroOptimizer::Create(Groups(*gathered), &dp, options, MakeAdamW);
      options.layers = deferred.get();
      for (int64_t i = 0; i < deferred->NumLayers(); ++i) options.layer_indices.push_back(i);
      auto by_layer = ZeroOptimizer::Create(Groups(*deferred), &dp, options, MakeAdamW);
      ASSERT_TRUE(at_once.ok() && by_layer.ok()) << at_once.status() << by_layer.status();
      for (int step = 0; step < 3; ++step) {
        torch::manual_seed(100 + step);
        auto tokens = torch::randint(64, {4, 8}, torch::kLong).chunk(2)[rank];
        for (auto [model, zero] : {std::pair{deferred.get(), by_layer->get()}, {gathered.get(), at_once->get()}}) {
          zero->ZeroGrad();
          zero->PrepareForBackward(true);
          model->Loss(tokens, tokens).backward();
          EXPECT_EQ(zero->GathersUnderWay(), 0u);  // the forward finished them
          ASSERT_TRUE(zero->FinishBackward().ok());
          ASSERT_TRUE(zero->Step(1e-3).ok());
        }
        EXPECT_EQ((*at_once)->GathersUnderWay(), 0u);
        const size_t started = (*by_layer)->GathersUnderWay();
        EXPECT_GT(started, 2u);
        c10::NoGradGuard no_grad;
        deferred->RunLayer(0, {}, {tokens, tokens});  // the embedding's columns only
        EXPECT_LT((*by_layer)->GathersUnderWay(), started);
        EXPECT_GT((*by_layer)->GathersUnderWay(), 0u);
      }
      ASSERT_TRUE((*by_layer)->WaitForUpdatedParameters().ok());
      EXPECT_EQ((*by_layer)->GathersUnderWay(), 0u);
      auto expected = gathered->named_parameters();
      for (const auto& item : deferred->named_parameters()) {
        EXPECT_TRUE(at::equal(item.value(), expected[item.key()])) << "stage " << stage << ": " << item.key();
      }
    });
  }
}

// At dp = 4 each rank holds a quarter of the optimizer state (stage 1) and of
// the gradients too (stage 2, plus one bucket being filled).
TEST(ZeroMemoryTest, StagesShrinkPerRankBytesByTheGroupSize) {
  testing::RunOnRanks(4, [](int) {
    auto topology = testing::JoinTopology({{"data", 4}});
    ASSERT_TRUE(topology.ok());
    const ProcessGroup& dp = **(*topology)->Group("dp");
    int64_t parameter_bytes = 0, largest = 0;
    {
      auto model = Build(Tiny());
      for (const auto& p : model->parameters()) {
        parameter_bytes += p.numel() * 4;
        largest = std::max<int64_t>(largest, p.numel() * 4);
      }
    }
    std::vector<MemoryReport> reports;
    for (int stage : {1, 2, 3}) {
      auto model = Build(Tiny());
      ZeroOptions options;
      options.spec.set_stage(stage);
      options.layers = model.get();
      for (int64_t i = 0; i < model->NumLayers(); ++i) options.layer_indices.push_back(i);
      options.spec.set_reduce_bucket_bytes(8 << 10);
      auto zero = *ZeroOptimizer::Create(Groups(*model), &dp, options, MakeAdamW);
      model->Loss(torch::zeros({2, 8}, torch::kLong), torch::zeros({2, 8}, torch::kLong)).backward();
      ASSERT_TRUE(zero->FinishBackward().ok());
      ASSERT_TRUE(zero->Step(1e-3).ok());  // the optimizer state now exists
      reports.push_back(zero->Memory());
      std::printf("stage %d: %s (plain: parameters, gradients %.1f MB each, state %.1f MB)\n", stage,
                  reports.back().ToString().c_str(), parameter_bytes / 1e6, 2 * parameter_bytes / 1e6);
    }
    // Padding adds at most a few elements per bucket.
    EXPECT_NEAR(reports[0].optimizer_bytes, 2 * parameter_bytes / 4.0, 0.01 * parameter_bytes);
    // Stage 1 keeps whole gradients, its reduced chunk inside them.
    EXPECT_NEAR(reports[0].gradient_bytes, parameter_bytes, 0.01 * parameter_bytes);
    EXPECT_NEAR(reports[1].optimizer_bytes, reports[0].optimizer_bytes, 0);
    // Stage 2: a quarter of the gradients, plus the one bucket being filled (at
    // most the bucket size, or one parameter larger than it).
    EXPECT_LE(reports[1].gradient_bytes, 1.01 * parameter_bytes / 4 + std::max<int64_t>(8 << 10, largest));
    // Stage 3: a quarter of the parameters at rest too.
    EXPECT_NEAR(reports[2].parameter_bytes, parameter_bytes / 4.0, 0.01 * parameter_bytes);
    EXPECT_NEAR(reports[1].parameter_bytes, parameter_bytes, 0.01 * parameter_bytes);
  });
}

// Stage 3 between forward and backward: the views autograd keeps of the
// gathered weights (the products' transposed matrices) hold no memory once
// their layer is released, so a model of large weights and few activations
// keeps far less than its parameters.
TEST(ZeroMemoryTest, StageThreeKeepsNoGatheredWeightsForBackward) {
  testing::RunOnRanks(2, [](int) {
    auto topology = testing::JoinTopology({{"data", 2}});
    ASSERT_TRUE(topology.ok());
    testing::TinyModelOptions config = Tiny();
    config.n_embd = 256;
    MemoryCounter& memory = MemoryCounter::Install();
    auto model = Build(config);
    int64_t parameter_bytes = 0;
    for (const auto& p : model->parameters()) parameter_bytes += p.numel() * 4;
    ZeroOptions options;
    options.spec.set_stage(3);
    options.layers = model.get();
    for (int64_t i = 0; i < model->NumLayers(); ++i) options.layer_indices.push_back(i);
    auto zero = *ZeroOptimizer::Create(Groups(*model), &**(*topology)->Group("dp"), options, MakeAdamW);
    const int64_t before = memory.live_bytes();
    at::Tensor loss = model->Loss(torch::zeros({1, 2}, torch::kLong), torch::zeros({1, 2}, torch::kLong));
    const int64_t kept = memory.live_bytes() - before;
    std::printf("kept for backward: %lld bytes; parameters %lld bytes\n", static_cast<long long>(kept),
                static_cast<long long>(parameter_bytes));
    EXPECT_LT(kept, parameter_bytes / 10);
    loss.backward();
    EXPECT_TRUE(zero->FinishBackward().ok());
    MemoryCounter::Uninstall();
  });
}

// Backward releases a block as soon as its gradients have all arrived: when
// any parameter's gradient is computed, only the block it belongs to holds
// its parameters (the one below is at most being prefetched, invisibly).
TEST(ZeroMemoryTest, StageThreeHoldsOneBlockInBackward) {
  testing::RunOnRanks(2, [](int) {
    auto topology = testing::JoinTopology({{"data", 2}});
    ASSERT_TRUE(topology.ok());
    testing::TinyModelOptions config = Tiny();
    config.n_layer = 4;
    auto model = Build(config);
    ZeroOptions options;
    options.spec.set_stage(3);
    options.layers = model.get();
    for (int64_t i = 0; i < model->NumLayers(); ++i) options.layer_indices.push_back(i);
    auto zero = *ZeroOptimizer::Create(Groups(*model), &**(*topology)->Group("dp"), options, MakeAdamW);
    auto gathered_blocks = [&] {
      int gathered = 0;
      for (int64_t i = 1; i <= config.n_layer; ++i) {
        const NamedTensors params = model->LayerParameters(i);
        gathered +=
            std::any_of(params.begin(), params.end(), [](const auto& named) { return named.second.numel() > 0; });
      }
      return gathered;
    };
    int most_gathered = 0, hooks_run = 0;
    std::vector<at::Tensor> block_params;
    for (int64_t i = 1; i <= config.n_layer; ++i) {
      for (const auto& [name, p] : model->LayerParameters(i)) block_params.push_back(p);
    }
    for (at::Tensor& p : block_params) {
      p.register_hook([&](const at::Tensor&) {
        most_gathered = std::max(most_gathered, gathered_blocks());
        ++hooks_run;
      });
    }
    for (int step = 0; step < 2; ++step) {
      zero->ZeroGrad();
      zero->PrepareForBackward(true);
      at::Tensor tokens = torch::randint(64, {2, 8}, torch::kLong);
      model->Loss(tokens, tokens).backward();
      ASSERT_TRUE(zero->FinishBackward().ok());
      EXPECT_EQ(gathered_blocks(), 0);
    }
    EXPECT_EQ(hooks_run, 2 * static_cast<int>(block_params.size()));
    EXPECT_EQ(most_gathered, 1);
  });
}

// Buckets smaller than a block (reduce_bucket_bytes): each is gathered in
// backward just before the first node reading it runs and released once its
// gradients arrive, so when either matrix of a block gets its gradient the
// other is not gathered (fc2's is computed first; fc1's is needed only
// after), in the first backward and in those that prefetch along the order
// the first one found; at most one whole gradient at a time
// (max_inflight_reduce_scatters 1: fc2's reduce-scatter is settled before
// fc1's gradient is made); and the steps still equal one process's.
TEST(ZeroMemoryTest, StageThreeGathersAPartOfABlockInBackward) {
  testing::RunOnRanks(2, [](int rank) {
    auto topology = testing::JoinTopology({{"data", 2}});
    ASSERT_TRUE(topology.ok());
    const ProcessGroup& dp = **(*topology)->Group("dp");
    testing::TinyModelOptions config = Tiny();
    config.n_layer = 3;
    auto model = Build(config);
    auto plain = Build(config);
    auto plain_optimizer = MakeAdamW(Groups(*plain));
    ZeroOptions options;
    options.spec.set_stage(3);
    options.spec.set_reduce_bucket_bytes(16 << 10);  // a block's matrices, 16 KiB each, in two buckets
    options.layers = model.get();
    for (int64_t i = 0; i < model->NumLayers(); ++i) options.layer_indices.push_back(i);
    auto zero = *ZeroOptimizer::Create(Groups(*model), &dp, options, MakeAdamW);
    int checked = 0, settled = 0;
    for (int64_t i = 1; i <= config.n_layer; ++i) {
      const NamedTensors params = model->LayerParameters(i);
      auto find = [&](const std::string& suffix) {
        return std::find_if(params.begin(), params.end(),
                            [&](const auto& p) {
                              return p.first.size() >= suffix.size() &&
                                     p.first.compare(p.first.size() - suffix.size(), suffix.size(), suffix) == 0;
                            })
            ->second;
      };
      at::Tensor fc1 = find("fc1.weight"), fc2 = find("fc2.weight");
      fc2.register_hook([fc1, &checked](const at::Tensor&) { checked += fc1.numel() == 0; });
      // fc1's gradient counts as the one whole gradient allowed: fc2's
      // reduce-scatter was settled before fc1's reader ran.
      fc1.register_hook([fc2, &checked, &settled, zero = zero.get()](const at::Tensor&) {
        checked += fc2.numel() == 0;
        settled += zero->ReduceScattersUnderWay() == 0;
      });
    }
    for (int step = 0; step < 3; ++step) {
      torch::manual_seed(10 + step);
      at::Tensor tokens = torch::randint(64, {4, 8}, torch::kLong);
      at::Tensor mine = tokens.chunk(2)[rank];
      zero->ZeroGrad();
      zero->PrepareForBackward(true);
      model->Loss(mine, mine).backward();
      ASSERT_TRUE(zero->FinishBackward().ok());
      ASSERT_TRUE(zero->Step(1e-3).ok());
      plain_optimizer->zero_grad();
      plain->Loss(mine, mine).backward();
      for (auto& p : plain->parameters()) ASSERT_TRUE(dp.AllReduce(p.mutable_grad(), ReduceOp::kAvg).ok());
      plain_optimizer->step();
    }
    EXPECT_EQ(checked, 3 * 2 * static_cast<int>(config.n_layer));
    EXPECT_EQ(settled, 3 * static_cast<int>(config.n_layer));
    ASSERT_TRUE(zero->GatherAllParameters().ok());
    auto expected = plain->named_parameters();
    for (const auto& item : model->named_parameters()) {
      EXPECT_LE((item.value() - expected[item.key()]).abs().max().item<double>(), 1e-5) << item.key();
    }
  });
}

// A model built with deferred values: stage 3 draws each layer's values just
// before slicing it and frees them before drawing the next, so no more than
// one layer's values are ever whole on a rank; the chunks equal those of the
// model built whole.
class MaterializationWatcher : public LayerSequence {
 public:
  explicit MaterializationWatcher(testing::TinyModel& model) : model_(model) {}
  int64_t NumLayers() const override { return model_.NumLayers(); }
  std::string LayerName(int64_t i) const override { return model_.LayerName(i); }
  Values ForwardLayer(int64_t i, const Values& inputs, const Batch& batch) override {
    return model_.ForwardLayer(i, inputs, batch);
  }
  NamedTensors LayerParameters(int64_t i) override { return model_.LayerParameters(i); }
  void MaterializeLayer(int64_t i) override {  // once per bucket
    if (order.empty() || order.back() != i) order.push_back(i);
    for (int64_t earlier = 0; earlier < i; ++earlier) {
      for (const auto& [name, p] : model_.LayerParameters(earlier)) whole_when_drawing += p.numel() > 0;
    }
    model_.MaterializeLayer(i);
  }
  std::vector<int64_t> order;
  int whole_when_drawing = 0;

 private:
  testing::TinyModel& model_;
};

TEST(ZeroStageThreeTest, DeferredValuesAreDrawnAndShardedLayerByLayer) {
  testing::RunOnRanks(2, [](int) {
    auto topology = testing::JoinTopology({{"data", 2}});
    ASSERT_TRUE(topology.ok());
    const ProcessGroup& dp = **(*topology)->Group("dp");
    testing::TinyModelOptions config = Tiny();
    auto model = Build(config, /*defer_values=*/true);
    auto whole = Build(config);
    MaterializationWatcher watcher(*model);
    ZeroOptions options;
    options.spec.set_stage(3);
    options.layers = &watcher;
    for (int64_t i = 0; i < model->NumLayers(); ++i) options.layer_indices.push_back(i);
    auto zero = *ZeroOptimizer::Create(Groups(*model), &dp, options, MakeAdamW);
    std::vector<int64_t> layers(model->NumLayers());
    std::iota(layers.begin(), layers.end(), 0);
    EXPECT_EQ(watcher.order, layers);
    EXPECT_EQ(watcher.whole_when_drawing, 0);
    ASSERT_TRUE(zero->GatherAllParameters().ok());
    auto expected = whole->named_parameters();
    for (const auto& item : model->named_parameters()) {
      EXPECT_TRUE(torch::equal(item.value(), expected[item.key()])) << item.key();
    }
    ASSERT_TRUE(zero->ReleaseAllParameters(/*keep_changes=*/false).ok());
  });
}

// Two layers, the first passing its transposed weight on to the second, as a
// traced shard may pass on a view it made of its parameter.
class ViewPassingLayers : public LayerSequence, public torch::nn::Module {
 public:
  ViewPassingLayers() {
    torch::manual_seed(3);
    first = register_parameter("first", torch::randn({4, 4}));
    second = register_parameter("second", torch::randn({4, 4}));
  }
  int64_t NumLayers() const override { return 2; }
  std::string LayerName(int64_t i) const override { return i == 0 ? "first" : "second"; }
  Values ForwardLayer(int64_t i, const Values& inputs, const Batch& batch) override {
    if (i == 0) return {torch::mm(batch.at(0), first.t()), first.t()};
    return {torch::mm(inputs.at(0), inputs.at(1)) + torch::mm(inputs.at(0), second)};
  }
  NamedTensors LayerParameters(int64_t i) override {
    return {i == 0 ? std::make_pair(std::string("first"), first) : std::make_pair(std::string("second"), second)};
  }
  at::Tensor Loss(const Values& outputs, const Batch&) override { return outputs.at(0).square().mean(); }
  at::Tensor first, second;
};

// Stage 3 releases the first layer's bucket while the second still reads the
// view passed on to it, in forward and in backward: it keeps its values, and
// one SGD step equals one process's.
TEST(ZeroStageThreeTest, ViewsPassedToTheNextLayerKeepTheirValues) {
  testing::RunOnRanks(2, [](int) {
    auto topology = testing::JoinTopology({{"data", 2}});
    ASSERT_TRUE(topology.ok());
    ViewPassingLayers plain, sharded;
    ZeroOptions options;
    options.spec.set_stage(3);
    options.layers = &sharded;
    options.layer_indices = {0, 1};
    options.spec.set_reduce_bucket_bytes(16);  // a bucket per parameter
    auto make_sgd = [](const std::vector<std::vector<at::Tensor>>& groups) -> std::unique_ptr<torch::optim::Optimizer> {
      return std::make_unique<torch::optim::SGD>(groups.at(0), torch::optim::SGDOptions(0.1));
    };
    auto zero = ZeroOptimizer::Create({sharded.parameters()}, &**(*topology)->Group("dp"), options, make_sgd);
    ASSERT_TRUE(zero.ok()) << zero.status();
    const Batch batch = {torch::ones({3, 4})};
    auto run = [&](LayerSequence& model) {
      const Values hidden = model.RunLayer(0, {}, batch);
      return model.Loss(model.RunLayer(1, hidden, batch), batch);
    };
    (*zero)->ZeroGrad();
    (*zero)->PrepareForBackward(true);
    run(sharded).backward();
    ASSERT_TRUE((*zero)->FinishBackward().ok());
    ASSERT_TRUE((*zero)->Step(0.1).ok());
    run(plain).backward();
    torch::optim::SGD(plain.parameters(), torch::optim::SGDOptions(0.1)).step();
    ASSERT_TRUE((*zero)->GatherAllParameters().ok());
    EXPECT_TRUE(torch::allclose(sharded.first, plain.first, 1e-6, 1e-6));
    EXPECT_TRUE(torch::allclose(sharded.second, plain.second, 1e-6, 1e-6));
    EXPECT_FALSE(torch::allclose(sharded.first, ViewPassingLayers().first)) << "the step changes the weights";
  });
}

TEST(ZeroOptimizerTest, UntestedOptimizersAreRefusedUnlessAllowed) {
  testing::RunOnRanks(2, [](int) {
    auto topology = testing::JoinTopology({{"data", 2}});
    ASSERT_TRUE(topology.ok());
    const ProcessGroup& dp = **(*topology)->Group("dp");
    auto rmsprop = [](const std::vector<std::vector<at::Tensor>>& groups) {
      std::vector<at::Tensor> all;
      for (const auto& g : groups) all.insert(all.end(), g.begin(), g.end());
      return std::unique_ptr<torch::optim::Optimizer>(new torch::optim::RMSprop(all));
    };
    auto model = Build(Tiny());
    ZeroOptions options;
    options.spec.set_stage(1);
    EXPECT_THAT(std::string(ZeroOptimizer::Create(Groups(*model), &dp, options, rmsprop).status().message()),
                HasSubstr("set zero_allow_untested_optimizer"));
    options.spec.set_allow_untested_optimizer(true);
    auto other = Build(Tiny());
    EXPECT_TRUE(ZeroOptimizer::Create(Groups(*other), &dp, options, rmsprop).ok());
    options.spec.set_stage(4);
    auto fourth = Build(Tiny());
    EXPECT_THAT(std::string(ZeroOptimizer::Create(Groups(*fourth), &dp, options, rmsprop).status().message()),
                HasSubstr("zero_stage=4 is not available"));
    options.spec.set_stage(3);
    EXPECT_THAT(std::string(ZeroOptimizer::Create(Groups(*fourth), &dp, options, rmsprop).status().message()),
                HasSubstr("needs the model's layers"));
  });
}

}  // namespace
}  // namespace trident
