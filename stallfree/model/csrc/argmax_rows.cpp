// The greedy token of each row of fp32 logits (CPU): torch.argmax(x, dim=-1), first index of
// the largest value, a NaN counting as larger than any number. torch's CPU argmax reads
// values one at a time, ~1.6 G/s here: 0.5-1 ms of a 32-row decode step over a 49K
// vocabulary (2-core EPYC), where a register's lanes at a time read the row at memory speed.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "native_vec.h"

namespace {

// In vectors of the register width (native_vec.h): in AVX2 builds vec.h's 16-lane vectors
// stayed in memory, and a 32-row step's argmax took ~3 ms instead of a few tenths.
int64_t row_argmax(const float* x, int64_t n) {
  vni lane;
  for (int l = 0; l < kWidth; ++l) lane[l] = l;
  vn best = splat(-std::numeric_limits<float>::infinity());
  vni where = vni{};  // per lane, the first index holding its best (0 while all are -inf)
  vni nan = vni{};
  const int64_t whole = n / kWidth * kWidth;
  for (int64_t i = 0; i < whole; i += kWidth) {
    const vn v = load_vn(x + i);
    const vni above = v > best;  // strictly: a lane keeps the first of equal values
    best = above ? v : best;
    where = above ? lane + static_cast<int32_t>(i) : where;
    nan |= v != v;
  }
  bool any_nan = false;
  for (int l = 0; l < kWidth; ++l) any_nan |= nan[l] != 0;
  for (int64_t i = whole; i < n; ++i) any_nan |= std::isnan(x[i]);
  if (any_nan) {
    for (int64_t i = 0; i < n; ++i)
      if (std::isnan(x[i])) return i;
  }
  // The lanes' best, the lowest index among equals; the tail comes after every lane.
  float top = best[0];
  int64_t at = where[0];
  for (int l = 1; l < kWidth; ++l)
    if (best[l] > top || (best[l] == top && where[l] < at)) {
      top = best[l];
      at = where[l];
    }
  if (whole == 0) at = 0, top = x[0];
  for (int64_t i = whole; i < n; ++i)
    if (x[i] > top) top = x[i], at = i;
  return at;
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kFloat &&
                  x.is_contiguous() && x.size(1) > 0,
              "argmax_rows: contiguous fp32 x [rows, n > 0] on CPU expected, got ", x.sizes(),
              " ", x.scalar_type());
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = row_argmax(xp + r * n, n);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(stallfree, m) { m.def("argmax_rows(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(stallfree, CPU, m) { m.impl("argmax_rows", &argmax_rows); }
