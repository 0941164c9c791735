// Constructors of the model zoo's architectures, private to //models.
#ifndef TRIDENT_MODELS_INTERNAL_ARCHITECTURES_H_
#define TRIDENT_MODELS_INTERNAL_ARCHITECTURES_H_

#include <memory>

#include "models/models.h"

namespace trident {
namespace internal {

// Each builds an uninitialised model; CreateModel draws the weights.
std::shared_ptr<LanguageModel> BuildGpt(const ModelConfig& config);
std::shared_ptr<LanguageModel> BuildLlama(const ModelConfig& config);
std::shared_ptr<LanguageModel> BuildMlp(const ModelConfig& config);

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
