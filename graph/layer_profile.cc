#include <algorithm>
#include <chrono>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "graph/graph.h"

namespace trident {

namespace {

// Profiles layer i of `layers` on input `x`; sets `output` to its result.
absl::StatusOr<LayerProfile> ProfileLayer(LayerSequence& layers, int64_t i, const at::Tensor& x,
                                          at::Tensor* output) {
  at::NoGradGuard no_grad;
  LayerProfile p;
  p.name = layers.LayerName(i);
  int64_t matrix_scalars = 0;
  for (const auto& [name, tensor] : layers.LayerParameters(i)) {
    p.parameter_names.push_back(name);
    p.parameters += tensor.numel();
    p.parameter_bytes += tensor.numel() * tensor.element_size();
    if (tensor.dim() >= 2) matrix_scalars += tensor.numel();
  }
  if (at::isFloatingType(x.scalar_type())) {
    const int64_t rows = x.numel() / std::max<int64_t>(1, x.size(-1));
    p.forward_flops = 2.0 * rows * matrix_scalars;
  }
  std::vector<double> seconds;
  absl::Status ran = CatchExceptions(absl::StrCat("profiling layer ", i, " (", p.name, ")"), [&] {
    for (int run = 0; run < 3; ++run) {
      const auto start = std::chrono::steady_clock::now();
      *output = layers.RunLayer(i, x);
      seconds.push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
  });
  TRIDENT_RETURN_IF_ERROR(ran);
  std::sort(seconds.begin(), seconds.end());
  p.forward_seconds = seconds[1];
  p.activation_bytes = output->numel() * output->element_size();
  return p;
}

}  // namespace

absl::StatusOr<std::vector<LayerProfile>> ProfileLayers(LayerSequence& layers,
                                                        const at::Tensor& input) {
  std::vector<LayerProfile> profile;
  at::Tensor x = input, output;
  for (int64_t i = 0; i < layers.NumLayers(); ++i) {
    TRIDENT_ASSIGN_OR_RETURN(LayerProfile p, ProfileLayer(layers, i, x, &output));
    profile.push_back(std::move(p));
    x = output;
  }
  return profile;
}

absl::StatusOr<std::vector<LayerProfile>> ProfileLayersOneByOne(int64_t num_layers,
                                                                const LayerBuilder& build,
                                                                const at::Tensor& input) {
  std::vector<LayerProfile> profile;
  at::Tensor x = input, output;
  for (int64_t i = 0; i < num_layers; ++i) {
    TRIDENT_ASSIGN_OR_RETURN(std::shared_ptr<LayerSequence> part, build(i));
    TRIDENT_ASSIGN_OR_RETURN(LayerProfile p, ProfileLayer(*part, i, x, &output));
    profile.push_back(std::move(p));
    x = output;
  }  // each part is freed as `part` goes out of scope
  return profile;
}

}  // namespace trident
