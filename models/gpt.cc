// GPT-2: pre-LayerNorm blocks, fused qkv projection, exact GELU, tied head.
#include <cmath>

#include <torch/torch.h>

#include "base/recompute.h"
#include "kernels/kernels.h"
#include "models/internal/architectures.h"
#include "replace/replace.h"

namespace trident {
namespace internal {
namespace {

namespace F = torch::nn::functional;

// With tensor parallelism each rank owns n_head / tp whole heads: c_attn's
// q, k and v blocks are split column-wise, c_proj row-wise.
class CausalSelfAttentionImpl : public torch::nn::Module, public RecomputableModule, public ReplaceableModule {
 public:
  CausalSelfAttentionImpl(const ModelConfig& c, KeyValueCache* cache, int64_t block)
      : local_heads_(c.n_head / c.tp.size),
        head_dim_(c.n_embd / c.n_head),
        dropout_(c.dropout),
        cache_(cache),
        block_(block) {
    c_attn = register_module("c_attn", ColumnParallelLinear(c.tp, c.n_embd, 3 * c.n_embd, true, false, /*blocks=*/3));
    c_proj = register_module("c_proj", RowParallelLinear(c.tp, c.n_embd, c.n_embd));
    resid_dropout = register_module("resid_dropout", torch::nn::Dropout(c.dropout));
  }

  bool Offers(const std::string& pair) const override { return pair == "fused_attention" && dropout_ == 0; }

  torch::Tensor forward(const torch::Tensor& x) { return Run(x, /*partial=*/false); }
  // For RunSubPipelinedBlock: `x` already inside the region; c_proj's partial
  // product (not summed, without its bias and the dropout).
  torch::Tensor PartialForward(const torch::Tensor& x) { return Run(x, /*partial=*/true); }
  bool HasAdapters() const { return c_attn->adapter.defined() || c_proj->adapter.defined(); }

  torch::Tensor Run(const torch::Tensor& x, bool partial) {
    if (!recompute() || !is_training()) return Attend(x, partial);
    return RecomputeInBackward([this, partial](const Values& in) { return Values{Attend(in[0], partial)}; }, {x},
                               parameters())[0];
  }

  torch::Tensor Attend(const torch::Tensor& x, bool partial) {
    // [B, T, 3 * local width]: T is whole after the column input
    torch::Tensor qkv = partial ? c_attn->ForwardInRegion(x) : c_attn(x);
    const int64_t B = qkv.size(0), T = qkv.size(1);
    // unbind along the q/k/v axis, then heads first ([B, H, T, D] views): backward
    // stacks the three gradients straight into qkv's layout, one copy (three
    // selects would each fill a zero tensor of qkv's size and add; unbinding a
    // heads-first permutation would need a second copy back to qkv's layout).
    const std::vector<torch::Tensor> qkv_parts = qkv.view({B, T, 3, local_heads_, head_dim_}).unbind(2);
    torch::Tensor q = qkv_parts[0].transpose(1, 2), k = qkv_parts[1].transpose(1, 2), v = qkv_parts[2].transpose(1, 2);
    if (cache_->active()) std::tie(k, v) = cache_->Append(block_, k, v);
    torch::Tensor y = CausalAttention(q, k, v, dropout_, is_training(), Uses("fused_attention"));
    const torch::Tensor heads = y.transpose(1, 2).reshape({B, T, local_heads_ * head_dim_});
    return partial ? c_proj->PartialForward(heads) : resid_dropout(c_proj(heads));
  }

  ColumnParallelLinear c_attn{nullptr};
  RowParallelLinear c_proj{nullptr};
  torch::nn::Dropout resid_dropout{nullptr};

 private:
  int64_t local_heads_, head_dim_;
  double dropout_;
  KeyValueCache* cache_;
  int64_t block_;
};
TORCH_MODULE(CausalSelfAttention);

class MlpImpl : public torch::nn::Module, public RecomputableModule, public ReplaceableModule {
 public:
  explicit MlpImpl(const ModelConfig& c) {
    c_fc = register_module("c_fc", ColumnParallelLinear(c.tp, c.n_embd, 4 * c.n_embd));
    c_proj = register_module("c_proj", RowParallelLinear(c.tp, 4 * c.n_embd, c.n_embd));
    dropout = register_module("dropout", torch::nn::Dropout(c.dropout));
  }
  bool Offers(const std::string& pair) const override { return pair == "fused_bias_gelu"; }
  torch::Tensor forward(const torch::Tensor& x) { return Run(x, /*partial=*/false); }
  // As CausalSelfAttention's.
  torch::Tensor PartialForward(const torch::Tensor& x) { return Run(x, /*partial=*/true); }
  bool HasAdapters() const { return c_fc->adapter.defined() || c_proj->adapter.defined(); }

