#include "base/autocast_state.h"

#include <ATen/autocast_mode.h>
#include <torch/version.h>

namespace trident {

AutocastState GetAutocastState(c10::DeviceType device) {
#if TORCH_VERSION_MAJOR >= 2
  return {at::autocast::is_autocast_enabled(device), at::autocast::get_autocast_dtype(device)};
#else
  if (device == c10::DeviceType::CPU) return {at::autocast::is_cpu_enabled(), at::autocast::get_autocast_cpu_dtype()};
  return {at::autocast::is_enabled(), at::autocast::get_autocast_gpu_dtype()};
#endif
}

void SetAutocastState(c10::DeviceType device, const AutocastState& state) {
#if TORCH_VERSION_MAJOR >= 2
  at::autocast::set_autocast_enabled(device, state.enabled);
  at::autocast::set_autocast_dtype(device, state.dtype);
#else
  if (device == c10::DeviceType::CPU) {
    at::autocast::set_cpu_enabled(state.enabled);
    at::autocast::set_autocast_cpu_dtype(state.dtype);
  } else {
    at::autocast::set_enabled(state.enabled);
    at::autocast::set_autocast_gpu_dtype(state.dtype);
  }
#endif
}

}  // namespace trident
