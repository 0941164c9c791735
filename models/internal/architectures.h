// Constructors of the model zoo's architectures, private to //models.
#ifndef TRIDENT_MODELS_INTERNAL_ARCHITECTURES_H_
#define TRIDENT_MODELS_INTERNAL_ARCHITECTURES_H_

#include <memory>

#include "models/models.h"

namespace trident {
namespace internal {

// Each builds layers [first, end) of an uninitialised model; CreateModelLayers
// draws the weights.
std::shared_ptr<LanguageModel> BuildGpt(const ModelConfig& config, int64_t first, int64_t end);
std::shared_ptr<LanguageModel> BuildLlama(const ModelConfig& config, int64_t first, int64_t end);
std::shared_ptr<LanguageModel> BuildMlp(const ModelConfig& config, int64_t first, int64_t end);

// Registers `blocks` (built for the indices in [first, end)) on `holder` under
// their index names, so parameter names match the full model's; the returned
// vector has nullptr for blocks not built.
template <typename Block, typename Make>
std::vector<Block> BuildBlocks(torch::nn::Module& holder, int64_t count, int64_t first,
                               int64_t end, Make make) {
  std::vector<Block> blocks(count, Block(nullptr));
  for (int64_t i = std::max<int64_t>(first, 0); i < std::min(end, count); ++i) {
    blocks[i] = holder.register_module(std::to_string(i), make());
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
