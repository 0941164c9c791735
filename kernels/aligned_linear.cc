#include "kernels/kernels.h"

#include <limits>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "base/autocast_state.h"

namespace trident {

at::Tensor PaddedLinear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, int64_t width) {
  const int64_t rows = weight.size(0);
  TORCH_CHECK(width >= rows, "PaddedLinear: width ", width, " is below the weight's ", rows, " rows");
  at::Tensor w = weight, b = bias;
  const AutocastState autocast = GetAutocastState(x.device().type());
  if (autocast.enabled && at::isFloatingType(w.scalar_type())) {
    // Pad in the compute dtype: the cast of the padded weight would read the pad too.
    w = w.to(autocast.dtype);
    if (b.defined()) b = b.to(autocast.dtype);
  }
  w = at::constant_pad_nd(w, {0, 0, 0, width - rows});
  if (b.defined()) b = at::constant_pad_nd(b, {0, width - rows});
  return at::linear(x, w, b).narrow(-1, 0, rows);
}

at::Tensor AlignedLinear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  const int64_t rows = weight.size(0);
  if (!x.is_cuda() || rows % kAlignedWidth == 0) return at::linear(x, weight, bias);
  return PaddedLinear(x, weight, bias, (rows + kAlignedWidth - 1) / kAlignedWidth * kAlignedWidth);
}

at::Tensor PaddedForSoftmax(const at::Tensor& x) {
  if (!x.is_view() || x.dim() < 1) return x;
  const at::Tensor base(at::TensorBase(x._base()));
  const int64_t columns = x.size(-1), width = base.dim() > 0 ? base.size(-1) : 0;
  // x must be exactly the first `columns` of each of base's rows.
  const bool first_columns = base.is_contiguous() && width > columns && width % kAlignedWidth == 0 &&
                             width - columns < kAlignedWidth && x.stride(-1) == 1 &&
                             (x.dim() == 1 || x.stride(-2) == width) && x.data_ptr() == base.data_ptr() &&
                             base.numel() / width == x.numel() / columns;
  if (!first_columns) return x;
  // The pad columns are no part of x: they take -inf in place, unseen by
  // autograd, as constants whose gradient nothing needs (the product's
  // backward reads its inputs, not its output; softmax gives them zero).
  {
    c10::NoGradGuard no_grad;
    base.detach().narrow(-1, columns, width - columns).fill_(-std::numeric_limits<double>::infinity());
  }
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = width;
  return base.view(sizes);
}

}  // namespace trident
