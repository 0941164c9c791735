#include "testing/tiny_model.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>

namespace trident {
namespace testing {
namespace {

// FNV-1a over the name, mixed with the seed: the same stream for a parameter
// in every part of the model.
uint64_t ParameterSeed(uint64_t seed, const std::string& name) {
  uint64_t h = 1469598103934665603ull ^ (seed * 0x9e3779b97f4a7c15ull);
  for (unsigned char c : name) h = (h ^ c) * 1099511628211ull;
  return h;
}

}  // namespace

TinyBlockImpl::TinyBlockImpl(int64_t n_embd, double p) {
  norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({n_embd})));
  fc1 = register_module("fc1", torch::nn::Linear(n_embd, 4 * n_embd));
  fc2 = register_module("fc2", torch::nn::Linear(4 * n_embd, n_embd));
  dropout = register_module("dropout", torch::nn::Dropout(p));
}

// at::linear rather than the modules' forward, which LibTorch traces as a
// matmul and an add: one aten::linear node per product, as in the zoo.
at::Tensor TinyBlockImpl::forward(const at::Tensor& x) {
  const at::Tensor hidden = at::gelu(at::linear(norm(x), fc1->weight, fc1->bias));
  return x + dropout(at::linear(hidden, fc2->weight, fc2->bias));
}

TinyModel::TinyModel(TinyModelOptions options, uint64_t seed, LayerRanges ranges, bool defer_values)
    : options_(options), seed_(seed), ranges_(std::move(ranges)) {
  const int64_t last = NumLayers() - 1;
  const int64_t C = options_.n_embd;
  if (Has(0) || (options_.tie_embeddings && Has(last))) {
    embed = register_module("embed", torch::nn::Embedding(options_.vocab_size, C));
  }
  auto holder = register_module("blocks", std::make_shared<torch::nn::Module>());
  blocks_.resize(options_.n_layer, TinyBlock(nullptr));
  for (int64_t b = 0; b < options_.n_layer; ++b) {
    if (Has(b + 1)) blocks_[b] = holder->register_module(std::to_string(b), TinyBlock(C, options_.dropout));
  }
  if (Has(last)) {
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({C})));
    if (!options_.tie_embeddings) head = register_module("head", torch::nn::Linear(C, options_.vocab_size));
  }
  for (auto& item : named_parameters()) {
    if (defer_values) {
      undrawn_.insert(item.key());
    } else {
      Draw(item.key(), item.value());
    }
  }
}

bool TinyModel::Has(int64_t i) const {
  if (ranges_.empty()) return true;
  for (const auto& [first, end] : ranges_) {
    if (first <= i && i < end) return true;
  }
  return false;
}

void TinyModel::Draw(const std::string& name, at::Tensor& p) const {
  at::NoGradGuard no_grad;
  if (p.dim() >= 2) {
    p.normal_(0.0, 0.02, at::make_generator<at::CPUGeneratorImpl>(ParameterSeed(seed_, name)));
  } else if (name.size() >= 4 && name.compare(name.size() - 4, 4, "bias") == 0) {
    p.zero_();
  } else {
    p.fill_(1.0);  // norm scales
  }
}

std::string TinyModel::LayerName(int64_t i) const {
  if (i == 0) return "embed";
  if (i == NumLayers() - 1) return "head";
  return "blocks." + std::to_string(i - 1);
}

at::Tensor TinyModel::ForwardLayer(int64_t i, const at::Tensor& x) {
  TORCH_CHECK(Has(i), "TinyModel: layer ", i, " is not built in this part");
  if (i == 0) return embed(x);
  if (i < NumLayers() - 1) return blocks_[i - 1]->forward(x);
  const at::Tensor h = norm(x);
  return options_.tie_embeddings ? at::linear(h, embed->weight) : at::linear(h, head->weight, head->bias);
}

Values TinyModel::ForwardLayer(int64_t i, const Values& inputs, const Batch& batch) {
  return {ForwardLayer(i, i == 0 ? batch.at(0) : inputs.at(0))};
}

NamedTensors TinyModel::LayerParameters(int64_t i) {
  TORCH_CHECK(Has(i), "TinyModel: layer ", i, " is not built in this part");
  NamedTensors params;
  auto add = [&params](const std::string& prefix, torch::nn::Module& module) {
    for (const auto& item : module.named_parameters()) params.emplace_back(prefix + "." + item.key(), item.value());
  };
  if (i == 0) {
    add("embed", *embed);
  } else if (i < NumLayers() - 1) {
    add(LayerName(i), *blocks_[i - 1]);
  } else {
    add("norm", *norm);
    if (options_.tie_embeddings) {
      add("embed", *embed);
    } else {
      add("head", *head);
    }
  }
  return params;
}

void TinyModel::MaterializeLayer(int64_t i) {
  for (auto& [name, p] : LayerParameters(i)) {
    if (undrawn_.erase(name) > 0) Draw(name, p);
  }
}

at::Tensor TinyModel::Logits(const at::Tensor& tokens) {
  Values x;  // through RunLayer, so that an observer (ZeRO stage 3) sees each layer
  for (int64_t i = 0; i < NumLayers(); ++i) x = RunLayer(i, x, {tokens});
  return x.at(0);
}

at::Tensor TinyModel::SequenceLoss(const at::Tensor& logits, const at::Tensor& targets) {
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
}

at::Tensor TinyModel::Loss(const at::Tensor& tokens, const at::Tensor& targets) {
  return SequenceLoss(Logits(tokens), targets);
}

at::Tensor TinyModel::Loss(const Values& outputs, const Batch& batch) {
  return SequenceLoss(outputs.at(0), batch.at(1));
}

}  // namespace testing
}  // namespace trident
