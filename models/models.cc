#include "models/models.h"

#include <cmath>
#include <limits>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/TracerMode.h>
#include <torch/csrc/jit/frontend/tracer.h>
#include <torch/torch.h>
#include <torch/version.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/rng.h"
#include "base/status.h"
#include "kernels/kernels.h"
#include "models/internal/architectures.h"
#include "replace/replace.h"

namespace trident {
namespace {

struct Preset {
  const char* model;
  const char* name;
  ModelConfig config;
};

ModelConfig Sizes(const char* model, int64_t layers, int64_t heads, int64_t embd, int64_t block, int64_t vocab,
                  int64_t kv_heads = 0, int64_t intermediate = 0) {
  ModelConfig c;
  c.model = model;
  c.n_layer = layers;
  c.n_head = heads;
  c.n_embd = embd;
  c.block_size = block;
  c.vocab_size = vocab;
  c.n_kv_head = kv_heads;
  c.intermediate_size = intermediate;
  return c;
}

const std::vector<Preset>& Presets() {
  static const auto* presets = new std::vector<Preset>{
      {"gpt", "gpt-tiny", Sizes("gpt", 4, 4, 256, 128, 256)},
      {"gpt", "gpt2-124m", Sizes("gpt", 12, 12, 768, 1024, 50257)},
      {"gpt", "gpt2-350m", Sizes("gpt", 24, 16, 1024, 1024, 50257)},
      {"gpt", "gpt2-774m", Sizes("gpt", 36, 20, 1280, 1024, 50257)},
      {"llama", "llama-tiny", Sizes("llama", 4, 4, 256, 128, 256, 2, 688)},
      {"llama", "llama-160m", Sizes("llama", 12, 12, 768, 2048, 32000, 4, 2048)},
      {"llama", "llama-1b", Sizes("llama", 22, 32, 2048, 2048, 32000, 4, 5632)},
      {"llama", "llama-3b", Sizes("llama", 28, 24, 3072, 2048, 128256, 8, 8192)},  // Llama 3.2 3B's shape
      {"llama", "llama-7b", Sizes("llama", 32, 32, 4096, 2048, 32000, 32, 11008)},
      {"mlp", "mlp-tiny", Sizes("mlp", 4, 1, 128, 64, 256)},
      {"mlp", "mlp-small", Sizes("mlp", 8, 1, 256, 128, 256)},
  };
  return *presets;
}

}  // namespace

namespace internal {

Registry<Architecture>& ArchitectureRegistry() {
  static auto* registry = new Registry<Architecture>("model");
  return *registry;
}

absl::Status CheckHeadsDivideWidth(const ModelConfig& c) {
  if (c.n_embd % c.n_head == 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("n_embd=", c.n_embd, " is not divisible by n_head=", c.n_head));
}

}  // namespace internal

absl::StatusOr<ModelConfig> PresetModelConfig(absl::string_view model, absl::string_view preset) {
  TRIDENT_RETURN_IF_ERROR(internal::ArchitectureRegistry().Find(model).status());
  for (const Preset& p : Presets()) {
    if (p.model == model && p.name == preset) return p.config;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown preset '", preset, "' for model '", model,
                                                 "'; choose one of ", absl::StrJoin(PresetNames(model), ", ")));
}

std::vector<std::string> PresetNames(absl::string_view model) {
  std::vector<std::string> names;
  for (const Preset& p : Presets()) {
    if (p.model == model) names.push_back(p.name);
  }
  return names;
}

