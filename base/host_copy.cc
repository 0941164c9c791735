#include "base/host_copy.h"

#include <thread>

#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>

namespace trident {

PendingScalar::PendingScalar(const at::Tensor& value) {
  TORCH_CHECK(value.numel() == 1, "PendingScalar needs a one-element tensor; it has shape ", value.sizes());
  if (value.is_cpu()) {
    host_ = value.detach();
    return;
  }
  host_ = at::empty({}, at::TensorOptions().dtype(value.scalar_type()).pinned_memory(true));
  host_.copy_(value.detach().reshape({}), /*non_blocking=*/true);
  copied_ = std::make_shared<c10::Event>(value.device().type());
  copied_->record(c10::impl::VirtualGuardImpl(value.device().type()).getStream(value.device()));
}

double PendingScalar::Get() const {
  TORCH_CHECK(defined(), "PendingScalar::Get on an empty value");
  // c10::Event can only be polled in the LibTorch versions Trident builds with.
  if (copied_) {
    while (!copied_->query()) std::this_thread::yield();
  }
  return host_.item<double>();
}

at::Tensor ToDeviceWithoutWaiting(const at::Tensor& tensor, const c10::Device& device) {
  if (!tensor.defined()) return tensor;
  if (device.is_cpu() || !tensor.is_cpu()) return tensor.to(device);
  const at::Tensor pinned = tensor.is_pinned() ? tensor : tensor.pin_memory();
  return pinned.to(device, /*non_blocking=*/true);
}

}  // namespace trident
