#include "replace/replace.h"

#include <cmath>
#include <limits>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "graph/model_graph.h"
#include "kernels/kernels.h"

namespace trident {
namespace {

// Largest difference relative to the reference's largest magnitude.
double RelativeDifference(const at::Tensor& got, const at::Tensor& want) {
  return (got - want).abs().max().item<double>() / std::max(1e-30, want.abs().max().item<double>());
}

void ExpectClose(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  EXPECT_LE(RelativeDifference(got, want), 1e-5) << what;
}

at::Tensor ReferenceAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const int64_t Tq = q.size(2), Tk = k.size(2);
  at::Tensor masked = at::ones({Tk, Tk}, at::kBool).triu(1).narrow(0, Tk - Tq, Tq);
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(-1)));
  return at::matmul(at::softmax(scores.masked_fill(masked, -std::numeric_limits<double>::infinity()), -1), v);
}

// Forward and gradients of `fused` and `reference` on copies of `inputs`,
// under a loss that weighs every output element differently.
void ExpectSameFunction(const std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>& fused,
                        const std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>& reference,
                        const std::vector<at::Tensor>& inputs, const std::string& what) {
  auto run = [&](const auto& f) {
    std::vector<at::Tensor> leaves;
    for (const at::Tensor& x : inputs) leaves.push_back(x.detach().clone().requires_grad_(true));
    std::vector<at::Tensor> outputs = f(leaves);
    at::Tensor loss = at::zeros({});
    for (size_t i = 0; i < outputs.size(); ++i) {
      loss = loss + (outputs[i] * at::linspace(-1, 2, outputs[i].numel()).view(outputs[i].sizes())).sum();
    }
    loss.backward();
    std::vector<at::Tensor> results = outputs;
    for (const at::Tensor& leaf : leaves) results.push_back(leaf.grad());
    return results;
  };
  std::vector<at::Tensor> got = run(fused), want = run(reference);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) ExpectClose(got[i], want[i], what + " result " + std::to_string(i));
}

TEST(FusedCausalAttentionTest, MatchesSoftmaxAttentionAndItsGradients) {
  torch::manual_seed(1);
  // One block, several blocks with a partial last one, and decoding (queries after cached keys).
  // fp32 runs the fused CPU kernels; fp64 the ATen operators on blocks of queries.
  for (at::ScalarType dtype : {at::kFloat, at::kDouble}) {
    for (auto [queries, keys] : std::vector<std::pair<int64_t, int64_t>>{{5, 5}, {128, 128}, {300, 300}, {7, 300}}) {
      const at::TensorOptions options = at::TensorOptions().dtype(dtype);
      const std::vector<at::Tensor> qkv = {at::randn({2, 3, queries, 16}, options),
                                           at::randn({2, 3, keys, 16}, options), at::randn({2, 3, keys, 16}, options)};
      EXPECT_EQ(FusedCausalAttentionOnCpu(qkv[0], qkv[1], qkv[2]), dtype == at::kFloat);
      ExpectSameFunction(
          [](const auto& in) { return std::vector<at::Tensor>{FusedCausalAttention(in[0], in[1], in[2])}; },
          [](const auto& in) { return std::vector<at::Tensor>{ReferenceAttention(in[0], in[1], in[2])}; }, qkv,
          std::string(c10::toString(dtype)) + " attention " + std::to_string(queries) + " x " + std::to_string(keys));
    }
  }
}

// The fp32 CPU kernels on the zoo's layout: q, k, v are views of one [B, T, 3, H, D]
// projection and the heads merge back through a transpose, so every operand
// and the output's gradient has rows 3 H D or H D floats apart.
TEST(FusedCausalAttentionTest, TakesHeadsThatAreViewsOfOneProjection) {
  torch::manual_seed(3);
  const int64_t B = 2, H = 3, D = 16;
  for (int64_t T : {1, 33, 130}) {
    const at::Tensor qkv = at::randn({B, T, 3 * H * D});
    auto heads = [&](const auto& fused) {
      return [&, fused](const std::vector<at::Tensor>& in) {
        const std::vector<at::Tensor> parts = in[0].view({B, T, 3, H, D}).unbind(2);
        at::Tensor y = fused(parts[0].transpose(1, 2), parts[1].transpose(1, 2), parts[2].transpose(1, 2));
        return std::vector<at::Tensor>{y.transpose(1, 2).reshape({B, T, H * D})};
      };
    };
    ExpectSameFunction(heads([](auto q, auto k, auto v) { return FusedCausalAttention(q, k, v); }),
                       heads([](auto q, auto k, auto v) { return ReferenceAttention(q, k, v); }), {qkv},
                       "attention over views, T = " + std::to_string(T));
  }
}