absl::Status ValidateModelConfig(const ModelConfig& c) {
  TRIDENT_ASSIGN_OR_RETURN(internal::Architecture architecture, internal::ArchitectureRegistry().Find(c.model));
  for (const auto& [name, value] : std::vector<std::pair<const char*, int64_t>>{{"n_layer", c.n_layer},
                                                                                {"n_head", c.n_head},
                                                                                {"n_embd", c.n_embd},
                                                                                {"block_size", c.block_size},
                                                                                {"vocab_size", c.vocab_size}}) {
    if (value <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(name, "=", value, " must be positive"));
    }
  }
  if (c.vocab_size > 65536) {
    return absl::InvalidArgumentError(
        absl::StrCat("vocab_size=", c.vocab_size, " exceeds 65536, the range of uint16 token files"));
  }
  if (!(c.init_method_std > 0)) {
    return absl::InvalidArgumentError(absl::StrCat("init_method_std=", c.init_method_std, " must be positive"));
  }
  if (c.dropout < 0 || c.dropout >= 1) {
    return absl::InvalidArgumentError(absl::StrCat("dropout=", c.dropout, " must be in [0, 1)"));
  }
  if (c.tp.size < 1 || c.tp.rank < 0 || c.tp.rank >= c.tp.size) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor-parallel rank ", c.tp.rank, " of size ", c.tp.size, " is not a valid place"));
  }
  TRIDENT_RETURN_IF_ERROR(architecture.validate(c));
  // Tensor parallelism splits heads, the vocabulary and the architecture's widths.
  const int64_t tp = c.tp.size;
  internal::Architecture::Sizes split = {{"n_head", c.n_head}};
  if (c.tp.parallel_vocab) split.emplace_back("vocab_size", c.vocab_size);
  for (auto& size : architecture.tensor_parallel_sizes(c)) split.push_back(std::move(size));
  if (c.tp.sequence_parallel) split.emplace_back("block_size (sequence parallelism)", c.block_size);
  for (const auto& [name, value] : split) {
    if (value % tp != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, "=", value, " is not divisible by tp=", tp,
                       name == "vocab_size" ? "; set vocab_size to a multiple of tp (a padded vocabulary "
                                              "trains the same), or keep the vocabulary whole (parallel_vocab false)"
                                            : ""));
    }
  }
  return absl::OkStatus();
}

std::map<std::string, std::string> ModelTiedParameters(const ModelConfig& config) {
  auto architecture = internal::ArchitectureRegistry().Find(config.model);
  if (!architecture.ok() || !architecture->tied_parameters) return {};
  return architecture->tied_parameters(config);
}

double AttentionFlopsPerToken(const ModelConfig& config) {
  auto architecture = internal::ArchitectureRegistry().Find(config.model);
  if (!architecture.ok() || !architecture->attention) return 0.0;
  return 12.0 * config.n_layer * config.n_embd * config.block_size;
}

Values LanguageModel::ForwardLayer(int64_t i, const Values& inputs, const Batch& batch) {
  return {ForwardLayer(i, i == 0 ? batch.at(0) : inputs.at(0))};
}

at::Tensor LanguageModel::Logits(const at::Tensor& tokens) {
  Values x;
  for (int64_t i = 0; i < NumLayers(); ++i) x = RunLayer(i, x, {tokens});
  return x.at(0);
}

at::Tensor LanguageModel::Loss(const Values& outputs, const Batch& batch) {
  return SequenceLoss(outputs.at(0), batch.at(1));
}

at::Tensor LanguageModel::Loss(const at::Tensor& tokens, const at::Tensor& targets) {
  return SequenceLoss(Logits(tokens), targets);
}