  torch::Tensor Run(const torch::Tensor& x, bool partial) {
    auto mlp = [this, partial](const Values& in) {
      const bool fused = Uses("fused_bias_gelu");
      const torch::Tensor product = partial ? c_fc->ForwardInRegion(in[0], /*add_bias=*/!fused)
                                    : fused ? c_fc->ForwardSkipBias(in[0])
                                            : c_fc(in[0]);
      const torch::Tensor h = fused ? FusedBiasGelu(product, c_fc->bias) : torch::gelu(product);  // exact GELU
      return Values{partial ? c_proj->PartialForward(h) : dropout(c_proj(h))};
    };
    return recompute() && is_training() ? RecomputeInBackward(mlp, {x}, parameters())[0] : mlp({x})[0];
  }
  ColumnParallelLinear c_fc{nullptr};
  RowParallelLinear c_proj{nullptr};
  torch::nn::Dropout dropout{nullptr};
};
TORCH_MODULE(Mlp);

torch::nn::LayerNorm MakeLayerNorm(int64_t width) {
  return torch::nn::LayerNorm(torch::nn::LayerNormOptions({width}).eps(1e-5));
}

// (x + residual, norm(x + residual)) as one fused operator (residual may be
// undefined: then the sum is x). On CUDA its kernels write the output in
// autocast's dtype and fold the sum's gradient into backward's pass.
std::pair<at::Tensor, at::Tensor> AddLayerNorm(const torch::nn::LayerNorm& norm, const at::Tensor& x,
                                               const at::Tensor& residual) {
  const auto& o = norm->options;
  return FusedAddLayerNorm(x, residual, 1.0, o.normalized_shape(), norm->weight, norm->bias, o.eps());
}

// fused_layer_norm: the attention's residual add and ln_2 in one pass (always
// on CUDA, where ln_1 runs through the fused operator too).
class BlockImpl : public torch::nn::Module, public ReplaceableModule {
 public:
  BlockImpl(const ModelConfig& c, KeyValueCache* cache, int64_t block) : tp_(c.tp) {
    ln_1 = register_module("ln_1", MakeLayerNorm(c.n_embd));
    attn = register_module("attn", CausalSelfAttention(c, cache, block));
    ln_2 = register_module("ln_2", MakeLayerNorm(c.n_embd));
    mlp = register_module("mlp", Mlp(c));
  }
  bool Offers(const std::string& pair) const override { return pair == "fused_layer_norm"; }
  torch::Tensor forward(torch::Tensor x) {
    if (is_training() && SubPipelinesBlock(tp_, x) && !attn->HasAdapters() && !mlp->HasAdapters()) {
      return RunSubPipelinedBlock(x, Regions(), tp_.group);
    }
    if (x.is_cuda()) {  // both norms fused; ln_1's kernel also adds the residual stream's gradient
      auto [x1, normed1] = AddLayerNorm(ln_1, x, at::Tensor());
      auto [sum, normed2] = AddLayerNorm(ln_2, x1, attn(normed1));
      return sum + mlp(normed2);
    }
    if (Uses("fused_layer_norm")) {
      auto [sum, normed] = AddLayerNorm(ln_2, x, attn(ln_1(x)));
      return sum + mlp(normed);
    }
    x = x + attn(ln_1(x));
    return x + mlp(ln_2(x));
  }
  // tp_overlapping_level 2: attention and MLP, each from its norm to its residual add.
  std::vector<BlockRegion> Regions() {
    return {
        {[this](const torch::Tensor& x) { return ln_1(x); },
         [this](const torch::Tensor& h) { return attn->PartialForward(h); },
         [this](const torch::Tensor& x, const torch::Tensor& y) {
           return x + attn->resid_dropout(y + attn->c_proj->bias);
         }},
        {[this](const torch::Tensor& x) { return ln_2(x); },
         [this](const torch::Tensor& h) { return mlp->PartialForward(h); },
         [this](const torch::Tensor& x, const torch::Tensor& y) { return x + mlp->dropout(y + mlp->c_proj->bias); }}};
  }
  torch::nn::LayerNorm ln_1{nullptr}, ln_2{nullptr};
  CausalSelfAttention attn{nullptr};
  Mlp mlp{nullptr};

