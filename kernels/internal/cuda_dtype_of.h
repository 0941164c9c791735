// The CudaDtype of an ATen scalar type, for kernels/' CUDA launchers' callers
// (C++ only: the .cu files do not include ATen).
#ifndef TRIDENT_KERNELS_INTERNAL_CUDA_DTYPE_OF_H_
#define TRIDENT_KERNELS_INTERNAL_CUDA_DTYPE_OF_H_

#include <c10/core/ScalarType.h>

#include "kernels/internal/cuda_dtype.h"

namespace trident {

// False for types the kernels do not take.
inline bool CudaDtypeOf(c10::ScalarType type, CudaDtype* dtype) {
  switch (type) {
    case c10::ScalarType::Float:
      *dtype = CudaDtype::kFloat;
      return true;
    case c10::ScalarType::BFloat16:
      *dtype = CudaDtype::kBFloat16;
      return true;
    case c10::ScalarType::Half:
      *dtype = CudaDtype::kHalf;
      return true;
    default:
      return false;
  }
}

}  // namespace trident

#endif  // TRIDENT_KERNELS_INTERNAL_CUDA_DTYPE_OF_H_
