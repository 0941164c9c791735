#include "parallel/gradient_reducer.h"

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "base/logging.h"

namespace trident {

GradientReducer::GradientReducer(const NamedTensors& parameters, const ProcessGroup* group, int64_t bucket_bytes,
                                 double predivide_factor)
    : group_(group != nullptr && group->size() > 1 ? group : nullptr),
      predivide_factor_(predivide_factor),
      parameters_(parameters) {
  if (group_ == nullptr) return;  // gradients as autograd makes them: nothing to sum
  std::vector<int64_t> bytes;
  for (const auto& [name, p] : parameters) bytes.push_back(p.numel() * static_cast<int64_t>(p.element_size()));
  const std::vector<std::vector<int>> members = BucketIndicesInBackwardOrder(bytes, bucket_bytes);
  buckets_.resize(members.size());
  bucket_of_.resize(parameters.size());
  arrived_.resize(parameters.size());
  for (size_t b = 0; b < members.size(); ++b) {
    int64_t total = 0;
    for (int i : members[b]) total += parameters[i].second.numel();
    buckets_[b].buffer = at::zeros({total}, parameters[members[b].front()].second.options());
    buckets_[b].size = static_cast<int>(members[b].size());
    int64_t offset = 0;
    for (int i : members[b]) {
      at::Tensor param = parameters[i].second;
      param.mutable_grad() = buckets_[b].buffer.narrow(0, offset, param.numel()).view(param.sizes());
      offset += param.numel();
      bucket_of_[i] = static_cast<int>(b);
      hooks_.Add(param, [this, i] { OnGradientReady(i); });
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
  for (const auto& [name, p] : parameters_) {
    at::Tensor param = p;
    param.mutable_grad() = at::Tensor();
  }
}

void GradientReducer::PrepareForBackward(bool last_micro_batch) {
  sync_ = last_micro_batch && group_ != nullptr;
  for (Bucket& bucket : buckets_) {
    bucket.pending = bucket.size;
    bucket.launched = false;
  }
  arrived_.assign(arrived_.size(), false);
}

void GradientReducer::OnGradientReady(int parameter) {
  if (!sync_) return;
  Bucket& bucket = buckets_[bucket_of_[parameter]];
  if (bucket.launched) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (first_error_.ok()) {
      first_error_ = absl::InternalError(absl::StrCat(
          "the gradient of ", parameters_[parameter].first,
          " was accumulated again after its bucket's "
          "all-reduce had started, so the sum may have missed part of it: a backward pass that accumulates a "
          "parameter more than once (a hand-written backward inside a recomputed module?)"));
    }
    return;
  }
  if (arrived_[parameter]) return;  // a further contribution before the all-reduce: already in the buffer
  arrived_[parameter] = true;
  if (--bucket.pending == 0) Launch(bucket);
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
    for (const auto& [name, p] : parameters_) {
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