TEST(FusedCausalAttentionTest, ShapesThatDoNotFitAreNamed) {
  const at::Tensor q = at::randn({2, 3, 8, 16});
  for (const auto& [k, v] : std::vector<std::pair<at::Tensor, at::Tensor>>{
           {at::randn({1, 3, 8, 16}), at::randn({1, 3, 8, 16})},    // batch
           {at::randn({2, 3, 4, 16}), at::randn({2, 3, 4, 16})},    // fewer keys than queries
           {at::randn({2, 3, 8, 16}), at::randn({2, 3, 8, 8})}}) {  // v's width
    try {
      FusedCausalAttention(q, k, v);
      ADD_FAILURE() << "no error for k " << k.sizes() << ", v " << v.sizes();
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("k, v [B, H, Tk, D] with Tk >= Tq; got q [2, 3, 8, 16]"), std::string::npos)
          << e.what();
    }
  }
}

TEST(FusedAddLayerNormTest, MatchesAddThenLayerNormAndItsGradients) {
  torch::manual_seed(2);
  for (int64_t width : {64, 37}) {  // 37: the vector loops' scalar tails
    for (double alpha : {1.0, 0.5}) {
      const std::vector<at::Tensor> in = {at::randn({3, 5, width}), at::randn({3, 5, width}), at::randn({width}),
                                          at::randn({width})};
      ExpectSameFunction(
          [&](const auto& t) {
            auto [sum, out] = FusedAddLayerNorm(t[0], t[1], alpha, {width}, t[2], t[3], 1e-5);
            return std::vector<at::Tensor>{sum, out};
          },
          [&](const auto& t) {
            at::Tensor sum = at::add(t[0], t[1], alpha);
            return std::vector<at::Tensor>{sum, at::layer_norm(sum, {width}, t[2], t[3], 1e-5)};
          },
          in, "add_layer_norm width " + std::to_string(width) + " alpha " + std::to_string(alpha));
    }
  }
  // Without an affine transform, and on a non-contiguous input (the ATen path).
  const std::vector<at::Tensor> in = {at::randn({4, 6}).t(), at::randn({6, 4})};
  ExpectSameFunction(
      [](const auto& t) {
        auto [sum, out] = FusedAddLayerNorm(t[0], t[1], 1.0, {4}, at::Tensor(), at::Tensor(), 1e-5);
        return std::vector<at::Tensor>{sum, out};
      },
      [](const auto& t) {
        return std::vector<at::Tensor>{t[0] + t[1], at::layer_norm(t[0] + t[1], {4})};
      },
      in, "add_layer_norm without weights");
}

TEST(FusedAddLayerNormTest, WithoutAResidualTheSumIsXAndItsGradientJoinsXs) {
  torch::manual_seed(4);
  const std::vector<at::Tensor> in = {at::randn({3, 5, 48}), at::randn({48}), at::randn({48})};
  ExpectSameFunction(
      [](const auto& t) {
        auto [sum, out] = FusedAddLayerNorm(t[0], at::Tensor(), 1.0, {48}, t[1], t[2], 1e-5);
        return std::vector<at::Tensor>{sum, out};
      },
      [](const auto& t) {
        return std::vector<at::Tensor>{t[0], at::layer_norm(t[0], {48}, t[1], t[2], 1e-5)};
      },
      in, "add_layer_norm without a residual");
}