at::Tensor LanguageModel::SequenceLoss(const at::Tensor& logits, const at::Tensor& targets) {
  const TensorParallelism& tp = config_.tp;
  if (tp.size > 1 && tp.parallel_vocab) {
    return VocabParallelCrossEntropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}), tp.group).mean();
  }
  if (tp.size > 1 && tp.sequence_parallel) {
    // The whole vocabulary's logits of this rank's sequence shard: the mean
    // over all tokens is the sum over ranks of each shard's mean / tp. Backward
    // gives each rank its shard's share; the replicated parameters' partial
    // gradients are summed as sequence parallelism sums them.
    const int64_t T = logits.size(1);
    at::Tensor shard = torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}),
                                                            targets.narrow(1, tp.rank * T, T).reshape({-1}));
    return ReduceFromTensorParallelRegion(shard / static_cast<double>(tp.size), tp.group);
  }
  // On CUDA the head's logits are a view of a product padded to an aligned width: the loss reads the
  // product, always through the fused cross-entropy's kernels (two passes over the logits in their own
  // precision, where the unfused loss makes and reads several fp32 copies).
  const at::Tensor rows = PaddedForSoftmax(logits.reshape({-1, logits.size(-1)})), classes = targets.reshape({-1});
  return Uses("fused_cross_entropy") || rows.is_cuda() ? FusedCrossEntropy(rows, classes)
                                                       : torch::nn::functional::cross_entropy(rows, classes);
}

bool LanguageModel::Offers(const std::string& pair) const {
  const TensorParallelism& tp = config_.tp;
  return pair == "fused_cross_entropy" && HasLayer(NumLayers() - 1) &&
         !(tp.size > 1 && (tp.parallel_vocab || tp.sequence_parallel));
}

std::map<std::string, ShardSpec> LanguageModel::ParameterShards() const {
  std::map<std::string, ShardSpec> shards;
  auto add = [&](const std::string& name, const ShardSpec& spec) {
    if (spec.parts > 1) shards[name] = spec;  // a layer of one part (the whole vocabulary) is replicated
  };
  for (const auto& item : named_modules()) {
    const std::string prefix = item.key().empty() ? "" : item.key() + ".";
    const torch::nn::Module* module = item.value().get();
    if (auto* column = dynamic_cast<const ColumnParallelLinearImpl*>(module)) {
      add(prefix + "weight", column->weight_shard());
      if (column->bias.defined()) add(prefix + "bias", column->weight_shard());
    } else if (auto* row = dynamic_cast<const RowParallelLinearImpl*>(module)) {
      add(prefix + "weight", row->weight_shard());
    } else if (auto* embedding = dynamic_cast<const VocabParallelEmbeddingImpl*>(module)) {
      add(prefix + "weight", embedding->weight_shard());
    }
  }
  return shards;
}

int64_t LanguageModel::NumParameters() const {
  int64_t count = 0;
  for (const auto& p : parameters()) count += p.numel();
  return count;
}

namespace internal {

TensorParallelism VocabularyParallelism(const ModelConfig& c) {
  if (c.tp.parallel_vocab) return c.tp;
  TensorParallelism whole;
  whole.group = c.tp.group;
  return whole;
}

at::Tensor EmbeddedIds(const at::Tensor& ids, const ModelConfig& c) {
  if (c.tp.parallel_vocab || !c.tp.sequence_parallel || c.tp.size == 1) return ids;
  const int64_t shard = ids.size(1) / c.tp.size;
  return ids.narrow(1, c.tp.rank * shard, shard);
}

std::vector<std::pair<std::string, at::Tensor>> PrefixedParameters(const torch::nn::Module& module,
                                                                   const std::string& prefix) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : module.named_parameters()) {
    out.emplace_back(prefix + "." + item.key(), item.value());
  }
  return out;
}

void KeyValueCache::Keep(int64_t n) {
  embedded_ = std::min(embedded_, n);
  for (auto& [layer, kv] : layers_) {
    if (kv.first.size(2) > n) kv = {kv.first.narrow(2, 0, n), kv.second.narrow(2, 0, n)};
  }
}

int64_t KeyValueCache::Length(int64_t layer) const {
  auto found = layers_.find(layer);
  return found == layers_.end() ? 0 : found->second.first.size(2);
}

std::pair<at::Tensor, at::Tensor> KeyValueCache::Append(int64_t layer, const at::Tensor& k, const at::Tensor& v) {
  auto [found, fresh] = layers_.try_emplace(layer, k, v);
  if (!fresh) found->second = {at::cat({found->second.first, k}, 2), at::cat({found->second.second, v}, 2)};
  return found->second;
}

