// Loops over floats 16 at a time with GCC vector types (the fused CPU
// attention's row loops), for kernels built in clones (TRIDENT_VECTOR_CLONES:
// x86-64-v4, AVX-512 with FMA; x86-64-v3, AVX2 with FMA; and the baseline;
// the loader picks the one the CPU runs). A Floats is one AVX-512 register in
// the v4 clone, two AVX2 or four SSE registers in the others. The helpers are
// always inlined into each clone, so no vector crosses a call (hence the
// -Wpsabi warning about vector arguments is silenced for the includer).
#ifndef TRIDENT_KERNELS_INTERNAL_VECTOR_MATH_H_
#define TRIDENT_KERNELS_INTERNAL_VECTOR_MATH_H_

#include <cstdint>
#include <cstring>

#pragma GCC diagnostic ignored "-Wpsabi"

#define TRIDENT_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#define TRIDENT_VECTOR_INLINE inline __attribute__((always_inline))

namespace trident {
namespace vector_math {

typedef float Floats __attribute__((vector_size(64)));
typedef int32_t Ints __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;

TRIDENT_VECTOR_INLINE Floats Splat(float x) { return Floats{} + x; }

TRIDENT_VECTOR_INLINE Floats Load(const float* p) {
  Floats v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

TRIDENT_VECTOR_INLINE void Store(float* p, Floats v) { std::memcpy(p, &v, sizeof v); }

// Lanes of the 16 floats from index j on that come before index n.
TRIDENT_VECTOR_INLINE Ints Inside(int64_t j, int64_t n) {
  const Ints lanes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  return lanes < static_cast<int32_t>(n - j);
}

// Stores the lanes `inside`, keeping what p holds in the others.
TRIDENT_VECTOR_INLINE void StoreInside(float* p, Floats v, Ints inside) { Store(p, inside ? v : Load(p)); }

TRIDENT_VECTOR_INLINE float Sum(Floats v) {
  float sum = 0;
  for (int64_t i = 0; i < kLanes; ++i) sum += v[i];
  return sum;
}

// exp(x) within about 2 ulp, for x clamped to [-87, 88] (Cephes' expf:
// x = k ln2 + r with |r| <= ln2 / 2, a degree-6 polynomial for exp(r), 2^k
// from the exponent bits): below -87 it returns exp(-87), 1.6e-38, where exp
// underflows.
TRIDENT_VECTOR_INLINE Floats Exp(Floats x) {
  x = x < Splat(-87.0f) ? Splat(-87.0f) : x;
  x = x > Splat(88.0f) ? Splat(88.0f) : x;
  const Floats half = x < Splat(0) ? Splat(-0.5f) : Splat(0.5f);
  const Ints k = __builtin_convertvector(x * 1.44269504088896341f + half, Ints);  // rounded
  const Floats kf = __builtin_convertvector(k, Floats);
  const Floats r = x - kf * 0.693359375f + kf * 2.12194440e-4f;
  Floats p = Splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const Floats y = p * r * r + r + 1.0f;
  return y * (Floats)((k + 127) << 23);  // a vector cast keeps the bits
}

}  // namespace vector_math
}  // namespace trident

#endif  // TRIDENT_KERNELS_INTERNAL_VECTOR_MATH_H_
