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
    fc1 = register_module("fc1", ParallelLinear(c.n_embd, hidden));
    fc2 = register_module("fc2", ParallelLinear(hidden, c.n_embd));
    dropout = register_module("dropout", torch::nn::Dropout(c.dropout));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + dropout(fc2(torch::gelu(fc1(norm(x))))); }
  torch::nn::LayerNorm norm{nullptr};
  ParallelLinear fc1{nullptr}, fc2{nullptr};
  torch::nn::Dropout dropout{nullptr};
};
TORCH_MODULE(ResidualBlock);

class Mlp : public LanguageModel {
 public:
  Mlp(const ModelConfig& c, const LayerRanges& ranges) : LanguageModel(c, ranges) {
    if (HasLayer(0)) embed = register_module("embed", torch::nn::Embedding(c.vocab_size, c.n_embd));
    blocks_holder = register_module("blocks", std::make_shared<torch::nn::Module>());
    blocks = BuildBlocks<ResidualBlock>(*this, *blocks_holder, c.n_layer, [&](int64_t) { return ResidualBlock(c); });
    if (HasLayer(c.n_layer + 1)) {
      norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.n_embd})));
      head = register_module("head", ParallelLinear(c.n_embd, c.vocab_size));
    }
  }

  std::string BlockPrefix() const override { return "blocks."; }

  at::Tensor ForwardLayer(int64_t i, const at::Tensor& x) override {
    CheckLayer(i);
    if (i == 0) return embed(x);
    if (i == NumLayers() - 1) return head(norm(x));
    return blocks[i - 1]->forward(x);
  }

  std::vector<std::pair<std::string, at::Tensor>> LayerParameters(int64_t i) override {
    CheckLayer(i);
    if (i == 0) return {{"embed.weight", embed->weight}};
    if (i == NumLayers() - 1) {
      auto params = PrefixedParameters(*norm, "norm");
      for (auto& p : PrefixedParameters(*head, "head")) params.push_back(p);
      return params;
    }
    return PrefixedParameters(*blocks[i - 1], LayerName(i));
  }

  torch::nn::Embedding embed{nullptr};
  std::shared_ptr<torch::nn::Module> blocks_holder;
  std::vector<ResidualBlock> blocks;
  torch::nn::LayerNorm norm{nullptr};
  ParallelLinear head{nullptr};
};

}  // namespace

TRIDENT_REGISTER(ArchitectureRegistry, "mlp",
                 Architecture{[](const ModelConfig& config, const LayerRanges& ranges)
                                  -> std::shared_ptr<LanguageModel> { return std::make_shared<Mlp>(config, ranges); },
                              [](const ModelConfig& c) {
                                if (c.tp.size == 1) return absl::OkStatus();
                                return absl::InvalidArgumentError(
                                    "model 'mlp' has no tensor-parallel form; use gpt or llama, or tp=1");
                              },
                              [](const ModelConfig&) { return Architecture::Sizes{}; }, "", nullptr,
                              /*attention=*/false});

}  // namespace internal
}  // namespace trident
