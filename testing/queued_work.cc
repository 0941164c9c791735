#include "testing/queued_work.h"

#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>

namespace trident::testing {

std::unique_ptr<c10::Event> QueueLongWork(const at::Tensor& a) {
  at::Tensor x = a;
  for (int i = 0; i < 400; ++i) x = at::mm(x, a).div_(a.size(0));
  const c10::DeviceType type = a.device().type();
  auto done = std::make_unique<c10::Event>(type);
  done->record(c10::impl::VirtualGuardImpl(type).getStream(a.device()));
  return done;
}

}  // namespace trident::testing
