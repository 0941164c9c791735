#include "models/models.h"

#include <algorithm>
#include <cmath>
#include <set>

#include <ATen/autocast_mode.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "absl/strings/str_cat.h"

#include "base/memory_counter.h"
#include "base/recompute.h"

namespace trident {
namespace {

using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

std::shared_ptr<LanguageModel> Make(ModelConfig config, uint64_t seed = 1) {
  auto model = CreateModel(config, seed);
  EXPECT_TRUE(model.ok()) << model.status();
  return *model;
}

std::vector<std::string> NamesAndShapes(const torch::nn::Module& module) {
  std::vector<std::string> out;
  for (const auto& p : module.named_parameters()) {
    std::ostringstream s;
    s << p.key() << " " << p.value().sizes();
    out.push_back(s.str());
  }
  return out;
}

TEST(GptTest, ParameterNamesAndLayoutsMatchThePyTorchReference) {
  ModelConfig c = *PresetModelConfig("gpt", "gpt-tiny");
  c.n_layer = 1;
  c.n_embd = 8;
  c.n_head = 2;
  c.block_size = 16;
  c.vocab_size = 32;
  auto model = Make(c);
  EXPECT_THAT(NamesAndShapes(*model),
              ElementsAreArray({"transformer.wte.weight [32, 8]", "transformer.wpe.weight [16, 8]",
                                "transformer.h.0.ln_1.weight [8]", "transformer.h.0.ln_1.bias [8]",
                                "transformer.h.0.attn.c_attn.weight [24, 8]", "transformer.h.0.attn.c_attn.bias [24]",
                                "transformer.h.0.attn.c_proj.weight [8, 8]", "transformer.h.0.attn.c_proj.bias [8]",
                                "transformer.h.0.ln_2.weight [8]", "transformer.h.0.ln_2.bias [8]",
                                "transformer.h.0.mlp.c_fc.weight [32, 8]", "transformer.h.0.mlp.c_fc.bias [32]",
                                "transformer.h.0.mlp.c_proj.weight [8, 32]", "transformer.h.0.mlp.c_proj.bias [8]",
                                "transformer.ln_f.weight [8]", "transformer.ln_f.bias [8]"}));
  EXPECT_EQ(model->TiedParameters().at("lm_head.weight"), "transformer.wte.weight");
}

TEST(ModelConfigTest, TiedParametersAndAttentionAreKnownBeforeBuilding) {
  for (const char* model : {"gpt", "llama", "mlp"}) {
    for (bool tie : {true, false}) {
      ModelConfig config = *PresetModelConfig(model, std::string(model) + "-tiny");
      config.tie_word_embeddings = tie;
      EXPECT_EQ(ModelTiedParameters(config), Make(config)->TiedParameters()) << model << " tie " << tie;
    }
  }
  ModelConfig gpt = *PresetModelConfig("gpt", "gpt-tiny");
  EXPECT_EQ(AttentionFlopsPerToken(gpt), 12.0 * gpt.n_layer * gpt.n_embd * gpt.block_size);
  EXPECT_EQ(AttentionFlopsPerToken(*PresetModelConfig("mlp", "mlp-tiny")), 0.0);
}

TEST(GptTest, Gpt2SmallHasTheKnownParameterCount) {
  auto model = Make(*PresetModelConfig("gpt", "gpt2-124m"));
  EXPECT_EQ(model->NumParameters(), 124439808);  // GPT-2 small, head tied
}

TEST(GptTest, InitialisationFollowsGpt2) {
  auto model = Make(*PresetModelConfig("gpt", "gpt-tiny"), 7);
  auto params = model->named_parameters();
  const double residual_std = 0.02 / std::sqrt(2.0 * 4);
  EXPECT_NEAR(params["transformer.h.0.mlp.c_fc.weight"].std().item<double>(), 0.02, 0.001);
  EXPECT_NEAR(params["transformer.h.0.attn.c_proj.weight"].std().item<double>(), residual_std, 0.0005);
  EXPECT_EQ(params["transformer.h.0.attn.c_attn.bias"].abs().sum().item<double>(), 0.0);
  EXPECT_EQ(params["transformer.ln_f.weight"].sum().item<double>(), 256.0);
  // The same seed gives the same weights; another seed does not.
  auto same = Make(*PresetModelConfig("gpt", "gpt-tiny"), 7);
  auto other = Make(*PresetModelConfig("gpt", "gpt-tiny"), 8);
  EXPECT_TRUE(torch::equal(params["transformer.wte.weight"], same->named_parameters()["transformer.wte.weight"]));
  EXPECT_FALSE(torch::equal(params["transformer.wte.weight"], other->named_parameters()["transformer.wte.weight"]));
}

TEST(LlamaTest, HuggingFaceNamesNoBiasesAndGroupedQueryShapes) {
  ModelConfig c = *PresetModelConfig("llama", "llama-tiny");
  c.n_layer = 1;
  c.n_embd = 16;
  c.n_head = 4;
  c.n_kv_head = 2;
  c.intermediate_size = 24;
  c.vocab_size = 32;
  auto model = Make(c);
  EXPECT_THAT(NamesAndShapes(*model),
              ElementsAreArray(
                  {"model.embed_tokens.weight [32, 16]", "model.layers.0.self_attn.q_proj.weight [16, 16]",
                   "model.layers.0.self_attn.k_proj.weight [8, 16]", "model.layers.0.self_attn.v_proj.weight [8, 16]",
                   "model.layers.0.self_attn.o_proj.weight [16, 16]", "model.layers.0.mlp.gate_proj.weight [24, 16]",
                   "model.layers.0.mlp.up_proj.weight [24, 16]", "model.layers.0.mlp.down_proj.weight [16, 24]",
                   "model.layers.0.input_layernorm.weight [16]", "model.layers.0.post_attention_layernorm.weight [16]",
                   "model.norm.weight [16]", "lm_head.weight [32, 16]"}));
  EXPECT_TRUE(model->TiedParameters().empty());
}

class EveryModelTest : public ::testing::TestWithParam<const char*> {};

TEST_P(EveryModelTest, InitialLossIsNearUniformAndFutureTokensAreNotSeen) {
  const std::string preset = GetParam();
  ModelConfig c = *PresetModelConfig(preset.substr(0, preset.find('-')), preset);
  c.n_layer = 2;
  auto model = Make(c);
  torch::manual_seed(0);
  auto tokens = torch::randint(c.vocab_size, {2, 16}, torch::kLong);
  auto targets = torch::randint(c.vocab_size, {2, 16}, torch::kLong);
  const double loss = model->Loss(tokens, targets).item<double>();
  EXPECT_NEAR(loss, std::log(static_cast<double>(c.vocab_size)), 0.3);
  // Changing the last token leaves every earlier position's logits unchanged.
  auto changed = tokens.clone();
  changed.index_put_({0, 15}, (tokens[0][15].item<int64_t>() + 1) % c.vocab_size);
  auto before = model->Logits(tokens).narrow(1, 0, 15);
  auto after = model->Logits(changed).narrow(1, 0, 15);
  EXPECT_TRUE(torch::allclose(before, after, 0, 0));
}

// Decoding with the key/value cache (a prompt of 5, then one token at a
// time, then 2 with a padding position forgotten) gives the logits of the
// whole sequence at once.
TEST_P(EveryModelTest, CachedDecodingComputesTheWholeSequencesLogits) {
  const std::string preset = GetParam();
  ModelConfig c = *PresetModelConfig(preset.substr(0, preset.find('-')), preset);
  c.n_layer = 2;
  if (c.model == "llama") c.n_kv_head = c.n_head / 2;  // grouped-query attention
  auto model = Make(c);
  model->eval();
  torch::manual_seed(0);
  auto tokens = torch::randint(c.vocab_size, {1, 10}, torch::kLong);
  const at::Tensor whole = model->Logits(tokens);
  ASSERT_TRUE(model->SupportsDecoding());
  model->StartDecoding();
  std::vector<at::Tensor> pieces = {model->Logits(tokens.narrow(1, 0, 5))};
  for (int64_t t = 5; t < 8; ++t) pieces.push_back(model->Logits(tokens.narrow(1, t, 1)));
  pieces.push_back(model->Logits(tokens.narrow(1, 8, 2)).narrow(1, 0, 1));
  model->KeepPositions(9);  // position 9 was padding
  pieces.push_back(model->Logits(tokens.narrow(1, 9, 1)));
  model->StopDecoding();
  const at::Tensor decoded = torch::cat(pieces, 1);
  EXPECT_LE((decoded - whole).abs().max().item<double>(), 1e-5);
  EXPECT_TRUE(torch::allclose(model->Logits(tokens), whole, 0, 0)) << "stopped: whole sequences again";
}

// checkpoint_modules: attention and MLP blocks that recompute in backward
// give the same gradients (dropout included), in fp32 and under bf16
// autocast (one scope around forward and backward, as a training step has),
// and keep fewer bytes.
TEST(RecomputeTest, RecomputedBlocksGiveTheSameGradientsAndKeepLess) {
  for (const auto& run_of :
       std::vector<std::pair<std::string, bool>>{{"gpt", false}, {"gpt", true}, {"llama", false}, {"llama", true}}) {
    const std::string name = run_of.first;
    const bool bf16 = run_of.second;
    SCOPED_TRACE(absl::StrCat(name, bf16 ? " bf16" : " fp32"));
    ModelConfig c = *PresetModelConfig(name, name + "-tiny");
    c.n_layer = 2;
    c.dropout = 0.1;
    auto tokens = torch::randint(c.vocab_size, {4, 64}, torch::kLong);
    MemoryCounter& memory = MemoryCounter::Install();
    auto run = [&](bool recompute, int64_t* kept) {
      auto model = Make(c);
      int recomputable = 0;
      for (const auto& item : model->named_modules()) {
        if (auto* module = dynamic_cast<RecomputableModule*>(item.value().get())) {
          module->set_recompute(recompute);
          ++recomputable;
        }
      }
      EXPECT_EQ(recomputable, 2 * c.n_layer) << "attention and MLP of each block";
      torch::manual_seed(11);
      if (bf16) {
        at::autocast::set_cpu_enabled(true);
        at::autocast::set_autocast_cpu_dtype(at::kBFloat16);
        at::autocast::increment_nesting();
      }
      const int64_t before = memory.live_bytes();
      at::Tensor loss = model->Loss(tokens, tokens);
      *kept = memory.live_bytes() - before;
      loss.backward();
      if (bf16) {
        at::autocast::decrement_nesting();
        at::autocast::clear_cache();
        at::autocast::set_cpu_enabled(false);
      }
      std::map<std::string, at::Tensor> grads;
      for (const auto& item : model->named_parameters()) grads[item.key()] = item.value().grad();
      return grads;
    };
    int64_t kept_plain = 0, kept_recomputed = 0;
    auto plain = run(false, &kept_plain);
    auto recomputed = run(true, &kept_recomputed);
    for (const auto& [key, grad] : plain) {
      ASSERT_TRUE(grad.defined() && recomputed[key].defined()) << key;
      EXPECT_TRUE(torch::equal(recomputed[key], grad)) << key << " " << (recomputed[key] - grad).abs().max();
    }
    EXPECT_LT(kept_recomputed, kept_plain / 2);
    std::printf("%s: bytes kept for backward %lld plain, %lld with attention and MLP recomputed\n", name.c_str(),
                static_cast<long long>(kept_plain), static_cast<long long>(kept_recomputed));
  }
  MemoryCounter::Uninstall();
}

TEST_P(EveryModelTest, LearnsARepeatingSequence) {
  const std::string preset = GetParam();
  ModelConfig c = *PresetModelConfig(preset.substr(0, preset.find('-')), preset);
  c.n_layer = 2;
  auto model = Make(c);
  auto sequence = torch::arange(17, torch::kLong).remainder(5).unsqueeze(0);
  auto tokens = sequence.narrow(1, 0, 16), targets = sequence.narrow(1, 1, 16);
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(3e-3));
  double first = 0, last = 0;
  for (int step = 0; step < 30; ++step) {
    optimizer.zero_grad();
    auto loss = model->Loss(tokens, targets);
    loss.backward();
    optimizer.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  EXPECT_LT(last, first * 0.3) << "first " << first << " last " << last;
}

INSTANTIATE_TEST_SUITE_P(Zoo, EveryModelTest, ::testing::Values("gpt-tiny", "llama-tiny", "mlp-tiny"),
                         [](const auto& info) {
                           std::string name = info.param;
                           return name.substr(0, name.find('-'));
                         });

// The names of the autograd nodes behind a tensor.
std::set<std::string> BackwardNodeNames(const at::Tensor& t) {
  std::set<std::string> names;
  std::vector<torch::autograd::Node*> todo = {t.grad_fn().get()}, seen;
  while (!todo.empty()) {
    torch::autograd::Node* node = todo.back();
    todo.pop_back();
    if (node == nullptr || std::find(seen.begin(), seen.end(), node) != seen.end()) continue;
    seen.push_back(node);
    names.insert(node->name());
    for (const torch::autograd::Edge& edge : node->next_edges()) todo.push_back(edge.function.get());
  }
  return names;
}

// In fp32 on the CPU, the zoo's attention is the fused operator (no [B, H, T,
// T] scores) unless attention dropout is on in training.
TEST(AttentionTest, TheZooTakesTheFusedCpuKernelsWithoutDropout) {
  for (const std::string preset : {"gpt-tiny", "llama-tiny"}) {
    ModelConfig c = *PresetModelConfig(preset.substr(0, preset.find('-')), preset);
    c.n_layer = 1;
    torch::manual_seed(0);
    auto tokens = torch::randint(c.vocab_size, {2, 16}, torch::kLong);
    auto targets = torch::randint(c.vocab_size, {2, 16}, torch::kLong);
    auto fused = Make(c);
    const at::Tensor loss = fused->Loss(tokens, targets);
    auto has = [](const std::set<std::string>& names, const std::string& part) {
      return std::any_of(names.begin(), names.end(), [&](const std::string& n) { return n.find(part) != n.npos; });
    };
    const std::set<std::string> fused_nodes = BackwardNodeNames(loss);
    EXPECT_TRUE(has(fused_nodes, "CausalAttentionFunction")) << preset;
    EXPECT_EQ(fused_nodes.count("SoftmaxBackward0"), 0u) << preset;  // the loss's is LogSoftmaxBackward0

    c.dropout = 0.1;
    auto with_dropout = Make(c);
    with_dropout->train();
    const std::set<std::string> unfused_nodes = BackwardNodeNames(with_dropout->Loss(tokens, targets));
    EXPECT_FALSE(has(unfused_nodes, "CausalAttentionFunction")) << preset;
    EXPECT_EQ(unfused_nodes.count("SoftmaxBackward0"), 1u) << preset;
  }
}

TEST(ModelConfigTest, UnknownNamesAndBadSizesAreClearErrors) {
  EXPECT_THAT(std::string(PresetModelConfig("bert", "x").status().message()),
              HasSubstr("unknown model 'bert'; choose gpt, llama, mlp"));
  EXPECT_THAT(std::string(PresetModelConfig("gpt", "gpt-huge").status().message()),
              HasSubstr("choose one of gpt-tiny, gpt2-124m"));
  ModelConfig c = *PresetModelConfig("gpt", "gpt-tiny");
  c.n_head = 3;
  EXPECT_THAT(std::string(CreateModel(c, 1).status().message()), HasSubstr("n_embd=256 is not divisible by n_head=3"));
  c = *PresetModelConfig("llama", "llama-tiny");
  c.n_kv_head = 3;
  EXPECT_THAT(std::string(ValidateModelConfig(c).message()), HasSubstr("n_head=4 is not divisible by n_kv_head=3"));
  c.n_kv_head = 2;
  c.vocab_size = 70000;
  EXPECT_THAT(std::string(ValidateModelConfig(c).message()), HasSubstr("exceeds 65536"));
}

}  // namespace
}  // namespace trident

