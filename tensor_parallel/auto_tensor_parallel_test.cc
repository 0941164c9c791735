// The automatic pass on traced C++ models written without any tensor-parallel
// code (a GPT with a fused q, k, v projection and tied embeddings; a Llama
// with RMSNorm, rotary embeddings, grouped-query attention and SwiGLU): on 2
// and 4 ranks the loss and every gradient equal one process's, and the plan
// is Megatron's.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

#include "graph/model_graph.h"
#include "tensor_parallel/tensor_parallel.h"
#include "testing/multiprocess.h"

namespace trident {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

struct Sizes {
  int64_t vocab = 64, block = 8, embd = 32, heads = 4, kv_heads = 2, layers = 2;
  bool computed_ids = false;  // GPT: token ids computed from the input, not the input itself
};

at::Tensor CausalScores(const at::Tensor& q, const at::Tensor& k) {
  const int64_t T = q.size(2);
  at::Tensor scores = q.matmul(k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(q.size(3))));
  at::Tensor above = at::ones({T, T}, at::kBool).triu(1);
  return at::softmax(scores.masked_fill(above, -INFINITY), -1);
}

struct GptBlockImpl : torch::nn::Module {
  explicit GptBlockImpl(const Sizes& s) : heads(s.heads) {
    ln_1 = register_module("ln_1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({s.embd})));
    c_attn = register_module("c_attn", torch::nn::Linear(s.embd, 3 * s.embd));
    c_proj = register_module("c_proj", torch::nn::Linear(s.embd, s.embd));
    ln_2 = register_module("ln_2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({s.embd})));
    c_fc = register_module("c_fc", torch::nn::Linear(s.embd, 4 * s.embd));
    mlp_proj = register_module("mlp_proj", torch::nn::Linear(4 * s.embd, s.embd));
  }
  at::Tensor forward(at::Tensor x) {
    const int64_t B = x.size(0), T = x.size(1), C = x.size(2);
    auto qkv = c_attn(ln_1(x)).split(C, 2);
    auto heads_of = [&](const at::Tensor& t) { return t.view({B, T, heads, C / heads}).transpose(1, 2); };
    at::Tensor y = CausalScores(heads_of(qkv[0]), heads_of(qkv[1])).matmul(heads_of(qkv[2]));
    x = x + c_proj(y.transpose(1, 2).contiguous().view({B, T, C}));
    return x + mlp_proj(torch::gelu(c_fc(ln_2(x))));
  }
  int64_t heads;
  torch::nn::LayerNorm ln_1{nullptr}, ln_2{nullptr};
  torch::nn::Linear c_attn{nullptr}, c_proj{nullptr}, c_fc{nullptr}, mlp_proj{nullptr};
};
TORCH_MODULE(GptBlock);

struct GptImpl : torch::nn::Module {
  explicit GptImpl(const Sizes& s) : computed_ids(s.computed_ids) {
    wte = register_module("wte", torch::nn::Embedding(s.vocab, s.embd));
    wpe = register_module("wpe", torch::nn::Embedding(s.block, s.embd));
    h = register_module("h", torch::nn::ModuleList());
    for (int64_t i = 0; i < s.layers; ++i) h->push_back(GptBlock(s));
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({s.embd})));
  }
  at::Tensor forward(const at::Tensor& idx, const at::Tensor& targets) {
    at::Tensor x = wte(computed_ids ? idx.remainder(wte->weight.size(0)) : idx) + wpe(at::arange(idx.size(1)));
    for (const auto& block : *h) x = block->as<GptBlock>()->forward(x);
    at::Tensor logits = at::linear(ln_f(x), wte->weight);  // the head tied to the embedding, as in GPT-2
    return at::cross_entropy_loss(logits.view({-1, logits.size(-1)}), targets.view({-1}));
  }
  bool computed_ids;
  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  torch::nn::ModuleList h{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};
};
TORCH_MODULE(Gpt);

at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight) {
  return x * at::rsqrt(x.pow(2).mean({-1}, true) + 1e-6) * weight;
}

at::Tensor Rotated(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  at::Tensor rotated = at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
  return x * cos + rotated * sin;
}

