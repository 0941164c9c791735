// Data-parallel gradient averaging with overlap, in the manner of PyTorch DDP's
// reducer: parameters are grouped into buckets (in reverse registration order,
// roughly the order backward produces them); each parameter's .grad is a view
// into its bucket's flat buffer, so accumulation writes straight into the
// buffer; and a bucket's all-reduce starts as soon as every one of its
// parameters has had its gradient accumulated, while backward continues with
// earlier layers. Backward accumulates each parameter's gradient once (autograd
// sums a tied parameter's contributions first; recomputation and split
// backward keep it so); one accumulated again after its bucket's all-reduce
// started would race with it, and fails FinishBackward naming the parameter.
// Without a group to sum over there are no buckets: ZeroGrad leaves the
// gradients undefined, backward's first gradient of a parameter becomes its
// .grad (no zero fill, no addition), and FinishBackward gives the parameters
// backward did not reach zeros.
#ifndef TRIDENT_PARALLEL_GRADIENT_REDUCER_H_
#define TRIDENT_PARALLEL_GRADIENT_REDUCER_H_

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "base/gradient_hooks.h"
#include "base/tensors.h"
#include "topology/topology.h"

namespace trident {

class GradientReducer {
 public:
  // `group` averages the gradients (nullptr or size 1: no communication);
  // buckets hold up to `bucket_bytes` each. With `predivide_factor` f != 1 the
  // gradients are divided by f before the sum and multiplied by f / size after.
  GradientReducer(const NamedTensors& parameters, const ProcessGroup* group, int64_t bucket_bytes,
                  double predivide_factor = 1.0);
  ~GradientReducer();

  // Zeroes every gradient (the bucket buffers; without a group, undefines them).
  void ZeroGrad();
  // Call before each backward; `last_micro_batch` starts the all-reduces during it.
  void PrepareForBackward(bool last_micro_batch);
  // After the last backward: waits for the all-reduces and averages the gradients.
  absl::Status FinishBackward();

  int num_buckets() const { return static_cast<int>(buckets_.size()); }

 private:
  struct Bucket {
    at::Tensor buffer;
    int size = 0;     // its parameters
    int pending = 0;  // of them, those whose gradient has not arrived in this backward
    bool launched = false;
    PendingWork work;
  };
  void OnGradientReady(int parameter);
  void Launch(Bucket& bucket);

  const ProcessGroup* group_;
  double predivide_factor_;
  NamedTensors parameters_;
  std::vector<Bucket> buckets_;
  std::vector<int> bucket_of_;  // per parameter
  std::vector<bool> arrived_;   // per parameter, in this backward
  GradientAccumulatedHooks hooks_;
  bool sync_ = false;
  std::mutex mutex_;
  absl::Status first_error_;
};

}  // namespace trident

#endif  // TRIDENT_PARALLEL_GRADIENT_REDUCER_H_