namespace trident {
namespace {

// The layers' parameter lists cover the model's parameters, each once, except a
// tied parameter, which every layer that reads it lists.
TEST_P(EveryModelTest, LayersCoverEveryParameterAndChainToTheLogits) {
  const std::string preset = GetParam();
  ModelConfig c = *PresetModelConfig(preset.substr(0, preset.find('-')), preset);
  c.n_layer = 2;
  auto model = Make(c);
  EXPECT_EQ(model->NumLayers(), 4);
  EXPECT_EQ(model->LayerName(0), "embedding");
  EXPECT_EQ(model->LayerName(3), "head");
  std::map<std::string, int> readers;
  for (int64_t i = 0; i < model->NumLayers(); ++i) {
    for (const auto& [name, tensor] : model->LayerParameters(i)) {
      ++readers[name];
      EXPECT_TRUE(tensor.is_same(model->named_parameters()[name])) << name;
      if (i > 0 && i < model->NumLayers() - 1) {
        EXPECT_EQ(name.rfind(model->LayerName(i) + ".", 0), 0u) << name;
      }
    }
  }
  EXPECT_EQ(readers.size(), model->named_parameters().size());
  for (const auto& [name, count] : readers) {
    const bool tied = model->TiedParameters().size() == 1 && name == "transformer.wte.weight";
    EXPECT_EQ(count, tied ? 2 : 1) << name;
  }
  auto tokens = torch::randint(c.vocab_size, {2, 8}, torch::kLong);
  at::Tensor x = tokens;
  for (int64_t i = 0; i < model->NumLayers(); ++i) x = model->ForwardLayer(i, x);
  EXPECT_TRUE(torch::equal(x, model->Logits(tokens)));
}

}  // namespace
}  // namespace trident