struct LlamaBlockImpl : torch::nn::Module {
  explicit LlamaBlockImpl(const Sizes& s) : heads(s.heads), kv_heads(s.kv_heads), head_dim(s.embd / s.heads) {
    attention_norm = register_parameter("attention_norm", torch::ones({s.embd}));
    q_proj = register_module("q_proj", torch::nn::Linear(torch::nn::LinearOptions(s.embd, s.embd).bias(false)));
    k_proj =
        register_module("k_proj", torch::nn::Linear(torch::nn::LinearOptions(s.embd, kv_heads * head_dim).bias(false)));
    v_proj =
        register_module("v_proj", torch::nn::Linear(torch::nn::LinearOptions(s.embd, kv_heads * head_dim).bias(false)));
    o_proj = register_module("o_proj", torch::nn::Linear(torch::nn::LinearOptions(s.embd, s.embd).bias(false)));
    ffn_norm = register_parameter("ffn_norm", torch::ones({s.embd}));
    gate = register_module("gate", torch::nn::Linear(torch::nn::LinearOptions(s.embd, 3 * s.embd).bias(false)));
    up = register_module("up", torch::nn::Linear(torch::nn::LinearOptions(s.embd, 3 * s.embd).bias(false)));
    down = register_module("down", torch::nn::Linear(torch::nn::LinearOptions(3 * s.embd, s.embd).bias(false)));
  }
  at::Tensor forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
    const int64_t B = x.size(0), T = x.size(1), C = x.size(2);
    at::Tensor n = RmsNorm(x, attention_norm);
    at::Tensor q = Rotated(q_proj(n).view({B, T, heads, head_dim}).transpose(1, 2), cos, sin);
    at::Tensor k = Rotated(k_proj(n).view({B, T, kv_heads, head_dim}).transpose(1, 2), cos, sin);
    at::Tensor v = v_proj(n).view({B, T, kv_heads, head_dim}).transpose(1, 2);
    k = k.repeat_interleave(heads / kv_heads, 1);
    v = v.repeat_interleave(heads / kv_heads, 1);
    at::Tensor y = CausalScores(q, k).matmul(v).transpose(1, 2).reshape({B, T, C});
    x = x + o_proj(y);
    n = RmsNorm(x, ffn_norm);
    return x + down(torch::silu(gate(n)) * up(n));
  }
  int64_t heads, kv_heads, head_dim;
  at::Tensor attention_norm, ffn_norm;
  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  torch::nn::Linear gate{nullptr}, up{nullptr}, down{nullptr};
};
TORCH_MODULE(LlamaBlock);

struct LlamaImpl : torch::nn::Module {
  explicit LlamaImpl(const Sizes& s) {
    embed = register_module("embed", torch::nn::Embedding(s.vocab, s.embd));
    layers = register_module("layers", torch::nn::ModuleList());
    for (int64_t i = 0; i < s.layers; ++i) layers->push_back(LlamaBlock(s));
    norm = register_parameter("norm", torch::ones({s.embd}));
    lm_head = register_module("lm_head", torch::nn::Linear(torch::nn::LinearOptions(s.embd, s.vocab).bias(false)));
    const int64_t D = s.embd / s.heads;
    at::Tensor angles = at::arange(s.block).unsqueeze(1) * at::pow(10000.0, -at::arange(0, D, 2) / double(D));
    angles = at::cat({angles, angles}, -1);
    cos = register_buffer("cos", angles.cos());
    sin = register_buffer("sin", angles.sin());
  }
  at::Tensor forward(const at::Tensor& idx, const at::Tensor& targets) {
    const int64_t T = idx.size(1);
    at::Tensor x = embed(idx);
    for (const auto& layer : *layers) x = layer->as<LlamaBlock>()->forward(x, cos.slice(0, 0, T), sin.slice(0, 0, T));
    at::Tensor logits = lm_head(RmsNorm(x, norm));
    return at::cross_entropy_loss(logits.view({-1, logits.size(-1)}), targets.view({-1}));
  }
  torch::nn::Embedding embed{nullptr};
  torch::nn::ModuleList layers{nullptr};
  at::Tensor norm, cos, sin;
  torch::nn::Linear lm_head{nullptr};
};
TORCH_MODULE(Llama);

// The model traced on a fixed batch; `model` must have forward(idx, targets).
template <typename Model>
std::unique_ptr<ModelGraph> Traced(Model& model, const at::Tensor& idx, const at::Tensor& targets) {
  auto graph = ModelGraph::Trace(*model, {idx, targets}, [&](const std::vector<at::Tensor>& in) {
    return std::vector<at::Tensor>{model->forward(in[0], in[1])};
  });
  EXPECT_TRUE(graph.ok()) << graph.status();
  return graph.ok() ? *std::move(graph) : nullptr;
}

