// models: the model zoo, built from plain LibTorch modules.
//
//   gpt    GPT-2 as the minimal PyTorch reference implementations define it
//          (parameter names transformer.wte.weight ... lm_head.weight, tied head)
//   llama  RMSNorm, rotary embeddings, SwiGLU, no biases, untied head, optional GQA
//          (Hugging Face names model.embed_tokens.weight ... lm_head.weight)
//   mlp    a deep residual MLP over token embeddings, for fast tests
//
//   absl::StatusOr<ModelConfig> config = PresetModelConfig("gpt", "gpt-tiny");
//   config->n_layer = 2;  // any field may be overridden
//   absl::StatusOr<std::shared_ptr<LanguageModel>> model = CreateModel(*config, /*seed=*/1);
//   at::Tensor loss = (*model)->Loss(tokens, targets);  // [B, T] int64 each
#ifndef TRIDENT_MODELS_MODELS_H_
#define TRIDENT_MODELS_MODELS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "graph/graph.h"
#include "replace/replace.h"
#include "tensor_parallel/tensor_parallel.h"

namespace trident {
namespace internal {
class KeyValueCache;  // models/internal/architectures.h
}  // namespace internal

// Every architecture's size fields; fields an architecture does not use are ignored.
struct ModelConfig {
  std::string model = "gpt";      // "gpt", "llama" or "mlp"
  int64_t n_layer = 4;            // transformer blocks (mlp: residual blocks)
  int64_t n_head = 4;             // attention heads
  int64_t n_embd = 256;           // hidden width
  int64_t block_size = 128;       // longest sequence (context length)
  int64_t vocab_size = 256;       // token ids are in [0, vocab_size)
  double dropout = 0.0;           // dropout probability in training mode
  int64_t n_kv_head = 0;          // llama: key/value heads (0: n_head, no GQA)
  int64_t intermediate_size = 0;  // llama: SwiGLU width (0: from n_embd); mlp: 4 * n_embd
  double rope_theta = 10000.0;    // llama: rotary embedding base
  // Standard deviation of the normal initialisation of weight matrices (GPT-2's
  // residual projections: divided by sqrt(2 n_layer)).
  double init_method_std = 0.02;
  // gpt: the head reads the token embedding's matrix (GPT-2); false gives it
  // its own, lm_head.weight (Merak's no_tie_modules).
  bool tie_word_embeddings = true;
  // gpt and llama: the tensor-parallel shard this process builds (heads,
  // MLP width and, with tp.parallel_vocab, the vocabulary split tp.size
  // ways; sequence parallelism).
  TensorParallelism tp;
};

// The named sizes of `model`: gpt-tiny, gpt2-124m, gpt2-350m, gpt2-774m; llama-tiny,
// llama-160m, llama-1b, llama-3b, llama-7b; mlp-tiny, mlp-small.
absl::StatusOr<ModelConfig> PresetModelConfig(absl::string_view model, absl::string_view preset);
std::vector<std::string> PresetNames(absl::string_view model);

// Errors (naming the field) for sizes that cannot build a model.
absl::Status ValidateModelConfig(const ModelConfig& config);

// LanguageModel::TiedParameters of a model of `config` (a valid one), known
// before it is built.
std::map<std::string, std::string> ModelTiedParameters(const ModelConfig& config);
// The FLOPs per token of a training step beyond 6 per parameter: attention's
// 12 L C T (scores and weighted values, forward and backward); 0 without it.
double AttentionFlopsPerToken(const ModelConfig& config);

// A causal language model: tokens [B, T] (int64, T <= block_size) to logits
// [B, T, vocab]. Every zoo model is a LayerSequence: an embedding layer
// ("embedding"), its blocks (named by their parameter prefix, such as
// "transformer.h.3"), and a head ("head") that produces the logits.
class LanguageModel : public torch::nn::Module, public LayerSequence, public ReplaceableModule {
 public:
  // A model of config.n_layer + 2 layers that materialises the layers in
  // `ranges` only (all of them when empty).
  explicit LanguageModel(ModelConfig config, LayerRanges ranges = {});
  int64_t NumLayers() const override { return config_.n_layer + 2; }
  // Whether layer i is materialised here.
  bool HasLayer(int64_t i) const;
  // "embedding", then the blocks as BlockPrefix() + index, then "head".
  std::string LayerName(int64_t i) const override;
  // Layer i of the zoo on one tensor: token ids [B, T] for the embedding,
  // hidden states [B, T, C] after it (the head returns logits).
  virtual at::Tensor ForwardLayer(int64_t i, const at::Tensor& x) = 0;
  // LayerSequence: layer 0 reads batch field 0 (the tokens); the others take
  // the previous layer's one output.
  Values ForwardLayer(int64_t i, const Values& inputs, const Batch& batch) override;
  // All layers in order. With tensor parallelism, this rank's vocabulary
  // slice of the logits [B, T, vocab / tp].
  at::Tensor Logits(const at::Tensor& tokens);
  // Mean token cross-entropy of Logits(tokens) against `targets` [B, T].
  at::Tensor Loss(const at::Tensor& tokens, const at::Tensor& targets);
  // Mean token cross-entropy of `logits` against `targets` (vocabulary-parallel
  // with tensor parallelism: the full logits are never gathered).
  at::Tensor SequenceLoss(const at::Tensor& logits, const at::Tensor& targets);
  // module_replace: the part holding the head offers fused_cross_entropy for
  // the loss over its whole vocabulary (not split over tensor parallelism).
  bool Offers(const std::string& pair) const override;
  // LayerSequence: SequenceLoss of the head's logits against batch field 1.
  at::Tensor Loss(const Values& outputs, const Batch& batch) override;
  // Incremental decoding (LayerSequence): attention layers cache their keys
  // and values; positions continue where the cache ends.
  bool SupportsDecoding() const override { return true; }
  void StartDecoding() override;
  void KeepPositions(int64_t n) override;
  void StopDecoding() override;
  // The cache the zoo's attention layers share (for their constructors).
  internal::KeyValueCache* key_value_cache() const { return cache_.get(); }
  void To(const at::Device& device) override { torch::nn::Module::to(device); }
  void SetTraining(bool training) override { torch::nn::Module::train(training); }
  // The parameters split over the tensor-parallel group, by name, and how each
  // is a slice of the single-process parameter; the others are replicated.
  std::map<std::string, ShardSpec> ParameterShards() const;
  // Parameters stored once but known under a second name: alias -> stored name
  // (gpt: "lm_head.weight" -> "transformer.wte.weight"). named_parameters()
  // lists each stored tensor once, under its stored name.
  virtual std::map<std::string, std::string> TiedParameters() const { return {}; }
  // Number of scalar parameters, tied ones counted once.
  int64_t NumParameters() const;
  const ModelConfig& config() const { return config_; }
  // A model built with deferred values (CreateModelLayers' defer_values)
  // draws the values of layer i's parameters here, those not drawn yet.
  void MaterializeLayer(int64_t i) override;
  // Defers the initial values of every parameter: `draw` (stored name,
  // parameter) writes one when MaterializeLayer reaches it.
  void DeferValues(std::function<void(const std::string&, at::Tensor&)> draw);

