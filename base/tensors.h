// Collections of tensors every component passes around.
#ifndef TRIDENT_BASE_TENSORS_H_
#define TRIDENT_BASE_TENSORS_H_

#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace trident {

// Tensors by name: parameters, optimizer state and checkpoint contents, in order.
using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;
// The tensors passed between layers (and between pipeline stages): one for
// the zoo's models, several where skip connections, masks or position ids
// cross a boundary. Integer and floating-point tensors alike.
using Values = std::vector<at::Tensor>;
// One micro-batch as a Dataset returns it, one tensor per field with the
// samples along dimension 0 (for token data: inputs, targets).
using Batch = std::vector<at::Tensor>;

}  // namespace trident

#endif  // TRIDENT_BASE_TENSORS_H_
