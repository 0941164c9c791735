#include "parallel/gradient_reducer.h"

#include <ATen/ATen.h>

#include "base/logging.h"

namespace trident {

GradientReducer::GradientReducer(const std::vector<at::Tensor>& parameters,
                                 const ProcessGroup* group, int64_t bucket_bytes,
                                 double predivide_factor)
    : group_(group != nullptr && group->size() > 1 ? group : nullptr),
      predivide_factor_(predivide_factor),
      parameters_(parameters) {
  if (group_ == nullptr) return;  // gradients as autograd makes them: nothing to sum
  const std::vector<std::vector<at::Tensor>> members = BucketsInBackwardOrder(parameters, bucket_bytes);
  buckets_.resize(members.size());
  for (size_t b = 0; b < members.size(); ++b) {
    int64_t total = 0;
    for (const at::Tensor& p : members[b]) total += p.numel();
    buckets_[b].buffer = at::zeros({total}, members[b].front().options());
    bucket_sizes_.push_back(static_cast<int>(members[b].size()));
    int64_t offset = 0;
    for (const at::Tensor& p : members[b]) {
      at::Tensor param = p;
      param.mutable_grad() = buckets_[b].buffer.narrow(0, offset, p.numel()).view(p.sizes());
      offset += p.numel();
      const int index = static_cast<int>(b);
      hooks_.Add(param, [this, index] { OnGradientReady(index); });
    }
  }
}

GradientReducer::~GradientReducer() = default;

void GradientReducer::ZeroGrad() {
  if (group_ != nullptr) {
    for (Bucket& bucket : buckets_) bucket.buffer.zero_();
    return;
  }
  // Undefined, so that backward's first gradient becomes .grad itself (no fill, no add).
  for (const at::Tensor& p : parameters_) {
    at::Tensor param = p;
    param.mutable_grad() = at::Tensor();
  }
}

void GradientReducer::PrepareForBackward(bool last_micro_batch) {
  sync_ = last_micro_batch && group_ != nullptr;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    buckets_[b].pending = bucket_sizes_[b];
    buckets_[b].launched = false;
  }
}

void GradientReducer::OnGradientReady(int bucket) {
  if (!sync_) return;
  Bucket& b = buckets_[bucket];
  if (--b.pending == 0) Launch(b);
}

void GradientReducer::Launch(Bucket& bucket) {
  bucket.launched = true;
  if (predivide_factor_ != 1.0) bucket.buffer.div_(predivide_factor_);
  auto work = group_->IAllReduce(bucket.buffer);
  if (work.ok()) {
    bucket.work = *std::move(work);
  } else {
    std::lock_guard<std::mutex> lock(mutex_);
    if (first_error_.ok()) first_error_ = work.status();
  }
}

absl::Status GradientReducer::FinishBackward() {
  if (group_ == nullptr) {
    // A parameter backward did not reach gets zeros, as a bucket would give it:
    // the optimizer then treats it as with data parallelism.
    for (const at::Tensor& p : parameters_) {
      if (!p.grad().defined()) {
        at::Tensor param = p;
        param.mutable_grad() = at::zeros_like(p);
      }
    }
    return absl::OkStatus();
  }
  // NOTE: buckets whose parameters got no gradient this step (unused parameters)
  // are launched here, in bucket order, so every rank issues the same sequence.
  for (Bucket& bucket : buckets_) {
    if (!bucket.launched) Launch(bucket);
  }
  absl::Status status = first_error_;
  first_error_ = absl::OkStatus();
  for (Bucket& bucket : buckets_) {
    absl::Status waited = bucket.work.Wait();
    if (status.ok() && !waited.ok()) status = waited;
  }
  if (!status.ok()) return status;
  for (Bucket& bucket : buckets_) {
    if (predivide_factor_ == 1.0) {
      bucket.buffer.div_(group_->size());
    } else {
      bucket.buffer.mul_(predivide_factor_ / group_->size());
    }
  }
  sync_ = false;
  return absl::OkStatus();
}

}  // namespace trident
