// GraphLayers recomputing ATorch's checkpoint modules (attn, mlp) on the zoo's traced GPT.
#include "graph/graph_layers.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "base/memory_counter.h"
#include "models/models.h"

namespace trident {
namespace {

using ::testing::HasSubstr;

struct TracedGpt {
  std::shared_ptr<LanguageModel> model;
  std::shared_ptr<ModelGraph> graph;
  std::map<std::string, std::string> module_types;
  at::Tensor tokens;
};

// gpt-tiny with two blocks and dropout, traced with its loss.
TracedGpt TraceGpt() {
  ModelConfig config = *PresetModelConfig("gpt", "gpt-tiny");
  config.n_layer = 2;
  config.dropout = 0.1;
  TracedGpt traced;
  traced.model = *CreateModel(config, 4);
  traced.tokens = torch::randint(config.vocab_size, {2, 32}, torch::kLong);
  auto graph = ModelGraph::Trace(*traced.model, {traced.tokens, traced.tokens}, [&](const std::vector<at::Tensor>& in) {
    return std::vector<at::Tensor>{traced.model->Loss(in[0], in[1])};
  });
  EXPECT_TRUE(graph.ok()) << graph.status();
  traced.graph = std::move(*graph);
  for (const auto& item : traced.model->named_modules()) traced.module_types[item.key()] = item.value()->name();
  return traced;
}

// The loss and the parameters' gradients of one pass through `layers`, and
// the bytes the forward left alive for backward.
std::map<std::string, at::Tensor> RunLayers(GraphLayers& layers, const TracedGpt& traced, int64_t* kept) {
  for (auto& p : traced.model->parameters()) p.mutable_grad() = at::Tensor();
  MemoryCounter& memory = MemoryCounter::Install();
  torch::manual_seed(5);
  const int64_t before = memory.live_bytes();
  Values values;
  for (int64_t i = 0; i < layers.NumLayers(); ++i) values = layers.RunLayer(i, values, {traced.tokens, traced.tokens});
  *kept = memory.live_bytes() - before;
  MemoryCounter::Uninstall();
  values.at(0).backward();
  std::map<std::string, at::Tensor> grads = {{"loss", values[0].detach().clone()}};
  for (const auto& item : traced.model->named_parameters()) grads[item.key()] = item.value().grad().clone();
  return grads;
}

// ATorch's checkpoint method on a traced graph: the attention and MLP
// modules' operators, found by name or class, recompute in backward with the
// same loss and gradients (dropout masks drawn again alike), in one shard and
// cut across two, and keep fewer bytes for backward.
TEST(GraphLayersTest, RecomputedModuleSpansGiveTheSameGradientsAndKeepLess) {
  TracedGpt traced = TraceGpt();
  const int64_t count = static_cast<int64_t>(traced.graph->nodes().size());
  auto by_name = FindModuleSpans(*traced.graph, {"attn", "mlp"}, traced.module_types);
  ASSERT_TRUE(by_name.ok()) << by_name.status();
  EXPECT_EQ(by_name->hits, (std::vector<int>{2, 2}));
  EXPECT_EQ(by_name->spans.size(), 4u) << "attention and MLP of each block, apart";
  auto by_class = FindModuleSpans(*traced.graph, {"CausalSelfAttention", "Mlp"}, traced.module_types);
  ASSERT_TRUE(by_class.ok()) << by_class.status();
  EXPECT_EQ(by_class->hits, (std::vector<int>{2, 2}));
  ASSERT_EQ(by_class->spans.size(), by_name->spans.size());
  for (size_t s = 0; s < by_name->spans.size(); ++s) {
    EXPECT_EQ(by_class->spans[s].first, by_name->spans[s].first);
    EXPECT_EQ(by_class->spans[s].end, by_name->spans[s].end);
  }
  // A cut inside the second block's attention: its span runs in two pieces.
  const NodeSpan second = by_name->spans[2];
  int64_t inside = 0;
  for (int64_t p = second.first + 1; p < second.end && inside == 0; ++p) {
    if (traced.graph->CrossingTensors(p)) inside = p;
  }
  ASSERT_GT(inside, 0);
  for (const std::vector<int64_t>& boundaries : {std::vector<int64_t>{0, count}, {0, inside, count}}) {
    SCOPED_TRACE(boundaries.size() - 1);
    auto plain = GraphLayers::Create(traced.graph, boundaries);
    auto recomputing = GraphLayers::Create(traced.graph, boundaries, by_name->spans);
    ASSERT_TRUE(plain.ok() && recomputing.ok());
    int64_t kept_plain = 0, kept_recomputed = 0;
    auto expected = RunLayers(**plain, traced, &kept_plain);
    auto got = RunLayers(**recomputing, traced, &kept_recomputed);
    for (const auto& [name, tensor] : expected) EXPECT_TRUE(torch::equal(got.at(name), tensor)) << name;
    EXPECT_LT(kept_recomputed, kept_plain / 2);
    std::printf("traced gpt-tiny, %zu shard(s): bytes kept for backward %lld plain, %lld recomputing attn and mlp\n",
                boundaries.size() - 1, static_cast<long long>(kept_plain), static_cast<long long>(kept_recomputed));
  }
}

TEST(GraphLayersTest, ModulesThatAreNotOneRunOfOperatorsAreRefused) {
  TracedGpt traced = TraceGpt();
  // The token embedding is the head too (tied): its readers span the model.
  auto tied = FindModuleSpans(*traced.graph, {"wte"}, traced.module_types);
  ASSERT_FALSE(tied.ok());
  EXPECT_THAT(std::string(tied.status().message()),
              HasSubstr("module 'transformer.wte' is not one run of operators in the traced graph"));
  auto missing = FindModuleSpans(*traced.graph, {"attn", "atn"}, traced.module_types);
  ASSERT_TRUE(missing.ok());
  EXPECT_EQ(missing->hits, (std::vector<int>{2, 0}));
}

}  // namespace
}  // namespace trident
