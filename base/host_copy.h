// Moving values between the host and a device without waiting for the work
// the device has queued. On a GPU, `tensor.item()` and a copy from pageable
// host memory both wait until the stream has run everything queued before
// them: a training step that reads its loss, or copies in its batch, that way
// leaves the GPU idle while the host queues the next work. On the CPU both
// helpers are the plain operations.
#ifndef TRIDENT_BASE_HOST_COPY_H_
#define TRIDENT_BASE_HOST_COPY_H_

#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>

namespace trident {

// A one-element tensor's value, copied to the host as soon as the device
// computes it: the constructor queues a copy into pinned memory on the
// tensor's current stream and an event after it; Get() waits for that event
// alone, not for the work queued after the value.
class PendingScalar {
 public:
  PendingScalar() = default;
  explicit PendingScalar(const at::Tensor& value);
  bool defined() const { return host_.defined(); }
  // The value (waits for the copy on a device).
  double Get() const;

 private:
  at::Tensor host_;
  std::shared_ptr<c10::Event> copied_;  // null when the value was on the CPU
};

// `tensor` on `device`. From host memory to a device the copy goes through
// pinned memory and does not wait for the device's queued work: it is
// ordered on the device's current stream, before whatever is queued next.
at::Tensor ToDeviceWithoutWaiting(const at::Tensor& tensor, const c10::Device& device);

// Multiplies `tensors` in place by the one-element `factor` where it lies,
// never reading it on the host (so a GPU's factor is not waited for), with
// the same bits as `t.mul_(double)` for fp32, bf16 and fp16 tensors: the
// factor is rounded to fp32, and on a GPU bf16 and fp16 tensors are
// multiplied in fp32 as by a double (a device factor would be rounded to
// their type first; on the CPU a double is).
void MultiplyWithoutReading(const std::vector<at::Tensor>& tensors, const at::Tensor& factor);

}  // namespace trident

#endif  // TRIDENT_BASE_HOST_COPY_H_