at::Tensor CausalAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double dropout, bool training,
                           bool fused) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), Tk = k.size(2);
  at::Tensor keys = k, values = v;
  if (k.size(1) != H) {
    const int64_t repeat = H / k.size(1);
    keys = k.repeat_interleave(repeat, /*dim=*/1);
    values = v.repeat_interleave(repeat, /*dim=*/1);
  }
  // The fused CPU kernels outside tracing: a traced graph keeps the operators
  // below, which graph analyses (automatic tensor parallelism) read.
  if (fused ||
      (!(training && dropout > 0) && !torch::jit::tracer::isTracing() && FusedCausalAttentionOnCpu(q, keys, values))) {
    return FusedCausalAttention(q, keys, values);
  }
  // Additive: -inf above the diagonal; the queries are the last T of Tk positions.
  thread_local at::Tensor mask;
  auto causal_mask = [&] {
    if (!mask.defined() || mask.size(0) < Tk || mask.scalar_type() != q.scalar_type() || mask.device() != q.device()) {
      // Never recorded: a traced graph holds the mask as a constant, made in
      // this trace or in an earlier run.
      at::tracer::impl::NoTracerDispatchMode untraced;
      mask = at::full({Tk, Tk}, -std::numeric_limits<double>::infinity(), q.options()).triu(1);
    }
    return mask.narrow(0, Tk - T, T).narrow(1, 0, Tk);
  };
#if TORCH_VERSION_MAJOR >= 2
  // On GPUs LibTorch 2's fused attention (flash, memory-efficient or cuDNN
  // kernels): the [B*H, T, T] scores never reach memory. Not for decoding
  // (queries after cached keys): a few query rows gain nothing, and each new
  // key length would be a new shape for the kernels to plan.
  if (q.is_cuda() && T == Tk) {
    return at::scaled_dot_product_attention(q, keys, values, /*attn_mask=*/{}, training ? dropout : 0.0,
                                            /*is_causal=*/true);
  }
#endif
  // NOTE: one batched GEMM computes mask + scale * q k^T (baddbmm), so the
  // [B*H, T, T] scores are written once instead of three times (matmul, scale,
  // masked_fill), forward and backward.
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  at::Tensor scores = at::baddbmm(causal_mask().expand({B * H, T, Tk}), q.reshape({B * H, T, D}),
                                  keys.reshape({B * H, Tk, D}).transpose(1, 2), /*beta=*/1,
                                  /*alpha=*/scale);
  at::Tensor weights = at::softmax(scores, -1);
  if (training && dropout > 0) weights = at::dropout(weights, dropout, /*train=*/true);
  return at::bmm(weights, values.reshape({B * H, Tk, D})).view({B, H, T, D});
}

}  // namespace internal

std::string LanguageModel::LayerName(int64_t i) const {
  if (i == 0) return "embedding";
  if (i == NumLayers() - 1) return "head";
  return BlockPrefix() + std::to_string(i - 1);
}

LanguageModel::LanguageModel(ModelConfig config, LayerRanges ranges)
    : config_(std::move(config)), ranges_(std::move(ranges)), cache_(std::make_shared<internal::KeyValueCache>()) {
  if (ranges_.empty()) ranges_.emplace_back(0, NumLayers());
}

void LanguageModel::StartDecoding() { cache_->Start(); }
void LanguageModel::KeepPositions(int64_t n) { cache_->Keep(n); }
void LanguageModel::StopDecoding() { cache_->Stop(); }

bool LanguageModel::HasLayer(int64_t i) const {
  return std::any_of(ranges_.begin(), ranges_.end(), [i](const auto& r) { return i >= r.first && i < r.second; });
}

