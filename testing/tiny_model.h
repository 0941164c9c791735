// A small language model for the tests of components below models/ (which
// may not use the zoo): a LayerSequence of an embedding, residual MLP blocks
// and a head, shaped like the zoo's "mlp" model.
//
//   TinyModelOptions options;
//   options.n_layer = 2;
//   TinyModel whole(options, /*seed=*/5);
//   TinyModel stage(options, 5, LayerRanges{{2, 4}});  // the same values there
//   whole.Loss(tokens, targets).backward();
//
// Layer 0 embeds token ids [B, T] ("embed.weight"); layers 1..n_layer are
// blocks x + dropout(fc2(gelu(fc1(norm(x))))) ("blocks.<i-1>.norm/fc1/fc2");
// the last layer normalises and projects to the vocabulary ("norm", "head").
// Its loss is the mean token cross-entropy of the logits against batch field 1.
// Every parameter's values are drawn from the seed and its name alone, so a
// part built with some layers holds exactly the whole model's values.
#ifndef TRIDENT_TESTING_TINY_MODEL_H_
#define TRIDENT_TESTING_TINY_MODEL_H_

#include <cstdint>
#include <set>
#include <string>

#include <torch/nn/module.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include "graph/graph.h"

namespace trident {
namespace testing {

struct TinyModelOptions {
  int64_t n_layer = 2;
  int64_t n_embd = 32;  // the blocks' hidden width is 4 * n_embd
  int64_t vocab_size = 64;
  double dropout = 0.0;
  // The head reads the token embedding (as GPT-2's does): "embed.weight" is
  // then a parameter of the first and the last layer, and the head has no bias.
  bool tie_embeddings = false;
};

class TinyBlockImpl : public torch::nn::Module {
 public:
  TinyBlockImpl(int64_t n_embd, double dropout);
  at::Tensor forward(const at::Tensor& x);
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::Dropout dropout{nullptr};
};
TORCH_MODULE(TinyBlock);

class TinyModel : public torch::nn::Module, public LayerSequence {
 public:
  // Builds the layers in `ranges` (all when empty). With `defer_values` the
  // parameters hold LibTorch's default values until MaterializeLayer
  // draws theirs.
  TinyModel(TinyModelOptions options, uint64_t seed, LayerRanges ranges = {}, bool defer_values = false);

  int64_t NumLayers() const override { return options_.n_layer + 2; }
  std::string LayerName(int64_t i) const override;
  // Layer i on one tensor: token ids for layer 0, hidden states [B, T, C]
  // after it; the last layer returns logits.
  at::Tensor ForwardLayer(int64_t i, const at::Tensor& x);
  Values ForwardLayer(int64_t i, const Values& inputs, const Batch& batch) override;
  NamedTensors LayerParameters(int64_t i) override;
  void MaterializeLayer(int64_t i) override;
  void SetTraining(bool training) override { torch::nn::Module::train(training); }

  at::Tensor Logits(const at::Tensor& tokens);
  at::Tensor SequenceLoss(const at::Tensor& logits, const at::Tensor& targets);
  at::Tensor Loss(const at::Tensor& tokens, const at::Tensor& targets);
  at::Tensor Loss(const Values& outputs, const Batch& batch) override;

  const TinyModelOptions& options() const { return options_; }

 private:
  bool Has(int64_t i) const;
  void Draw(const std::string& name, at::Tensor& p) const;

  TinyModelOptions options_;
  uint64_t seed_;
  LayerRanges ranges_;
  std::set<std::string> undrawn_;  // names of parameters built with deferred values
  torch::nn::Embedding embed{nullptr};
  std::vector<TinyBlock> blocks_;  // null where the layer is not built here
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear head{nullptr};
};

}  // namespace testing
}  // namespace trident

#endif  // TRIDENT_TESTING_TINY_MODEL_H_
