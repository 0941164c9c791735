#include "zoo/zoo.h"

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace trident {

ModelSource ZooModelSource(const ModelConfig& config, uint64_t seed) {
  // The layers in `ranges` (empty: all of them), values drawn now or deferred.
  auto builder = [config, seed](bool defer_values) {
    return [config, seed, defer_values](const LayerRanges& ranges) -> absl::StatusOr<std::shared_ptr<LayerSequence>> {
      const LayerRanges built = ranges.empty() ? LayerRanges{{0, config.n_layer + 2}} : ranges;
      TRIDENT_ASSIGN_OR_RETURN(auto part, CreateModelLayers(config, seed, built, defer_values));
      return std::shared_ptr<LayerSequence>(part);
    };
  };
  ModelSource source = ModelSource::FromLayerBuilder(config.n_layer + 2, builder(/*defer_values=*/false));
  source.build_deferred = builder(/*defer_values=*/true);
  source.shards = [](LayerSequence& part) { return dynamic_cast<LanguageModel&>(part).ParameterShards(); };
  source.aliases = ModelTiedParameters(config);
  source.sequence_length = config.block_size;
  source.vocab_size = config.vocab_size;
  source.returns_logits = true;
  // 6 N per token for the products with the weights, plus attention's.
  const double T = config.block_size;
  const double attention = AttentionFlopsPerToken(config);
  source.flops_per_sample = [T, attention](int64_t parameters) { return T * (6.0 * parameters + attention); };
  return source;
}

absl::StatusOr<ModelConfig> ZooModelConfig(const std::string& model, const ComponentArgs& args,
                                           int64_t data_vocab_size) {
  TRIDENT_RETURN_IF_ERROR(
      args.CheckKnown({"preset", "n_layer", "n_head", "n_embd", "block_size", "vocab_size", "dropout", "n_kv_head",
                       "intermediate_size", "rope_theta", "init_method_std", "tie_word_embeddings"}));
  const std::string preset = args.GetString("preset", absl::StrCat(model, "-tiny"));
  TRIDENT_ASSIGN_OR_RETURN(ModelConfig c, PresetModelConfig(model, preset));
  TRIDENT_ASSIGN_OR_RETURN(c.n_layer, args.GetInt("n_layer", c.n_layer));
  TRIDENT_ASSIGN_OR_RETURN(c.n_head, args.GetInt("n_head", c.n_head));
  TRIDENT_ASSIGN_OR_RETURN(c.n_embd, args.GetInt("n_embd", c.n_embd));
  TRIDENT_ASSIGN_OR_RETURN(c.block_size, args.GetInt("block_size", c.block_size));
  TRIDENT_ASSIGN_OR_RETURN(c.vocab_size,
                           args.GetInt("vocab_size", data_vocab_size > 0 ? data_vocab_size : c.vocab_size));
  TRIDENT_ASSIGN_OR_RETURN(c.dropout, args.GetDouble("dropout", c.dropout));
  TRIDENT_ASSIGN_OR_RETURN(c.n_kv_head, args.GetInt("n_kv_head", c.n_kv_head));
  TRIDENT_ASSIGN_OR_RETURN(c.intermediate_size, args.GetInt("intermediate_size", c.intermediate_size));
  TRIDENT_ASSIGN_OR_RETURN(c.rope_theta, args.GetDouble("rope_theta", c.rope_theta));
  TRIDENT_ASSIGN_OR_RETURN(c.init_method_std, args.GetDouble("init_method_std", c.init_method_std));
  TRIDENT_ASSIGN_OR_RETURN(c.tie_word_embeddings, args.GetBool("tie_word_embeddings", c.tie_word_embeddings));
  if (data_vocab_size > 0 && c.vocab_size < data_vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat("vocab_size=", c.vocab_size, " is smaller than the data's ",
                                                   data_vocab_size, "-token vocabulary"));
  }
  return c;
}

namespace {

ModelFactory ZooFactory(std::string model) {
  return [model](const ComponentArgs& args, const ModelContext& context) -> absl::StatusOr<ModelSource> {
    TRIDENT_ASSIGN_OR_RETURN(ModelConfig config, ZooModelConfig(model, args, context.data_vocab_size));
    config.tp = context.tp;
    TRIDENT_RETURN_IF_ERROR(ValidateModelConfig(config));
    return ZooModelSource(config, context.seed);
  };
}

TRIDENT_REGISTER(ModelRegistry, "gpt", ZooFactory("gpt"));
TRIDENT_REGISTER(ModelRegistry, "llama", ZooFactory("llama"));
TRIDENT_REGISTER(ModelRegistry, "mlp", ZooFactory("mlp"));

}  // namespace
}  // namespace trident