 private:
  TensorParallelism tp_;
};
TORCH_MODULE(Block);

// Holds what the materialised layers of `model` need, under the reference names.
class TransformerImpl : public torch::nn::Module {
 public:
  TransformerImpl(const ModelConfig& c, const LanguageModel& model) {
    const bool embedding = model.HasLayer(0), head = model.HasLayer(c.n_layer + 1);
    if (embedding || (head && c.tie_word_embeddings)) {  // a tied head reads wte
      wte = register_module("wte", VocabParallelEmbedding(VocabularyParallelism(c), c.vocab_size, c.n_embd));
    }
    if (embedding) wpe = register_module("wpe", torch::nn::Embedding(c.block_size, c.n_embd));
    drop = register_module("drop", torch::nn::Dropout(c.dropout));
    h = register_module("h", std::make_shared<torch::nn::Module>());
    blocks = BuildBlocks<Block>(model, *h, c.n_layer, [&](int64_t b) { return Block(c, model.key_value_cache(), b); });
    if (head) ln_f = register_module("ln_f", MakeLayerNorm(c.n_embd));
  }
  VocabParallelEmbedding wte{nullptr};
  torch::nn::Embedding wpe{nullptr};
  torch::nn::Dropout drop{nullptr};
  std::shared_ptr<torch::nn::Module> h;
  std::vector<Block> blocks;
  torch::nn::LayerNorm ln_f{nullptr};
};
TORCH_MODULE(Transformer);

// GPT-2's head reads the token embedding's matrix unless tie_word_embeddings is off.
std::map<std::string, std::string> GptTiedParameters(const ModelConfig& config) {
  if (!config.tie_word_embeddings) return {};
  return {{"lm_head.weight", "transformer.wte.weight"}};
}

class Gpt : public LanguageModel {
 public:
  Gpt(const ModelConfig& c, const LayerRanges& ranges) : LanguageModel(c, ranges) {
    transformer = register_module("transformer", Transformer(c, *this));
    if (!c.tie_word_embeddings && HasLayer(c.n_layer + 1)) {
      lm_head = register_module("lm_head", ColumnParallelLinear(VocabularyParallelism(c), c.n_embd, c.vocab_size,
                                                                /*bias=*/false));
    }
  }

  std::string BlockPrefix() const override { return "transformer.h."; }

  at::Tensor ForwardLayer(int64_t i, const at::Tensor& x) override {
    CheckLayer(i);
    const TensorParallelism& tp = config().tp;
    if (i == 0) {
      // With sequence parallelism the tokens arrive as this rank's sequence shard.
      at::Tensor tokens = transformer->wte(EmbeddedIds(x, config()));
      const int64_t T = tokens.size(1), shards = tp.sequence_parallel ? tp.size : 1;
      KeyValueCache& cache = *key_value_cache();  // decoding: positions go on from the cached ones
      const int64_t first = (cache.active() ? cache.Embed(T * shards) : 0) + (shards > 1 ? tp.rank * T : 0);
      auto positions = torch::arange(first, first + T, x.options().dtype(torch::kLong));
      return transformer->drop(tokens + transformer->wpe(positions));
    }
    if (i == NumLayers() - 1) {  // this rank's vocabulary slice of the logits (or the whole vocabulary's)
      at::Tensor normed = x.is_cuda() ? AddLayerNorm(transformer->ln_f, x, at::Tensor()).second : transformer->ln_f(x);
      if (lm_head) return lm_head(normed);
      return AlignedLinear(tp.parallel_vocab ? ColumnParallelInput(normed, tp) : normed, transformer->wte->weight,
                           at::Tensor());  // tied
    }
    return transformer->blocks[i - 1]->forward(x);
  }

  std::vector<std::pair<std::string, at::Tensor>> LayerParameters(int64_t i) override {
    CheckLayer(i);
    if (i == 0) {
      return {{"transformer.wte.weight", transformer->wte->weight},
              {"transformer.wpe.weight", transformer->wpe->weight}};
    }
    if (i == NumLayers() - 1) {
      return {{"transformer.ln_f.weight", transformer->ln_f->weight},
              {"transformer.ln_f.bias", transformer->ln_f->bias},
              lm_head ? std::make_pair(std::string("lm_head.weight"), lm_head->weight)
                      : std::make_pair(std::string("transformer.wte.weight"), transformer->wte->weight)};
    }
    return PrefixedParameters(*transformer->blocks[i - 1], LayerName(i));
  }

  std::map<std::string, std::string> TiedParameters() const override { return GptTiedParameters(config()); }

  Transformer transformer{nullptr};
  ColumnParallelLinear lm_head{nullptr};  // untied only
};

}  // namespace

TRIDENT_REGISTER(ArchitectureRegistry, "gpt",
                 Architecture{[](const ModelConfig& config, const LayerRanges& ranges)
                                  -> std::shared_ptr<LanguageModel> { return std::make_shared<Gpt>(config, ranges); },
                              CheckHeadsDivideWidth,
                              [](const ModelConfig& c) {
                                return Architecture::Sizes{{"the MLP width 4*n_embd", 4 * c.n_embd}};
                              },
                              "c_proj.weight", GptTiedParameters});

}  // namespace internal
}  // namespace trident