void LanguageModel::CheckLayer(int64_t i) const {
  if (!HasLayer(i)) {
    std::vector<std::string> held;
    for (const auto& [first, end] : ranges_) held.push_back(absl::StrCat(first, " to ", end - 1));
    throw std::out_of_range(absl::StrCat("layer ", i, " (", LayerName(i),
                                         ") is not materialised in this model part (layers ", absl::StrJoin(held, ", "),
                                         ")"));
  }
}

absl::StatusOr<std::shared_ptr<LanguageModel>> CreateModel(const ModelConfig& config, uint64_t seed) {
  return CreateModelLayers(config, seed, 0, config.n_layer + 2);
}

absl::StatusOr<std::shared_ptr<LanguageModel>> CreateModelLayers(const ModelConfig& config, uint64_t seed,
                                                                 int64_t first_layer, int64_t end_layer) {
  return CreateModelLayers(config, seed, LayerRanges{{first_layer, end_layer}});
}

absl::StatusOr<std::shared_ptr<LanguageModel>> CreateModelLayers(const ModelConfig& config, uint64_t seed,
                                                                 const LayerRanges& ranges, bool defer_values) {
  TRIDENT_RETURN_IF_ERROR(ValidateModelConfig(config));
  for (const auto& [first_layer, end_layer] : ranges) {
    if (first_layer < 0 || end_layer > config.n_layer + 2 || first_layer >= end_layer) {
      return absl::InvalidArgumentError(absl::StrCat("layers [", first_layer, ", ", end_layer,
                                                     ") are not a range of the model's ", config.n_layer + 2,
                                                     " layers"));
    }
  }
  std::shared_ptr<LanguageModel> model;
  absl::Status built = CatchExceptions(absl::StrCat("building model '", config.model, "'"), [&] {
    const internal::Architecture architecture = *internal::ArchitectureRegistry().Find(config.model);  // validated
    model = architecture.build(config, ranges);
    const std::string residual_suffix = architecture.residual_projection_suffix;
    const double std = config.init_method_std;
    const double residual_std = std / std::sqrt(2.0 * config.n_layer);
    auto draw = [seed, std, residual_std, residual_suffix, shards = model->ParameterShards()](const std::string& name,
                                                                                              at::Tensor& p) {
      torch::NoGradGuard no_grad;
      if (p.dim() >= 2) {
        // GPT-2: residual projections get a smaller std.
        const double drawn_std = !residual_suffix.empty() && absl::EndsWith(name, residual_suffix) ? residual_std : std;
        auto generator = at::make_generator<at::CPUGeneratorImpl>(ParameterSeed(seed, name));
        auto shard = shards.find(name);
        if (shard == shards.end()) {
          p.normal_(0.0, drawn_std, generator);
          return;
        }
        // A shard is the slice of the weight the single-process model draws.
        std::vector<int64_t> full = p.sizes().vec();
        full[shard->second.dim] *= shard->second.parts;
        p.copy_(shard->second.Slice(at::empty(full).normal_(0.0, drawn_std, generator)));
      } else if (absl::EndsWith(name, "bias")) {
        p.zero_();
      } else {
        p.fill_(1.0);  // norm scales
      }
    };
    if (defer_values) {
      model->DeferValues(draw);
    } else {
      for (auto& item : model->named_parameters()) draw(item.key(), item.value());
    }
  });
  TRIDENT_RETURN_IF_ERROR(built);
  return model;
}

void LanguageModel::DeferValues(std::function<void(const std::string&, at::Tensor&)> draw) {
  draw_ = std::move(draw);
  for (const auto& item : named_parameters()) undrawn_[item.value().unsafeGetTensorImpl()] = item.key();
}

void LanguageModel::MaterializeLayer(int64_t i) {
  for (auto& [name, p] : LayerParameters(i)) {
    auto undrawn = undrawn_.find(p.unsafeGetTensorImpl());
    if (undrawn == undrawn_.end()) continue;
    draw_(undrawn->second, p);
    undrawn_.erase(undrawn);
  }
}

}  // namespace trident
