// Autocast's per-device state (on, and to which dtype), read and set the same
// way whatever LibTorch version (1.x and 2.x spell it differently).
#ifndef TRIDENT_BASE_AUTOCAST_STATE_H_
#define TRIDENT_BASE_AUTOCAST_STATE_H_

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

namespace trident {

struct AutocastState {
  bool enabled = false;
  c10::ScalarType dtype = c10::ScalarType::Float;
};
AutocastState GetAutocastState(c10::DeviceType device);
void SetAutocastState(c10::DeviceType device, const AutocastState& state);

}  // namespace trident

#endif  // TRIDENT_BASE_AUTOCAST_STATE_H_
