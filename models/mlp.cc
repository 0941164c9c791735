// A deep residual MLP over token embeddings: each position is predicted from its
// own token alone. Small and fast; for tests of the training machinery.
#include <torch/torch.h>

#include "models/internal/architectures.h"

namespace trident {
namespace internal {
namespace {

class ResidualBlockImpl : public torch::nn::Module {
 public:
  explicit ResidualBlockImpl(const ModelConfig& c) {
    const int64_t hidden = c.intermediate_size > 0 ? c.intermediate_size : 4 * c.n_embd;
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.n_embd})));
    fc1 = register_module("fc1", torch::nn::Linear(c.n_embd, hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, c.n_embd));
    dropout = register_module("dropout", torch::nn::Dropout(c.dropout));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return x + dropout(fc2(torch::gelu(fc1(norm(x)))));
  }
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::Dropout dropout{nullptr};
};
TORCH_MODULE(ResidualBlock);

class Mlp : public LanguageModel {
 public:
  explicit Mlp(const ModelConfig& c) : LanguageModel(c) {
    embed = register_module("embed", torch::nn::Embedding(c.vocab_size, c.n_embd));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < c.n_layer; ++i) blocks->push_back(ResidualBlock(c));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.n_embd})));
    head = register_module("head", torch::nn::Linear(c.n_embd, c.vocab_size));
  }
  int64_t NumLayers() const override { return config().n_layer + 2; }

  std::string LayerName(int64_t i) const override {
    if (i == 0) return "embedding";
    if (i == NumLayers() - 1) return "head";
    return "blocks." + std::to_string(i - 1);
  }

  at::Tensor ForwardLayer(int64_t i, const at::Tensor& x) override {
    if (i == 0) return embed(x);
    if (i == NumLayers() - 1) return head(norm(x));
    return blocks[i - 1]->as<ResidualBlock>()->forward(x);
  }

  std::vector<std::pair<std::string, at::Tensor>> LayerParameters(int64_t i) override {
    if (i == 0) return {{"embed.weight", embed->weight}};
    if (i == NumLayers() - 1) {
      auto params = PrefixedParameters(*norm, "norm");
      for (auto& p : PrefixedParameters(*head, "head")) params.push_back(p);
      return params;
    }
    return PrefixedParameters(*blocks[i - 1], LayerName(i));
  }

  torch::nn::Embedding embed{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear head{nullptr};
};

}  // namespace

std::shared_ptr<LanguageModel> BuildMlp(const ModelConfig& config) {
  return std::make_shared<Mlp>(config);
}

}  // namespace internal
}  // namespace trident