TEST(FusedBiasGeluTest, MatchesGeluOfTheSumAndItsGradients) {
  torch::manual_seed(3);
  for (int64_t width : {256, 37}) {
    for (const char* approximate : {"none", "tanh"}) {
      ExpectSameFunction([&](const auto& t) { return std::vector<at::Tensor>{FusedBiasGelu(t[0], t[1], approximate)}; },
                         [&](const auto& t) { return std::vector<at::Tensor>{at::gelu(t[0] + t[1], approximate)}; },
                         {at::randn({2, 9, width}) * 3, at::randn({width})},
                         std::string("bias_gelu ") + approximate + " width " + std::to_string(width));
    }
  }
}

// The loss and the logits' gradient of F::cross_entropy, with ignored
// targets, for fp32 logits and (against fp32's, to bf16 rounding) bf16 ones;
// the incoming gradient scales the logits'.
TEST(FusedCrossEntropyTest, MatchesCrossEntropyAndItsGradients) {
  torch::manual_seed(5);
  const at::Tensor logits = at::randn({37, 300}) * 4;
  at::Tensor targets = at::randint(300, {37}, at::kLong);
  targets.index_put_({at::arange(0, 37, 5)}, -100);
  auto loss_and_grad = [&](bool fused, at::ScalarType dtype) {
    at::Tensor leaf = logits.to(dtype).clone().requires_grad_(true);
    at::Tensor loss =
        fused ? FusedCrossEntropy(leaf, targets) : torch::nn::functional::cross_entropy(leaf.to(at::kFloat), targets);
    (loss * 3).backward();
    return std::make_pair(loss.detach(), leaf.grad());
  };
  const auto [want_loss, want_grad] = loss_and_grad(false, at::kFloat);
  const auto [got_loss, got_grad] = loss_and_grad(true, at::kFloat);
  ExpectClose(got_loss, want_loss, "loss");
  ExpectClose(got_grad, want_grad, "gradient");
  EXPECT_EQ(got_grad.index({0}).abs().max().item<double>(), 0) << "an ignored row gets no gradient";
  const auto [bf16_loss, bf16_grad] = loss_and_grad(true, at::kBFloat16);
  EXPECT_EQ(bf16_loss.scalar_type(), at::kFloat);
  EXPECT_EQ(bf16_grad.scalar_type(), at::kBFloat16);
  EXPECT_LE(RelativeDifference(bf16_loss, want_loss), 1e-2);
  EXPECT_LE(RelativeDifference(bf16_grad.to(at::kFloat), want_grad), 1e-2);
  c10::NoGradGuard no_grad;  // evaluation: the loss alone
  ExpectClose(FusedCrossEntropy(logits, targets), want_loss, "loss without gradients");
}

// A module of the registry's own kind: a user's module with a fast path.
struct UserNormImpl : torch::nn::Module {
  bool fast = false;
};
TORCH_MODULE(UserNorm);

struct Replaceable : torch::nn::Module, ReplaceableModule {
  bool Offers(const std::string& pair) const override { return pair == "fused_bias_gelu"; }
};

TEST(ReplaceModulesTest, OffersEveryModuleToEachPair) {
  ASSERT_TRUE(ReplacePairRegistry().Register("test_user_norm", {{at::kFloat},
                                                                [](torch::nn::Module& m) {
                                                                  auto* norm = dynamic_cast<UserNormImpl*>(&m);
                                                                  if (norm != nullptr) norm->fast = true;
                                                                  return norm != nullptr;
                                                                },
                                                                {}}));
  auto root = std::make_shared<torch::nn::Module>();
  UserNorm a = root->register_module("a", UserNorm());
  UserNorm b = root->register_module("b", UserNorm());
  auto replaceable = root->register_module("c", std::make_shared<Replaceable>());
  absl::StatusOr<ReplaceReport> report =
      ReplaceModules(*root, {"test_user_norm", "fused_bias_gelu", "fused_attention"}, at::kFloat);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->hits, (std::vector<int>{2, 1, 0}));
  EXPECT_TRUE(a->fast && b->fast);
  EXPECT_TRUE(replaceable->Uses("fused_bias_gelu"));
  EXPECT_FALSE(replaceable->Uses("fused_attention"));
  EXPECT_EQ(report->Summary(), "module_replace: test_user_norm 2, fused_bias_gelu 1, fused_attention 0");

  // A pair that does not support the compute dtype is left out and reported.
  report = ReplaceModules(*root, {"test_user_norm", "fused_bias_gelu"}, at::kBFloat16);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->pairs, std::vector<std::string>{"fused_bias_gelu"});
  EXPECT_EQ(report->unsupported, std::vector<std::string>{"test_user_norm (BFloat16)"});

  report = ReplaceModules(*root, {"fused_atention"}, at::kFloat);
  ASSERT_FALSE(report.ok());
  EXPECT_NE(std::string(report.status().message())
                .find("unknown replacement pair (module_replace) 'fused_atention'; "
                      "choose fused_attention, fused_bias_gelu, fused_cross_entropy, fused_layer_norm"),
            std::string::npos)
      << report.status();
}

