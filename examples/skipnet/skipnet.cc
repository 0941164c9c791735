#include "skipnet/skipnet.h"

#include <ATen/CPUGeneratorImpl.h>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace skipnet {

SkipNetImpl::SkipNetImpl(int64_t channels) {
  namespace nn = torch::nn;
  stem = register_module("stem", nn::Conv2d(nn::Conv2dOptions(1, channels, 3).padding(1)));
  body = register_module("body",
                         nn::Sequential(nn::Conv2d(nn::Conv2dOptions(channels, channels, 3).padding(1)), nn::ReLU(),
                                        nn::Conv2d(nn::Conv2dOptions(channels, channels, 3).padding(1)), nn::ReLU(),
                                        nn::Conv2d(nn::Conv2dOptions(channels, channels, 3).padding(1))));
  hidden = register_module("hidden", nn::Linear(channels * 64, 32));
  classes = register_module("classes", nn::Linear(32, 4));
}

torch::Tensor SkipNetImpl::forward(const torch::Tensor& image) {
  torch::Tensor skip = torch::relu(stem(image));
  torch::Tensor x = torch::relu(body->forward(skip) + skip);
  return classes(torch::relu(hidden(x.flatten(1))));
}

trident::ModelSource Source(uint64_t seed, int64_t channels) {
  torch::manual_seed(seed);
  auto net = std::make_shared<SkipNetImpl>(channels);
  trident::ModelSource source = trident::ModelSource::FromModule(
      net, [net](const trident::Values& inputs) { return trident::Values{net->forward(inputs.at(0))}; });
  source.loss = SmoothedCrossEntropy;
  return source;
}

absl::StatusOr<trident::Batch> ShapesDataset::Get(const std::vector<int64_t>& indices) const {
  std::vector<torch::Tensor> images, labels;
  for (int64_t i : indices) {
    if (i < 0 || i >= size_) {
      return absl::OutOfRangeError(absl::StrCat("sample ", i, " of a ShapesDataset of ", size_));
    }
    auto generator = at::make_generator<at::CPUGeneratorImpl>(seed_ * 1000003 + i);
    torch::Tensor image = at::randn({1, 8, 8}, generator);
    torch::Tensor quadrants = image.view({2, 4, 2, 4}).sum({1, 3}).flatten();
    images.push_back(image);
    labels.push_back(quadrants.argmax());
  }
  return trident::Batch{torch::stack(images), torch::stack(labels)};
}

torch::Tensor SmoothedCrossEntropy(const trident::Batch& batch, const trident::Values& outputs) {
  const double smoothing = 0.1;
  torch::Tensor log_p = torch::log_softmax(outputs.at(0), -1);
  torch::Tensor target = -log_p.gather(1, batch.at(1).view({-1, 1})).mean();
  return (1 - smoothing) * target + smoothing * -log_p.mean();
}

namespace {

// Registered as the zoo registers its models: `train --model=skipnet
// --dataset_config...` (see skipnet.pbtxt) builds exactly these.
TRIDENT_REGISTER(trident::ModelRegistry, "skipnet",
                 [](const trident::ComponentArgs& args,
                    const trident::ModelContext& context) -> absl::StatusOr<trident::ModelSource> {
                   TRIDENT_RETURN_IF_ERROR(args.CheckKnown({"channels"}));
                   TRIDENT_ASSIGN_OR_RETURN(const int64_t channels, args.GetInt("channels", 8));
                   if (context.tp.size > 1)
                     return absl::InvalidArgumentError("skipnet has no tensor-parallel form; use tp=1");
                   return Source(context.seed, channels);
                 });

TRIDENT_REGISTER(trident::LossRegistry, "smoothed_cross_entropy", SmoothedCrossEntropy);

TRIDENT_REGISTER(trident::DatasetRegistry, "shapes",
                 [](const trident::ComponentArgs& args) -> absl::StatusOr<std::unique_ptr<trident::Dataset>> {
                   TRIDENT_RETURN_IF_ERROR(args.CheckKnown({"size", "seed"}));
                   TRIDENT_ASSIGN_OR_RETURN(const int64_t size, args.GetInt("size", 512));
                   TRIDENT_ASSIGN_OR_RETURN(const int64_t seed, args.GetInt("seed", 1));
                   return std::unique_ptr<trident::Dataset>(new ShapesDataset(size, seed));
                 });

}  // namespace
}  // namespace skipnet
