// SkipNet: a small convolutional network that is neither a transformer nor in
// Trident's zoo, with a long skip connection that crosses pipeline stage
// boundaries, its own dataset and its own loss. Registered by name exactly as
// the zoo is, so `train --model=skipnet` finds it, and usable through the C++
// API (skipnet::Source with Parallelize).
#ifndef TRIDENT_EXAMPLES_SKIPNET_SKIPNET_H_
#define TRIDENT_EXAMPLES_SKIPNET_SKIPNET_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "data/data.h"
#include "parallel/parallel.h"

namespace skipnet {

// image [B, 1, 8, 8] -> logits [B, 4]. The stem's output is added back after
// three more convolutions: cut the model in the middle and both tensors cross.
struct SkipNetImpl : torch::nn::Module {
  explicit SkipNetImpl(int64_t channels = 8);
  torch::Tensor forward(const torch::Tensor& image);
  torch::nn::Conv2d stem{nullptr};
  torch::nn::Sequential body;
  torch::nn::Linear hidden{nullptr}, classes{nullptr};
};
TORCH_MODULE(SkipNet);

// The model as a Trident source: built with the weights `seed` gives on every
// rank, traced from its forward, with SmoothedCrossEntropy as its loss.
trident::ModelSource Source(uint64_t seed, int64_t channels = 8);

// Random 8x8 images, each labelled by its brightest quadrant (4 classes).
// Sample i is the same on every rank and every run. Fields: image, label.
class ShapesDataset : public trident::Dataset {
 public:
  ShapesDataset(int64_t size, uint64_t seed) : size_(size), seed_(seed) {}
  int64_t size() const override { return size_; }
  absl::StatusOr<trident::Batch> Get(const std::vector<int64_t>& indices) const override;
  std::vector<std::string> field_names() const override { return {"image", "label"}; }

 private:
  int64_t size_;
  uint64_t seed_;
};

// Cross-entropy with label smoothing 0.1 of the logits (outputs[0]) against
// the batch's labels.
torch::Tensor SmoothedCrossEntropy(const trident::Batch& batch, const trident::Values& outputs);

}  // namespace skipnet

#endif  // TRIDENT_EXAMPLES_SKIPNET_SKIPNET_H_