std::map<std::string, ParameterLayout> ByName(const AutoTensorParallelPlan& plan) {
  std::map<std::string, ParameterLayout> layouts;
  for (const ParameterLayout& p : plan.parameters) layouts[p.name] = p;
  return layouts;
}

// On every rank: one process's loss and gradients (computed locally), then
// the rewritten graph's, which must equal them (gradients as slices).
template <typename Model>
void ExpectParity(int p, int r, const Sizes& sizes, const std::function<void(const AutoTensorParallelPlan&)>& check,
                  bool sequence_parallel = false, bool parallel_vocab = true) {
  auto topology = testing::JoinTopology({{"tensor", p}});
  ASSERT_TRUE(topology.ok()) << topology.status();
  torch::manual_seed(7);
  Model model(sizes);
  const at::Tensor idx = at::randint(sizes.vocab, {2, sizes.block}, at::kLong);
  const at::Tensor targets = at::randint(sizes.vocab, {2, sizes.block}, at::kLong);
  at::Tensor expected_loss = model->forward(idx, targets);
  expected_loss.backward();
  std::map<std::string, at::Tensor> expected_grads;
  for (const auto& item : model->named_parameters()) expected_grads[item.key()] = item.value().grad().clone();
  model->zero_grad();

  std::unique_ptr<ModelGraph> whole = Traced(model, idx, targets);
  ASSERT_NE(whole, nullptr);
  absl::StatusOr<TensorParallelGraph> sharded =
      AutoTensorParallel(*whole, {p, r, "tp", sequence_parallel, parallel_vocab});
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  check(sharded->plan);
  auto part = ModelGraph::Trace(sharded->parameters, {idx, targets}, sharded->forward);
  ASSERT_TRUE(part.ok()) << part.status();
  absl::StatusOr<std::vector<at::Tensor>> loss = (*part)->Run({idx, targets});
  ASSERT_TRUE(loss.ok()) << loss.status();
  EXPECT_NEAR(loss->at(0).item<double>(), expected_loss.item<double>(), 1e-5 * expected_loss.item<double>());
  loss->at(0).backward();
  if (sequence_parallel) {  // replicated parameters saw this rank's sequence shard only
    std::vector<at::Tensor> replicated;
    for (const auto& [name, tensor] : sharded->parameters) {
      if (!sharded->shards.count(name)) replicated.push_back(tensor);
    }
    ASSERT_TRUE(SequenceParallelGradients(replicated, "tp").ok());
  }
  for (const std::pair<std::string, at::Tensor>& parameter : sharded->parameters) {
    const std::string& name = parameter.first;
    const at::Tensor& tensor = parameter.second;
    ASSERT_TRUE(tensor.grad().defined()) << name;
    auto shard = sharded->shards.find(name);
    const at::Tensor expected =
        shard == sharded->shards.end() ? expected_grads.at(name) : shard->second.Slice(expected_grads.at(name));
    ASSERT_EQ(tensor.grad().sizes(), expected.sizes()) << name;
    EXPECT_LE((tensor.grad() - expected).abs().max().item<double>(), 1e-5 * (1 + expected.abs().max().item<double>()))
        << name;
  }
}

class AutoTensorParallelTest : public ::testing::TestWithParam<int> {};

