// Llama: RMSNorm, rotary position embeddings, SwiGLU MLP, no biases, untied
// head, grouped-query attention when n_kv_head < n_head. Hugging Face names.
#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "base/recompute.h"
#include "base/status.h"
#include "models/internal/architectures.h"
#include "replace/replace.h"

namespace trident {
namespace internal {
namespace {

ColumnParallelLinear Column(const ModelConfig& c, int64_t in, int64_t out) {
  return ColumnParallelLinear(c.tp, in, out, /*bias=*/false);
}

RowParallelLinear Row(const ModelConfig& c, int64_t in, int64_t out) {
  return RowParallelLinear(c.tp, in, out, /*bias=*/false);
}

class RmsNormImpl : public torch::nn::Module {
 public:
  explicit RmsNormImpl(int64_t width, double eps = 1e-5) : eps_(eps) {
    weight = register_parameter("weight", torch::ones({width}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return x * torch::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps_) * weight;
  }
  torch::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(RmsNorm);

// Rotates pairs (x_i, x_{i + d/2}) as Hugging Face's rotate_half does.
torch::Tensor ApplyRotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  auto rotated = torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * cos + rotated * sin;
}

// With tensor parallelism each rank owns n_head / tp query heads and
// n_kv_head / tp key/value heads (q, k, v split column-wise, o_proj row-wise).
class AttentionImpl : public torch::nn::Module, public RecomputableModule, public ReplaceableModule {
 public:
  AttentionImpl(const ModelConfig& c, KeyValueCache* cache, int64_t block)
      : n_head_(c.n_head / c.tp.size),
        n_kv_head_((c.n_kv_head > 0 ? c.n_kv_head : c.n_head) / c.tp.size),
        head_dim_(c.n_embd / c.n_head),
        dropout_(c.dropout),
        cache_(cache),
        block_(block) {
    const int64_t kv_width = n_kv_head_ * c.tp.size * head_dim_;
    q_proj = register_module("q_proj", Column(c, c.n_embd, c.n_embd));
    k_proj = register_module("k_proj", Column(c, c.n_embd, kv_width));
    v_proj = register_module("v_proj", Column(c, c.n_embd, kv_width));
    o_proj = register_module("o_proj", Row(c, c.n_embd, c.n_embd));
  }
  bool Offers(const std::string& pair) const override { return pair == "fused_attention" && dropout_ == 0; }

  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
    return Run(x, cos, sin, /*partial=*/false);
  }
  // For RunSubPipelinedBlock: `x` already inside the region; o_proj's partial
  // product (not summed).
  torch::Tensor PartialForward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
    return Run(x, cos, sin, /*partial=*/true);
  }
  bool HasAdapters() const {
    return q_proj->adapter.defined() || k_proj->adapter.defined() || v_proj->adapter.defined() ||
           o_proj->adapter.defined();
  }

  torch::Tensor Run(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, bool partial) {
    if (!recompute() || !is_training()) return Attend(x, cos, sin, partial);
    return RecomputeInBackward(
        [this, partial](const Values& in) { return Values{Attend(in[0], in[1], in[2], partial)}; }, {x, cos, sin},
        parameters())[0];
  }

  torch::Tensor Attend(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, bool partial) {
    auto column = [&](ColumnParallelLinear& layer) { return partial ? layer->ForwardInRegion(x) : layer(x); };
    auto q = column(q_proj);  // T is whole after the column input
    const int64_t B = q.size(0), T = q.size(1);
    q = q.view({B, T, n_head_, head_dim_}).transpose(1, 2);
    auto k = column(k_proj).view({B, T, n_kv_head_, head_dim_}).transpose(1, 2);
    auto v = column(v_proj).view({B, T, n_kv_head_, head_dim_}).transpose(1, 2);
    q = ApplyRotary(q, cos, sin);
    k = ApplyRotary(k, cos, sin);
    if (cache_->active()) std::tie(k, v) = cache_->Append(block_, k, v);
    auto y = CausalAttention(q, k, v, dropout_, is_training(), Uses("fused_attention"));
    const torch::Tensor heads = y.transpose(1, 2).reshape({B, T, n_head_ * head_dim_});
    return partial ? o_proj->PartialForward(heads) : o_proj(heads);
  }
  ColumnParallelLinear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr};
  RowParallelLinear o_proj{nullptr};

