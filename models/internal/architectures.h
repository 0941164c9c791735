// Constructors of the model zoo's architectures, private to //models.
#ifndef TRIDENT_MODELS_INTERNAL_ARCHITECTURES_H_
#define TRIDENT_MODELS_INTERNAL_ARCHITECTURES_H_

#include <memory>

#include "models/models.h"

namespace trident {
namespace internal {

// Each builds the layers in `ranges` of an uninitialised model; CreateModelLayers
// draws the weights.
std::shared_ptr<LanguageModel> BuildGpt(const ModelConfig& config, const LayerRanges& ranges);
std::shared_ptr<LanguageModel> BuildLlama(const ModelConfig& config, const LayerRanges& ranges);
std::shared_ptr<LanguageModel> BuildMlp(const ModelConfig& config, const LayerRanges& ranges);

// Llama's SwiGLU width: intermediate_size, or 2/3 of 4 * n_embd rounded up to
// a multiple of 32.
int64_t LlamaIntermediateSize(const ModelConfig& config);

// Registers the blocks of the materialised layers (block b is layer b + 1) on
// `holder` under their index names, so parameter names match the full model's;
// the returned vector has nullptr for blocks not built.
template <typename Block, typename Make>
std::vector<Block> BuildBlocks(const LanguageModel& model, torch::nn::Module& holder,
                               int64_t count, Make make) {
  std::vector<Block> blocks(count, Block(nullptr));
  for (int64_t b = 0; b < count; ++b) {
    if (model.HasLayer(b + 1)) blocks[b] = holder.register_module(std::to_string(b), make());
  }
  return blocks;
}

// `module`'s parameters named "<prefix>.<name>".
std::vector<std::pair<std::string, at::Tensor>> PrefixedParameters(const torch::nn::Module& module,
                                                                   const std::string& prefix);

// Causal attention over q, k, v of shape [B, heads, T, head_dim]; keys and values
// may have fewer heads than queries (grouped-query attention).
at::Tensor CausalAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           double dropout, bool training);

}  // namespace internal
}  // namespace trident

#endif  // TRIDENT_MODELS_INTERNAL_ARCHITECTURES_H_