TEST_P(AutoTensorParallelTest, GptEqualsOneProcessWithMegatronsPlan) {
  const int p = GetParam();
  testing::RunOnRanks(p, [p](int r) {
    ExpectParity<Gpt>(p, r, Sizes{}, [&](const AutoTensorParallelPlan& plan) {
      auto layouts = ByName(plan);
      for (const std::string layer : {"h.0.", "h.1."}) {
        EXPECT_EQ(layouts[layer + "c_attn.weight"].role, ParameterLayout::Role::kColumn);
        EXPECT_EQ(layouts[layer + "c_attn.weight"].shard.blocks, 3);  // q, k and v split by heads
        EXPECT_EQ(layouts[layer + "c_attn.bias"].role, ParameterLayout::Role::kColumn);
        EXPECT_EQ(layouts[layer + "c_proj.weight"].role, ParameterLayout::Role::kRow);
        EXPECT_EQ(layouts[layer + "c_proj.bias"].role, ParameterLayout::Role::kReplicated);
        EXPECT_EQ(layouts[layer + "c_fc.weight"].role, ParameterLayout::Role::kColumn);
        EXPECT_EQ(layouts[layer + "mlp_proj.weight"].role, ParameterLayout::Role::kRow);
        EXPECT_EQ(layouts[layer + "ln_1.weight"].role, ParameterLayout::Role::kReplicated);
      }
      // The embedding splits its vocabulary, and so does the head tied to it.
      EXPECT_EQ(layouts["wte.weight"].role, ParameterLayout::Role::kVocabulary);
      EXPECT_EQ(layouts["wte.weight"].shard.dim, 0);
      EXPECT_EQ(layouts["wpe.weight"].role, ParameterLayout::Role::kReplicated);
      EXPECT_EQ(layouts["ln_f.weight"].role, ParameterLayout::Role::kReplicated);
      // Per block: one copy before the q, k, v and one before the MLP, two
      // all-reduces; the embedding's all-reduce, the copy before the head and
      // the vocabulary-parallel cross-entropy.
      EXPECT_EQ(plan.collectives.size(), 11u);
      EXPECT_THAT(plan.collectives.back(), HasSubstr("vocab_parallel_cross_entropy"));
      EXPECT_GT(plan.bytes_per_micro_batch, 0);
    });
  });
}

