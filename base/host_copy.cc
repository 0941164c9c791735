#include "base/host_copy.h"

#include <thread>

#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/version.h>

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

void MultiplyWithoutReading(const std::vector<at::Tensor>& tensors, const at::Tensor& factor) {
  const at::Tensor f = factor.to(at::kFloat).reshape({});
  std::vector<at::Tensor> others;
  for (const at::Tensor& t : tensors) {
    if (!t.is_cpu() && (t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf)) {
      t.copy_(t.to(at::kFloat).mul_(f));
    } else {
      others.push_back(t);
    }
  }
  if (others.empty()) return;
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
  at::_foreach_mul_(others, f);  // one multi-tensor kernel
#else
  for (at::Tensor& t : others) t.mul_(f);  // a 0-dim factor: computed as by a Scalar
#endif
}

}  // namespace trident
