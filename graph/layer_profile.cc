#include <algorithm>
#include <chrono>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "graph/graph.h"

namespace trident {

at::Tensor LayerSequence::Loss(const Values& outputs, const Batch&) {
  for (const at::Tensor& t : outputs) {
    if (t.defined() && t.dim() == 0 && at::isFloatingType(t.scalar_type())) return t;
  }
  throw std::invalid_argument(absl::StrCat("the model's outputs (", outputs.size(),
                                           " tensor(s)) hold no scalar loss: return the loss "
                                           "from forward (alone, or first among the outputs) or give a loss function"));
}

void LayerSequence::To(const at::Device& device) {
  c10::NoGradGuard no_grad;
  for (int64_t i = 0; i < NumLayers(); ++i) {
    NamedTensors parameters;
    try {
      parameters = LayerParameters(i);
    } catch (const std::out_of_range&) {
      continue;  // not materialised in this part
    }
    for (auto& [name, p] : parameters) {
      if (p.device() != device) p.set_data(p.data().to(device));
    }
  }
}

namespace {

int64_t Bytes(const Values& values) {
  int64_t bytes = 0;
  for (const at::Tensor& t : values) bytes += t.defined() ? t.numel() * t.element_size() : 0;
  return bytes;
}

// Profiles layer i of `layers` on `inputs`; sets `outputs` to its result.
absl::StatusOr<LayerProfile> ProfileLayer(LayerSequence& layers, int64_t i, const Values& inputs, const Batch& batch,
                                          Values* outputs) {
  c10::NoGradGuard no_grad;
  LayerProfile p;
  p.name = layers.LayerName(i);
  int64_t matrix_scalars = 0;
  for (const auto& [name, tensor] : layers.LayerParameters(i)) {
    p.parameter_names.push_back(name);
    p.parameters += tensor.numel();
    p.parameter_bytes += tensor.numel() * tensor.element_size();
    if (tensor.dim() >= 2) matrix_scalars += tensor.numel();
  }
  // Rows of the activation the layer multiplies (none for a layer fed token ids).
  for (const at::Tensor& x : inputs) {
    if (x.defined() && at::isFloatingType(x.scalar_type()) && x.dim() > 0) {
      p.forward_flops = 2.0 * (x.numel() / std::max<int64_t>(1, x.size(-1))) * matrix_scalars;
      break;
    }
  }
  std::vector<double> seconds;
  absl::Status ran = CatchExceptions(absl::StrCat("profiling layer ", i, " (", p.name, ")"), [&] {
    for (int run = 0; run < 3; ++run) {
      const auto start = std::chrono::steady_clock::now();
      *outputs = layers.RunLayer(i, inputs, batch);
      seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
  });
  TRIDENT_RETURN_IF_ERROR(ran);
  std::sort(seconds.begin(), seconds.end());
  p.forward_seconds = seconds[1];
  p.activation_bytes = Bytes(*outputs);
  return p;
}

}  // namespace

absl::StatusOr<std::vector<LayerProfile>> ProfileLayers(LayerSequence& layers, const Batch& batch) {
  std::vector<LayerProfile> profile;
  Values x, outputs;
  for (int64_t i = 0; i < layers.NumLayers(); ++i) {
    TRIDENT_ASSIGN_OR_RETURN(LayerProfile p, ProfileLayer(layers, i, x, batch, &outputs));
    profile.push_back(std::move(p));
    x = std::move(outputs);
  }
  return profile;
}

absl::StatusOr<std::vector<LayerProfile>> ProfileLayersOneByOne(int64_t num_layers, const LayerBuilder& build,
                                                                const Batch& batch) {
  std::vector<LayerProfile> profile;
  Values x, outputs;
  for (int64_t i = 0; i < num_layers; ++i) {
    TRIDENT_ASSIGN_OR_RETURN(std::shared_ptr<LayerSequence> part, build(i));
    TRIDENT_ASSIGN_OR_RETURN(LayerProfile p, ProfileLayer(*part, i, x, batch, &outputs));
    profile.push_back(std::move(p));
    x = std::move(outputs);
  }  // each part is freed as `part` goes out of scope
  return profile;
}

}  // namespace trident