TEST_P(AutoTensorParallelTest, LlamaEqualsOneProcessWithMegatronsPlan) {
  const int p = GetParam();
  testing::RunOnRanks(p, [p](int r) {
    Sizes sizes;
    sizes.kv_heads = p;  // grouped-query attention: as many key/value heads as ranks
    ExpectParity<Llama>(p, r, sizes, [&](const AutoTensorParallelPlan& plan) {
      auto layouts = ByName(plan);
      for (const std::string name : {"q_proj", "k_proj", "v_proj", "gate", "up"}) {
        EXPECT_EQ(layouts["layers.0." + name + ".weight"].role, ParameterLayout::Role::kColumn) << name;
      }
      EXPECT_EQ(layouts["layers.1.o_proj.weight"].role, ParameterLayout::Role::kRow);
      EXPECT_EQ(layouts["layers.1.down.weight"].role, ParameterLayout::Role::kRow);
      EXPECT_EQ(layouts["lm_head.weight"].role, ParameterLayout::Role::kColumn);
      EXPECT_EQ(layouts["embed.weight"].role, ParameterLayout::Role::kVocabulary);
      EXPECT_EQ(layouts["layers.0.attention_norm"].role, ParameterLayout::Role::kReplicated);
      EXPECT_THAT(plan.Report(), HasSubstr("lm_head.weight"));
    });
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, AutoTensorParallelTest, ::testing::Values(2, 4));

// Sequence parallelism: norms, residuals and the position embedding run on
// sequence shards between the split products (gathered before each column
// product, reduce-scattered after each row product).
TEST(AutoSequenceParallelTest, GptEqualsOneProcess) {
  testing::RunOnRanks(2, [](int r) {
    ExpectParity<Gpt>(
        2, r, Sizes{},
        [](const AutoTensorParallelPlan& plan) {
          EXPECT_THAT(plan.Report(), HasSubstr("gather_from_sequence_region"));
          EXPECT_THAT(plan.Report(), HasSubstr("reduce_scatter_to_sequence_region"));
          EXPECT_THAT(plan.Report(), Not(HasSubstr("copy_to_tp_region")));
        },
        /*sequence_parallel=*/true);
  });
}

TEST(AutoSequenceParallelTest, LlamaEqualsOneProcess) {
  testing::RunOnRanks(2, [](int r) {
    Sizes sizes;
    sizes.kv_heads = 2;
    ExpectParity<Llama>(
        2, r, sizes, [](const AutoTensorParallelPlan&) {}, /*sequence_parallel=*/true);
  });
}

// Without parallel_vocab, the embedding kept whole looks up each rank's
// sequence shard of the ids, the whole head computes that shard's logits,
// and the loss is the shards' summed over the group: GPT's tied head and
// Llama's own.
// Token ids computed in the model: the embedding runs replicated, and its
// output enters the sequence-parallel region at the first column product as
// this rank's shard, gathered (so its gradient is the shard's as well).
TEST(AutoSequenceParallelTest, AReplicatedInputEntersAtTheFirstColumnProduct) {
  testing::RunOnRanks(2, [](int r) {
    Sizes sizes;
    sizes.computed_ids = true;
    ExpectParity<Gpt>(
        2, r, sizes,
        [](const AutoTensorParallelPlan& plan) {
          EXPECT_EQ(ByName(plan)["wte.weight"].role, ParameterLayout::Role::kReplicated);
          EXPECT_THAT(plan.Report(), Not(HasSubstr("copy_to_tp_region")));
        },
        /*sequence_parallel=*/true);
  });
}

std::function<void(const AutoTensorParallelPlan&)> WholeVocabularyPlan(const std::string& embedding,
                                                                       const std::string& head) {
  return [=](const AutoTensorParallelPlan& plan) {
    auto layouts = ByName(plan);
    EXPECT_EQ(layouts[embedding].role, ParameterLayout::Role::kReplicated);
    EXPECT_EQ(layouts[head].role, ParameterLayout::Role::kReplicated);
    EXPECT_THAT(plan.Report(), HasSubstr("sums the sequence shards' cross-entropy"));
    EXPECT_THAT(plan.Report(), Not(HasSubstr("vocab_parallel_cross_entropy")));
    EXPECT_THAT(plan.Report(), Not(HasSubstr("copy_to_tp_region")));
  };
}

TEST(AutoSequenceParallelTest, WholeVocabularyGptEqualsOneProcess) {
  testing::RunOnRanks(2, [](int r) {
    ExpectParity<Gpt>(2, r, Sizes{}, WholeVocabularyPlan("wte.weight", "wte.weight"), /*sequence_parallel=*/true,
                      /*parallel_vocab=*/false);
  });
}

TEST(AutoSequenceParallelTest, WholeVocabularyLlamaEqualsOneProcess) {
  testing::RunOnRanks(2, [](int r) {
    Sizes sizes;
    sizes.kv_heads = 2;
    sizes.vocab = 67;  // the vocabulary need not divide
    ExpectParity<Llama>(2, r, sizes, WholeVocabularyPlan("embed.weight", "lm_head.weight"),
                        /*sequence_parallel=*/true, /*parallel_vocab=*/false);
  });
}

// A wide MLP and a narrow one on the same activations: with the cost model,
// the narrow one's split saves less compute than its two all-reduces take,
// so it stays whole; the wide one splits; and the result is one process's.
struct TwoMlpsImpl : torch::nn::Module {
  TwoMlpsImpl() {
    wide_in = register_module("wide_in", torch::nn::Linear(256, 1024));
    wide_out = register_module("wide_out", torch::nn::Linear(1024, 256));
    narrow_in = register_module("narrow_in", torch::nn::Linear(256, 8));
    narrow_out = register_module("narrow_out", torch::nn::Linear(8, 256));
  }
  at::Tensor forward(const at::Tensor& x, const at::Tensor& target) {
    at::Tensor h = x + wide_out(torch::gelu(wide_in(x)));
    h = h + narrow_out(torch::gelu(narrow_in(h)));
    return torch::mse_loss(h, target);
  }
  torch::nn::Linear wide_in{nullptr}, wide_out{nullptr}, narrow_in{nullptr}, narrow_out{nullptr};
};
TORCH_MODULE(TwoMlps);

// On every rank of a tp=2 group: TwoMlps traced, planned with `options` by
// `plan`, checked by `check`, and its rewritten graph's loss equal to one
// process's.
void ExpectTwoMlpsPlan(int r, const AutoTensorParallelOptions& options,
                       const std::function<void(const AutoTensorParallelPlan&)>& check) {
  auto topology = testing::JoinTopology({{"tensor", 2}});
  ASSERT_TRUE(topology.ok()) << topology.status();
  torch::manual_seed(3);
  TwoMlps model;
  const at::Tensor x = at::randn({4, 64, 256}), target = at::randn({4, 64, 256});
  const at::Tensor expected = model->forward(x, target);
  std::unique_ptr<ModelGraph> graph = Traced(model, x, target);
  ASSERT_NE(graph, nullptr);
  auto sharded = AutoTensorParallel(*graph, {2, r, "tp"}, options);
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  check(sharded->plan);
  auto part = ModelGraph::Trace(sharded->parameters, {x, target}, sharded->forward);
  ASSERT_TRUE(part.ok()) << part.status();
  auto loss = (*part)->Run({x, target});
  ASSERT_TRUE(loss.ok()) << loss.status();
  EXPECT_NEAR(loss->at(0).item<double>(), expected.item<double>(), 1e-5 * expected.item<double>());
}

AutoTensorParallelOptions CpuCosts() {
  AutoTensorParallelOptions costs;
  costs.flops_per_second = 50e9;
  costs.bytes_per_second = 1e9;
  costs.collective_latency_s = 100e-6;
  return costs;
}

TEST(AutoTensorParallelCostTest, ANarrowMlpStaysWholeAWideOneSplits) {
  testing::RunOnRanks(2, [](int r) {
    ExpectTwoMlpsPlan(r, CpuCosts(), [](const AutoTensorParallelPlan& plan) {
      auto layouts = ByName(plan);
      EXPECT_EQ(layouts["wide_in.weight"].role, ParameterLayout::Role::kColumn);
      EXPECT_EQ(layouts["wide_out.weight"].role, ParameterLayout::Role::kRow);
      EXPECT_EQ(layouts["narrow_in.weight"].role, ParameterLayout::Role::kReplicated);
      EXPECT_THAT(layouts["narrow_in.weight"].why, HasSubstr("would save"));
      EXPECT_EQ(plan.collectives.size(), 2u);
    });
  });
}

// Merak's layer lists pin parts of the plan: the narrow MLP split because it
// is named (col_para_list) and matched by its feature ratio
// (input_output_mapping), the rest left to the cost model.
TEST(AutoTensorParallelCostTest, LayerListsPinWhatTheCostModelWouldKeepWhole) {
  testing::RunOnRanks(2, [](int r) {
    AutoTensorParallelOptions options = CpuCosts();
    options.layers.add_column("narrow_in");
    TensorParallelLayerLists::Mapping* narrow_out = options.layers.add_input_output_mapping();  // 8 -> 256
    narrow_out->set_input(32);
    narrow_out->set_output(1);
    narrow_out->set_column(false);
    ExpectTwoMlpsPlan(r, options, [](const AutoTensorParallelPlan& plan) {
      auto layouts = ByName(plan);
      EXPECT_EQ(layouts["narrow_in.weight"].role, ParameterLayout::Role::kColumn);
      EXPECT_EQ(layouts["narrow_out.weight"].role, ParameterLayout::Role::kRow);
      EXPECT_EQ(layouts["wide_in.weight"].role, ParameterLayout::Role::kColumn);
    });
  });
}

TEST(AutoTensorParallelErrorsTest, ARowPinWhereTheInputIsNotSplitIsRefused) {
  torch::manual_seed(3);
  TwoMlps model;
  const at::Tensor x = at::randn({1, 4, 256});
  std::unique_ptr<ModelGraph> graph = Traced(model, x, x);
  ASSERT_NE(graph, nullptr);
  AutoTensorParallelOptions options;
  options.layers.add_row("wide_in");
  auto refused = AutoTensorParallel(*graph, {2, 0, "tp"}, options);
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("wide_in.weight) row-parallel, but its input"));
}

TEST(AutoTensorParallelErrorsTest, HeadsThatDoNotDivideAreNamed) {
  Sizes sizes;
  sizes.embd = 24;
  sizes.heads = 3;
  torch::manual_seed(0);
  Gpt model(sizes);
  const at::Tensor idx = at::zeros({1, sizes.block}, at::kLong);
  std::unique_ptr<ModelGraph> graph = Traced(model, idx, idx);
  ASSERT_NE(graph, nullptr);
  absl::StatusOr<TensorParallelGraph> sharded = AutoTensorParallel(*graph, {2, 0, "tp"});
  ASSERT_FALSE(sharded.ok());
  EXPECT_THAT(std::string(sharded.status().message()), HasSubstr("aten::view"));
  EXPECT_THAT(std::string(sharded.status().message()), HasSubstr("size 3"));
}

TEST(AutoTensorParallelErrorsTest, AModelWithNothingToSplitIsRefused) {
  torch::nn::Linear head(8, 4);
  const at::Tensor x = at::randn({2, 8});
  auto graph = ModelGraph::Trace(
      *head, {x}, [&](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{head->forward(in[0])}; });
  ASSERT_TRUE(graph.ok()) << graph.status();
  absl::StatusOr<TensorParallelGraph> sharded = AutoTensorParallel(**graph, {2, 0, "tp"});
  ASSERT_FALSE(sharded.ok());
  EXPECT_THAT(std::string(sharded.status().message()), HasSubstr("no matrix product it can split"));
  EXPECT_THAT(std::string(sharded.status().message()), HasSubstr("the model's outputs"));
}

}  // namespace
}  // namespace trident