namespace trident {
namespace {

// A part built alone holds exactly the weights those layers have in the whole
// model, under the same names, and refuses layers it does not hold.
TEST_P(EveryModelTest, PartsBuiltAloneMatchTheWholeModel) {
  const std::string preset = GetParam();
  ModelConfig c = *PresetModelConfig(preset.substr(0, preset.find('-')), preset);
  c.n_layer = 3;
  auto whole = Make(c, 21);
  auto whole_params = whole->named_parameters();
  auto tokens = torch::randint(c.vocab_size, {1, 8}, torch::kLong);
  at::Tensor x = tokens;
  for (auto [first, end] : {std::pair<int64_t, int64_t>{0, 2}, {2, 4}, {4, 5}}) {
    auto part = CreateModelLayers(c, 21, first, end);
    ASSERT_TRUE(part.ok()) << part.status();
    for (const auto& item : (*part)->named_parameters()) {
      ASSERT_TRUE(whole_params.contains(item.key())) << item.key();
      EXPECT_TRUE(torch::equal(item.value(), whole_params[item.key()])) << item.key();
    }
    for (int64_t i = first; i < end; ++i) x = (*part)->ForwardLayer(i, x);
    const int64_t absent = end < 5 ? end : 0;
    EXPECT_THROW((*part)->ForwardLayer(absent, x), std::out_of_range);
  }
  EXPECT_TRUE(torch::allclose(x, whole->Logits(tokens), 1e-6, 1e-6));
  EXPECT_THAT(std::string(CreateModelLayers(c, 1, 3, 9).status().message()),
              HasSubstr("are not a range of the model's 5 layers"));

  // Several ranges (an interleaved pipeline rank's chunks): layers 0 and 3-4.
  auto chunks = CreateModelLayers(c, 21, LayerRanges{{0, 1}, {3, 5}});
  ASSERT_TRUE(chunks.ok()) << chunks.status();
  for (const auto& item : (*chunks)->named_parameters()) {
    EXPECT_TRUE(torch::equal(item.value(), whole_params[item.key()])) << item.key();
  }
  EXPECT_EQ((*chunks)->LayerParameters(3).size(), whole->LayerParameters(3).size());
  try {
    (*chunks)->ForwardLayer(1, x);
    ADD_FAILURE() << "layer 1 is not materialised";
  } catch (const std::out_of_range& e) {
    EXPECT_THAT(e.what(), HasSubstr("(layers 0 to 0, 3 to 4)"));
  }
}

// Deferred values (ZeRO-3's build): a layer's parameters get their values
// when MaterializeLayer reaches the first layer that reads them, the values
// the model built whole has, and only once (a tied embedding keeps the first
// layer's, whatever it became since).
TEST_P(EveryModelTest, DeferredValuesAreDrawnLayerByLayer) {
  const std::string preset = GetParam();
  ModelConfig c = *PresetModelConfig(preset.substr(0, preset.find('-')), preset);
  c.n_layer = 3;
  auto whole = Make(c, 21);
  auto whole_params = whole->named_parameters();
  auto deferred = CreateModelLayers(c, 21, LayerRanges{{0, 5}}, /*defer_values=*/true);
  ASSERT_TRUE(deferred.ok()) << deferred.status();
  auto params = (*deferred)->named_parameters();
  torch::NoGradGuard no_grad;
  for (auto& item : params) item.value().fill_(-7.0f);  // whatever the memory held
  std::set<const c10::TensorImpl*> drawn;
  for (int64_t i = 0; i < (*deferred)->NumLayers(); ++i) {
    for (const auto& [name, p] : (*deferred)->LayerParameters(i)) {
      if (!drawn.count(p.unsafeGetTensorImpl())) {
        EXPECT_TRUE((p == -7.0f).all().item<bool>()) << name << " drawn early";
      }
    }
    (*deferred)->MaterializeLayer(i);
    for (const auto& [name, p] : (*deferred)->LayerParameters(i)) {
      const bool first_time = drawn.insert(p.unsafeGetTensorImpl()).second;
      const std::string stored = whole->TiedParameters().count(name) ? whole->TiedParameters().at(name) : name;
      const at::Tensor expected = first_time ? whole_params[stored] : whole_params[stored] + 1.0f;
      EXPECT_TRUE(torch::equal(p, expected)) << "layer " << i << ": " << name;
    }
    if (i == 0) {
      for (auto& [name, p] : (*deferred)->LayerParameters(0)) p.add_(1.0f);  // not drawn again
    }
  }
  EXPECT_EQ(drawn.size(), params.size());
}

}  // namespace
}  // namespace trident