// A GPT block as minGPT writes it (explicit masked softmax, GELU MLP, pre-norm
// residuals) and a final norm: every built-in pair has a pattern in its trace.
struct MinGptBlockImpl : torch::nn::Module {
  MinGptBlockImpl(int64_t T, int64_t C, int64_t H) : heads(H) {
    ln_1 = register_module("ln_1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({C})));
    c_attn = register_module("c_attn", torch::nn::Linear(C, 3 * C));
    c_proj = register_module("c_proj", torch::nn::Linear(C, C));
    ln_2 = register_module("ln_2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({C})));
    c_fc = register_module("c_fc", torch::nn::Linear(C, 4 * C));
    mlp_proj = register_module("mlp_proj", torch::nn::Linear(4 * C, C));
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({C})));
    mask = register_buffer("mask", torch::ones({T, T}).tril().view({1, 1, T, T}));
  }
  at::Tensor forward(at::Tensor x) {
    const int64_t B = x.size(0), T = x.size(1), C = x.size(2), D = C / heads;
    std::vector<at::Tensor> qkv = c_attn(ln_1(x)).split(C, 2);
    for (at::Tensor& t : qkv) t = t.view({B, T, heads, D}).transpose(1, 2);
    at::Tensor att = at::matmul(qkv[0], qkv[1].transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(D)));
    att = att.masked_fill(mask.slice(2, 0, T).slice(3, 0, T) == 0, -std::numeric_limits<double>::infinity());
    at::Tensor y = at::matmul(at::softmax(att, -1), qkv[2]).transpose(1, 2).contiguous().view({B, T, C});
    x = x + c_proj(y);
    x = x + mlp_proj(at::gelu(c_fc(ln_2(x))));
    return ln_f(x);
  }
  int64_t heads;
  torch::nn::LayerNorm ln_1{nullptr}, ln_2{nullptr}, ln_f{nullptr};
  torch::nn::Linear c_attn{nullptr}, c_proj{nullptr}, c_fc{nullptr}, mlp_proj{nullptr};
  at::Tensor mask;
};
TORCH_MODULE(MinGptBlock);

