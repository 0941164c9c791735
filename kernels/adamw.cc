// AdamW's update over flat fp32 arrays (FusedAdamW's CPU pass).
#include <cmath>
#include <cstdint>

#include <ATen/Parallel.h>

#include "kernels/kernels.h"

namespace trident {
namespace {

// One pass of AdamW over n floats: reads p, g, m, v once and writes p, m, v
// once. Vectorised by the compiler (the kernels library's copts in BUILD: the
// vectoriser's dynamic cost model, and sqrt without errno so it can be a
// vector instruction); the arithmetic is IEEE single precision either way, so
// the results do not depend on the vector width.
void AdamWRange(float* __restrict p, const float* __restrict g, float* __restrict m, float* __restrict v, int64_t n,
                float decay, float beta1, float beta2, float inverse_sqrt_bias_correction2, float eps,
                float step_size) {
  for (int64_t i = 0; i < n; ++i) {
    const float grad = g[i];
    const float new_m = m[i] * beta1 + grad * (1 - beta1);
    const float new_v = v[i] * beta2 + grad * grad * (1 - beta2);
    m[i] = new_m;
    v[i] = new_v;
    const float denominator = std::sqrt(new_v) * inverse_sqrt_bias_correction2 + eps;
    p[i] = p[i] * decay - step_size * (new_m / denominator);
  }
}

}  // namespace

void FusedAdamWStep(float* p, const float* g, float* m, float* v, int64_t n, float decay, float beta1, float beta2,
                    float inverse_sqrt_bias_correction2, float eps, float step_size) {
  at::parallel_for(0, n, 1 << 14, [&](int64_t begin, int64_t end) {
    AdamWRange(p + begin, g + begin, m + begin, v + begin, end - begin, decay, beta1, beta2,
               inverse_sqrt_bias_correction2, eps, step_size);
  });
}

}  // namespace trident
