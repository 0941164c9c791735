// Replacing LibTorch's own CPU kernels of aten operators at run time, for
// base's kernels (onednn_products.cc).
#ifndef TRIDENT_BASE_INTERNAL_CPU_OVERRIDES_H_
#define TRIDENT_BASE_INTERNAL_CPU_OVERRIDES_H_

#include <functional>

#include <torch/library.h>

namespace trident {
namespace internal {

// Calls `define` with a library of CPU kernels for aten operators that lives
// as long as the process; what it registers takes the place of LibTorch's
// kernels. LibTorch warns once per replaced operator; the warnings are
// silenced, as replacing is the point.
void OverrideAtenCpuKernels(const std::function<void(torch::Library&)>& define);

}  // namespace internal
}  // namespace trident

#endif  // TRIDENT_BASE_INTERNAL_CPU_OVERRIDES_H_