 private:
  int64_t n_head_, n_kv_head_, head_dim_;
  double dropout_;
  KeyValueCache* cache_;
  int64_t block_;
};
TORCH_MODULE(Attention);

class SwiGluImpl : public torch::nn::Module, public RecomputableModule {
 public:
  explicit SwiGluImpl(const ModelConfig& c) {
    const int64_t hidden = LlamaIntermediateSize(c);
    gate_proj = register_module("gate_proj", Column(c, c.n_embd, hidden));
    up_proj = register_module("up_proj", Column(c, c.n_embd, hidden));
    down_proj = register_module("down_proj", Row(c, hidden, c.n_embd));
  }
  torch::Tensor forward(const torch::Tensor& x) { return Run(x, /*partial=*/false); }
  // As Attention's.
  torch::Tensor PartialForward(const torch::Tensor& x) { return Run(x, /*partial=*/true); }
  bool HasAdapters() const {
    return gate_proj->adapter.defined() || up_proj->adapter.defined() || down_proj->adapter.defined();
  }

  torch::Tensor Run(const torch::Tensor& x, bool partial) {
    auto mlp = [this, partial](const Values& in) {
      auto column = [&](ColumnParallelLinear& layer) { return partial ? layer->ForwardInRegion(in[0]) : layer(in[0]); };
      const torch::Tensor h = torch::silu(column(gate_proj)) * column(up_proj);
      return Values{partial ? down_proj->PartialForward(h) : down_proj(h)};
    };
    return recompute() && is_training() ? RecomputeInBackward(mlp, {x}, parameters())[0] : mlp({x})[0];
  }
  ColumnParallelLinear gate_proj{nullptr}, up_proj{nullptr};
  RowParallelLinear down_proj{nullptr};
};
TORCH_MODULE(SwiGlu);

class DecoderLayerImpl : public torch::nn::Module {
 public:
  DecoderLayerImpl(const ModelConfig& c, KeyValueCache* cache, int64_t block) : tp_(c.tp) {
    self_attn = register_module("self_attn", Attention(c, cache, block));
    mlp = register_module("mlp", SwiGlu(c));
    input_layernorm = register_module("input_layernorm", RmsNorm(c.n_embd));
    post_attention_layernorm = register_module("post_attention_layernorm", RmsNorm(c.n_embd));
  }
  torch::Tensor forward(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin) {
    if (is_training() && SubPipelinesBlock(tp_, x) && !self_attn->HasAdapters() && !mlp->HasAdapters()) {
      return RunSubPipelinedBlock(x, Regions(cos, sin), tp_.group);
    }
    x = x + self_attn->forward(input_layernorm(x), cos, sin);
    return x + mlp(post_attention_layernorm(x));
  }
  // tp_overlapping_level 2: attention and MLP, each from its norm to its residual add.
  std::vector<BlockRegion> Regions(const torch::Tensor& cos, const torch::Tensor& sin) {
    auto add = [](const torch::Tensor& x, const torch::Tensor& y) { return x + y; };
    return {{[this](const torch::Tensor& x) { return input_layernorm(x); },
             [this, cos, sin](const torch::Tensor& h) { return self_attn->PartialForward(h, cos, sin); }, add},
            {[this](const torch::Tensor& x) { return post_attention_layernorm(x); },
             [this](const torch::Tensor& h) { return mlp->PartialForward(h); }, add}};
  }
  Attention self_attn{nullptr};
  SwiGlu mlp{nullptr};
  RmsNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};

 private:
  TensorParallelism tp_;
};
TORCH_MODULE(DecoderLayer);

class LlamaBodyImpl : public torch::nn::Module {
 public:
  LlamaBodyImpl(const ModelConfig& c, const LanguageModel& model) {
    if (model.HasLayer(0)) {
      embed_tokens =
          register_module("embed_tokens", VocabParallelEmbedding(VocabularyParallelism(c), c.vocab_size, c.n_embd));
    }
    layers = register_module("layers", std::make_shared<torch::nn::Module>());
    blocks = BuildBlocks<DecoderLayer>(model, *layers, c.n_layer,
                                       [&](int64_t b) { return DecoderLayer(c, model.key_value_cache(), b); });
    if (model.HasLayer(c.n_layer + 1)) norm = register_module("norm", RmsNorm(c.n_embd));
  }
  VocabParallelEmbedding embed_tokens{nullptr};
  std::shared_ptr<torch::nn::Module> layers;
  std::vector<DecoderLayer> blocks;
  RmsNorm norm{nullptr};
};
TORCH_MODULE(LlamaBody);

