// Residual add + RMSNorm in one pass (CPU).
//
// Written as torch ops a norm is 8-10 small calls, each with its own allocation and
// dispatch; at a decode step's few rows that overhead, not the arithmetic, is its cost
// (measured, bf16, 576 wide: 5 us against 22 us at one row). At a prefill chunk's hundreds
// of rows the arithmetic counts too, so rows are processed 16 lanes at a time (vec.h),
// bf16 widened and rounded in vector registers: 153 us against 252 us for scalar loops at
// a 512-row chunk. It rounds where the torch reference path does (layers.py): the residual
// sum, the norm's output and the weight's product to the model's dtype, the norm itself
// in fp32, so results agree with it to the last rounding (the sum of squares may round
// differently). SiLU x up is not here: on AMX CPUs it runs in the gate/up matmul's
// epilogue (amx_linear.cpp), elsewhere in torch's two vectorised ops (a separate pass with
// a polynomial e^x measured 421 us at a 512-row chunk against their 239 + 95 us).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace {

// Rows per parallel task: enough work to be worth a thread at prefill sizes; a decode
// step's few rows run on the calling thread.
constexpr int64_t kRowGrain = 16;

// out = weight * rms_norm(h) and, with a residual, h = x + residual written back to it.
template <typename T>
void add_rms_norm_rows(const T* x, T* residual, const T* weight, T* out, int64_t rows,
                       int64_t dim, double eps) {
  const int64_t padded = (dim + kLanes - 1) / kLanes * kLanes;
  at::parallel_for(0, rows, kRowGrain, [&](int64_t r0, int64_t r1) {
    std::vector<float> h(padded);
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * dim;
      T* rr = residual ? residual + r * dim : nullptr;
      vf sq = {};
      for (int64_t i = 0; i < dim; i += kLanes) {
        const int n = static_cast<int>(std::min<int64_t>(kLanes, dim - i));
        vf sum = load_any(xr + i, n);
        if (rr) {
          sum = in_dtype<T>(sum + load_any(rr + i, n));
          store_any(rr + i, sum, n);
        }
        store16(h.data() + i, sum);  // lanes past n are zeros: they add nothing below
        sq += sum * sum;
      }
      const float inv = 1.f / std::sqrt(hsum(sq) / static_cast<float>(dim) +
                                        static_cast<float>(eps));
      T* o = out + r * dim;
      for (int64_t i = 0; i < dim; i += kLanes) {
        const int n = static_cast<int>(std::min<int64_t>(kLanes, dim - i));
        const vf normed = in_dtype<T>(load16(h.data() + i) * inv);
        store_any(o + i, in_dtype<T>(load_any(weight + i, n) * normed), n);
      }
    }
  });
}

// residual may be undefined (a plain norm); otherwise x is added into it in place.
at::Tensor norm_rows(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                     double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "rms_norm: contiguous x [T, D] expected");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == x.scalar_type() && weight.is_contiguous(),
              "rms_norm: weight [D] of x's dtype expected");
  TORCH_CHECK(!residual.defined() ||
                  (residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() &&
                   residual.is_contiguous()),
              "add_rms_norm: residual must be contiguous and match x");
  at::Tensor out = at::empty_like(x);
  const int64_t rows = x.size(0), dim = x.size(1);
  dispatch_float_bf16(x, "rms_norm", [&](auto* type_tag) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    add_rms_norm_rows(x.data_ptr<T>(), residual.defined() ? residual.data_ptr<T>() : nullptr,
                      weight.data_ptr<T>(), out.data_ptr<T>(), rows, dim, eps);
  });
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return norm_rows(x, at::Tensor(), weight, eps);
}

// residual += x (rounded to the dtype), then the norm of the sum.
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps) {
  return norm_rows(x, residual, weight, eps);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(stallfree, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(stallfree, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
}
