// Constructors of the model zoo's architectures, private to //models.
#ifndef TRIDENT_MODELS_INTERNAL_ARCHITECTURES_H_
#define TRIDENT_MODELS_INTERNAL_ARCHITECTURES_H_

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "base/registry.h"
#include "models/models.h"

namespace trident {
namespace internal {

// A zoo architecture (ModelConfig::model), registered by name in
// ArchitectureRegistry from its own file (gpt.cc, llama.cc, mlp.cc).
struct Architecture {
  using Sizes = std::vector<std::pair<std::string, int64_t>>;
  // Builds the layers in `ranges` of an uninitialised model; CreateModelLayers
  // draws the weights.
  std::function<std::shared_ptr<LanguageModel>(const ModelConfig& config, const LayerRanges& ranges)> build;
  // Its checks of a config beyond the common ones (positive sizes, dropout,
  // the tensor-parallel place).
  std::function<absl::Status(const ModelConfig& config)> validate;
  // The sizes tensor parallelism splits beyond n_head and the vocabulary.
  std::function<Sizes(const ModelConfig& config)> tensor_parallel_sizes;
  // The weights (by name suffix) drawn with init_method_std / sqrt(2 n_layer):
  // GPT-2's residual projections. Empty: none.
  std::string residual_projection_suffix;
  // LanguageModel::TiedParameters of a model of `config`, before it is built
  // (may be empty: none).
  std::function<std::map<std::string, std::string>(const ModelConfig& config)> tied_parameters;
  // Whether its blocks attend (for the FLOPs of a step).
  bool attention = true;
};
Registry<Architecture>& ArchitectureRegistry();

// n_embd divides into n_head heads (the attention architectures' check).
absl::Status CheckHeadsDivideWidth(const ModelConfig& config);

// The tensor parallelism of the token embedding and the head: the model's,
// or, without parallel_vocab, none (every rank holds the whole vocabulary).
TensorParallelism VocabularyParallelism(const ModelConfig& config);

// The token ids [B, T] the embedding looks up: with sequence parallelism and
// the whole vocabulary, this rank's sequence shard (a vocabulary-parallel
// embedding looks up all of them and reduce-scatters the sum into shards).
at::Tensor EmbeddedIds(const at::Tensor& ids, const ModelConfig& config);

// Llama's SwiGLU width: intermediate_size, or 2/3 of 4 * n_embd rounded up to
// a multiple of 32.
int64_t LlamaIntermediateSize(const ModelConfig& config);

// Registers the blocks of the materialised layers (block b is layer b + 1,
// made by make(b)) on `holder` under their index names, so parameter names
// match the full model's; the returned vector has nullptr for blocks not built.
template <typename Block, typename Make>
std::vector<Block> BuildBlocks(const LanguageModel& model, torch::nn::Module& holder, int64_t count, Make make) {
  std::vector<Block> blocks(count, Block(nullptr));
  for (int64_t b = 0; b < count; ++b) {
    if (model.HasLayer(b + 1)) blocks[b] = holder.register_module(std::to_string(b), make(b));
  }
  return blocks;
}

// `module`'s parameters named "<prefix>.<name>".
std::vector<std::pair<std::string, at::Tensor>> PrefixedParameters(const torch::nn::Module& module,
                                                                   const std::string& prefix);

// The keys and values incremental decoding keeps (LayerSequence::StartDecoding),
// per attention layer, and how many positions the embedding has looked up.
class KeyValueCache {
 public:
  bool active() const { return active_; }
  void Start() {
    Stop();
    active_ = true;
  }
  void Stop() {
    active_ = false;
    layers_.clear();
    embedded_ = 0;
  }
  // Forgets positions from `n` on.
  void Keep(int64_t n);
  // Positions cached for attention layer `layer`.
  int64_t Length(int64_t layer) const;
  // Appends `k` and `v` [B, heads, T, head_dim] of the new positions to layer
  // `layer`'s cache and returns all its keys and values.
  std::pair<at::Tensor, at::Tensor> Append(int64_t layer, const at::Tensor& k, const at::Tensor& v);
  // The first position of `count` new tokens the embedding looks up (counted).
  int64_t Embed(int64_t count) {
    embedded_ += count;
    return embedded_ - count;
  }

 private:
  bool active_ = false;
  std::map<int64_t, std::pair<at::Tensor, at::Tensor>> layers_;
  int64_t embedded_ = 0;
};

// Causal attention of q [B, heads, Tq, head_dim] over k and v [B, heads, Tk,
// head_dim] with Tk >= Tq: query i is position Tk - Tq + i (the keys before
// the queries' are cached ones). Keys and values may have fewer heads than
// queries (grouped-query attention). Through FusedCausalAttention
// (replace/replace.h) when `fused`, and on fp32 CPU tensors without
// attention dropout in training except while tracing (a traced graph keeps
// the unfused operators, which graph analyses read).
at::Tensor CausalAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double dropout, bool training,
                           bool fused = false);

}  // namespace internal
}  // namespace trident

#endif  // TRIDENT_MODELS_INTERNAL_ARCHITECTURES_H_