class Llama : public LanguageModel {
 public:
  Llama(const ModelConfig& c, const LayerRanges& ranges) : LanguageModel(c, ranges) {
    model = register_module("model", LlamaBody(c, *this));
    if (HasLayer(c.n_layer + 1)) {
      lm_head = register_module("lm_head", ColumnParallelLinear(VocabularyParallelism(c), c.n_embd, c.vocab_size,
                                                                /*bias=*/false));
    }
  }

  std::string BlockPrefix() const override { return "model.layers."; }

  at::Tensor ForwardLayer(int64_t i, const at::Tensor& x) override {
    CheckLayer(i);
    if (i == 0) return model->embed_tokens(EmbeddedIds(x, config()));
    if (i == NumLayers() - 1) return lm_head(model->norm(x));  // this rank's vocabulary slice (or all of it)
    // With sequence parallelism x is a sequence shard; the rotation covers all T.
    const TensorParallelism& tp = config().tp;
    const int64_t T = x.size(1) * (tp.sequence_parallel ? tp.size : 1);
    const KeyValueCache& cache = *key_value_cache();
    const int64_t first = cache.active() ? cache.Length(i - 1) : 0;  // decoding: after the cached positions
    const auto& [cos, sin] = Rotary(first + T, x.options());
    return model->blocks[i - 1]->forward(x, cos.narrow(0, first, T), sin.narrow(0, first, T));
  }

  std::vector<std::pair<std::string, at::Tensor>> LayerParameters(int64_t i) override {
    CheckLayer(i);
    if (i == 0) return {{"model.embed_tokens.weight", model->embed_tokens->weight}};
    if (i == NumLayers() - 1) {
      return {{"model.norm.weight", model->norm->weight}, {"lm_head.weight", lm_head->weight}};
    }
    return PrefixedParameters(*model->blocks[i - 1], LayerName(i));
  }

  LlamaBody model{nullptr};
  ColumnParallelLinear lm_head{nullptr};

 private:
  // cos and sin of the rotary angles for (at least) T positions, [T, head_dim], cached.
  const std::pair<torch::Tensor, torch::Tensor>& Rotary(int64_t T, const torch::TensorOptions& like) {
    if (rotary_length_ < T || rotary_.first.device() != like.device()) {
      const ModelConfig& c = config();
      const int64_t head_dim = c.n_embd / c.n_head;
      auto options = torch::TensorOptions().dtype(torch::kFloat).device(like.device());
      auto inv_freq = 1.0 / torch::pow(c.rope_theta, torch::arange(0, head_dim, 2, options) / head_dim);
      auto angles = torch::outer(torch::arange(T, options), inv_freq);
      auto both = torch::cat({angles, angles}, -1);
      rotary_ = {both.cos(), both.sin()};
      rotary_length_ = T;
    }
    return rotary_;
  }
  int64_t rotary_length_ = -1;
  std::pair<torch::Tensor, torch::Tensor> rotary_;
};

}  // namespace

int64_t LlamaIntermediateSize(const ModelConfig& c) {
  if (c.intermediate_size > 0) return c.intermediate_size;
  const int64_t size = 8 * c.n_embd / 3;
  return (size + 31) / 32 * 32;
}

namespace {

absl::Status CheckLlama(const ModelConfig& c) {
  TRIDENT_RETURN_IF_ERROR(CheckHeadsDivideWidth(c));
  const int64_t kv = c.n_kv_head > 0 ? c.n_kv_head : c.n_head;
  if (c.n_head % kv != 0) {
    return absl::InvalidArgumentError(absl::StrCat("n_head=", c.n_head, " is not divisible by n_kv_head=", kv));
  }
  if ((c.n_embd / c.n_head) % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("head size n_embd/n_head=", c.n_embd / c.n_head, " must be even for rotary embeddings"));
  }
  return absl::OkStatus();
}

TRIDENT_REGISTER(ArchitectureRegistry, "llama",
                 Architecture{[](const ModelConfig& config, const LayerRanges& ranges)
                                  -> std::shared_ptr<LanguageModel> { return std::make_shared<Llama>(config, ranges); },
                              CheckLlama,
                              [](const ModelConfig& c) {
                                return Architecture::Sizes{{"n_kv_head", c.n_kv_head > 0 ? c.n_kv_head : c.n_head},
                                                           {"intermediate_size", LlamaIntermediateSize(c)}};
                              },
                              ""});

}  // namespace

}  // namespace internal
}  // namespace trident
