// ModelSource constructors and the registries of models and losses.
#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/module.h>

#include "base/status.h"
#include "parallel/parallel.h"

namespace trident {

ModelSource ModelSource::FromLayers(std::shared_ptr<LayerSequence> layers) {
  ModelSource source;
  source.kind = Kind::kLayers;
  source.num_layers = layers->NumLayers();
  source.build = [layers](const LayerRanges&) -> absl::StatusOr<std::shared_ptr<LayerSequence>> { return layers; };
  return source;
}

ModelSource ModelSource::FromLayerBuilder(
    int64_t num_layers, std::function<absl::StatusOr<std::shared_ptr<LayerSequence>>(const LayerRanges&)> build) {
  ModelSource source;
  source.kind = Kind::kLayers;
  source.num_layers = num_layers;
  source.build = std::move(build);
  return source;
}

ModelSource ModelSource::FromModule(std::shared_ptr<torch::nn::Module> module,
                                    std::function<Values(const Values&)> forward) {
  ModelSource source;
  source.kind = Kind::kModule;
  source.module = std::move(module);
  source.forward = std::move(forward);
  return source;
}

ModelSource ModelSource::FromTorchScript(std::string path) {
  ModelSource source;
  source.kind = Kind::kTorchScript;
  source.torchscript_path = std::move(path);
  return source;
}

Registry<LossFunction>& LossRegistry() {
  static auto* registry = new Registry<LossFunction>("loss");
  return *registry;
}

Registry<ModelFactory>& ModelRegistry() {
  static auto* registry = new Registry<ModelFactory>("model");
  return *registry;
}

namespace {

// A TorchScript file saved from Python: args path, and block_size and
// vocab_size describing the token data it trains on.
TRIDENT_REGISTER(ModelRegistry, "torchscript",
                 [](const ComponentArgs& args, const ModelContext& context) -> absl::StatusOr<ModelSource> {
                   TRIDENT_RETURN_IF_ERROR(args.CheckKnown({"path", "block_size", "vocab_size"}));
                   ModelSource source = ModelSource::FromTorchScript(args.GetString("path", ""));
                   if (source.torchscript_path.empty()) {
                     return absl::InvalidArgumentError("model 'torchscript' needs a path (--model=torchscript:PATH)");
                   }
                   TRIDENT_ASSIGN_OR_RETURN(source.sequence_length, args.GetInt("block_size", 0));
                   TRIDENT_ASSIGN_OR_RETURN(source.vocab_size, args.GetInt("vocab_size", context.data_vocab_size));
                   return source;
                 });

const at::Tensor& FirstOutput(const Values& outputs, const char* loss) {
  TORCH_CHECK(!outputs.empty() && outputs[0].defined(), "loss '", loss,
              "' needs the model to return its prediction first");
  return outputs[0];
}

TRIDENT_REGISTER(LossRegistry, "cross_entropy", [](const Batch& batch, const Values& outputs) {
  const at::Tensor& logits = FirstOutput(outputs, "cross_entropy");
  const at::Tensor& targets = batch.back();
  TORCH_CHECK(!at::isFloatingType(targets.scalar_type()),
              "loss 'cross_entropy' needs integer class ids in the batch's last field; it holds ",
              targets.scalar_type());
  namespace F = torch::nn::functional;
  return F::cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}),
                          F::CrossEntropyFuncOptions().ignore_index(-100));
});

TRIDENT_REGISTER(LossRegistry, "mse", [](const Batch& batch, const Values& outputs) {
  const at::Tensor& prediction = FirstOutput(outputs, "mse");
  return at::mse_loss(prediction, batch.back().to(prediction.scalar_type()).view_as(prediction));
});

}  // namespace
}  // namespace trident