TEST(ReplaceInGraphTest, RewritesTheTracedPatternsAndComputesTheSame) {
  torch::manual_seed(4);
  MinGptBlock block(16, 32, 4);
  const at::Tensor x = at::randn({2, 16, 32}), weights = at::randn({2, 16, 32});
  auto forward = [&](const std::vector<at::Tensor>& in) {
    return std::vector<at::Tensor>{(block(in[0]) * weights).sum()};
  };
  absl::StatusOr<std::unique_ptr<ModelGraph>> traced = ModelGraph::Trace(*block, {x}, forward);
  ASSERT_TRUE(traced.ok()) << traced.status();
  absl::StatusOr<ReplacedGraph> replaced =
      ReplaceInGraph(**traced, {"fused_attention", "fused_layer_norm", "fused_bias_gelu"}, at::kFloat);
  ASSERT_TRUE(replaced.ok()) << replaced.status();
  // ln_2 after the attention's residual, ln_f after the MLP's; ln_1 reads the input.
  EXPECT_EQ(replaced->report.hits, (std::vector<int>{1, 2, 1})) << (*traced)->IrText();
  absl::StatusOr<std::unique_ptr<ModelGraph>> retraced =
      ModelGraph::Trace(replaced->parameters, {x}, replaced->forward);
  ASSERT_TRUE(retraced.ok()) << retraced.status();
  std::multiset<std::string> kinds;
  for (const GraphNode& node : (*retraced)->nodes()) kinds.insert(node.kind);
  EXPECT_EQ(kinds.count("trident::causal_attention"), 1u);
  EXPECT_EQ(kinds.count("trident::add_layer_norm"), 2u);
  EXPECT_EQ(kinds.count("trident::bias_gelu"), 1u);
  EXPECT_EQ(kinds.count("aten::softmax"), 0u);
  // The same loss and parameter gradients as the original graph.
  auto loss_and_gradients = [&](ModelGraph& graph) {
    block->zero_grad();
    at::Tensor loss = graph.Run({x}).value()[0];
    loss.backward();
    std::vector<at::Tensor> results = {loss.detach()};
    for (const auto& p : block->parameters()) results.push_back(p.grad().clone());
    return results;
  };
  std::vector<at::Tensor> want = loss_and_gradients(**traced), got = loss_and_gradients(**retraced);
  for (size_t i = 0; i < want.size(); ++i) ExpectClose(got[i], want[i], "loss or gradient " + std::to_string(i));
  // A mask that is not causal is not attention this pair may replace.
  block->mask.fill_(1);
  traced = ModelGraph::Trace(*block, {x}, forward);
  ASSERT_TRUE(traced.ok()) << traced.status();
  replaced = ReplaceInGraph(**traced, {"fused_attention"}, at::kFloat);
  ASSERT_TRUE(replaced.ok()) << replaced.status();
  EXPECT_EQ(replaced->report.hits, std::vector<int>{0});
}

// A head and its mean cross-entropy, traced: the loss becomes one operator,
// with the same loss and gradients; a smoothed loss is not the pair's.
TEST(ReplaceInGraphTest, RewritesTheMeanCrossEntropy) {
  torch::manual_seed(6);
  torch::nn::Linear head(16, 50);
  const at::Tensor x = at::randn({2, 8, 16}), targets = at::randint(50, {2, 8}, at::kLong);
  for (double smoothing : {0.0, 0.1}) {
    auto forward = [&](const std::vector<at::Tensor>& in) {
      const at::Tensor logits = head(in[0]);
      return std::vector<at::Tensor>{torch::nn::functional::cross_entropy(
          logits.reshape({-1, 50}), in[1].reshape({-1}),
          torch::nn::functional::CrossEntropyFuncOptions().label_smoothing(smoothing))};
    };
    absl::StatusOr<std::unique_ptr<ModelGraph>> traced = ModelGraph::Trace(*head, {x, targets}, forward);
    ASSERT_TRUE(traced.ok()) << traced.status();
    absl::StatusOr<ReplacedGraph> replaced = ReplaceInGraph(**traced, {"fused_cross_entropy"}, at::kFloat);
    ASSERT_TRUE(replaced.ok()) << replaced.status();
    EXPECT_EQ(replaced->report.hits, std::vector<int>{smoothing == 0 ? 1 : 0}) << (*traced)->IrText();
    if (smoothing != 0) continue;
    absl::StatusOr<std::unique_ptr<ModelGraph>> retraced =
        ModelGraph::Trace(replaced->parameters, {x, targets}, replaced->forward);
    ASSERT_TRUE(retraced.ok()) << retraced.status();
    auto loss_and_gradients = [&](ModelGraph& graph) {
      head->zero_grad();
      at::Tensor loss = graph.Run({x, targets}).value()[0];
      loss.backward();
      return std::vector<at::Tensor>{loss.detach(), head->weight.grad().clone(), head->bias.grad().clone()};
    };
    std::vector<at::Tensor> want = loss_and_gradients(**traced), got = loss_and_gradients(**retraced);
    for (size_t i = 0; i < want.size(); ++i) ExpectClose(got[i], want[i], "loss or gradient " + std::to_string(i));
  }
}

}  // namespace
}  // namespace trident