 protected:
  // The parameter prefix of the blocks, such as "transformer.h.".
  virtual std::string BlockPrefix() const = 0;
  // Throws std::out_of_range naming the layer when it is not materialised here.
  void CheckLayer(int64_t i) const;

 private:
  ModelConfig config_;
  LayerRanges ranges_;
  std::shared_ptr<internal::KeyValueCache> cache_;
  std::function<void(const std::string&, at::Tensor&)> draw_;
  std::map<const c10::TensorImpl*, std::string> undrawn_;  // stored names
};

// Builds `config`'s model. Every parameter is drawn from its own generator,
// seeded from `seed` and the parameter's name, so the same seed gives the same
// weights on every rank and every run, whichever layers a process builds.
absl::StatusOr<std::shared_ptr<LanguageModel>> CreateModel(const ModelConfig& config, uint64_t seed);

// Builds only layers [first_layer, end_layer) of `config`'s model (for a
// pipeline stage, or one layer at a time for memory-light profiling), with the
// same weights those layers have in CreateModel's model. GPT's tied token
// embedding is built by both the first and the last layer.
absl::StatusOr<std::shared_ptr<LanguageModel>> CreateModelLayers(const ModelConfig& config, uint64_t seed,
                                                                 int64_t first_layer, int64_t end_layer);
// The same for several ranges, such as the model chunks of an interleaved
// pipeline rank (layers [0, 2) and [6, 8) of 12). With `defer_values` the
// parameters' memory is reserved but not written (so it is not resident) and
// MaterializeLayer(i) draws layer i's values, the same ones.
absl::StatusOr<std::shared_ptr<LanguageModel>> CreateModelLayers(const ModelConfig& config, uint64_t seed,
                                                                 const LayerRanges& ranges, bool defer_values = false);

}  // namespace trident

#endif  // TRIDENT_MODELS_MODELS_H_
