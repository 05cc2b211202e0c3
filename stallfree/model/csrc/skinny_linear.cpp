// x @ W.T for a few rows of x and a bfloat16 W (CPU): the matmul of a decode step.
//
// At one to a few tokens a linear layer is a matrix-vector product: it must stream W from
// memory once, and nothing else matters. The BLAS paths torch takes for bf16 at this shape
// reach about 40% of the machine's read bandwidth (measured in docs/benchmarks.md), so this
// kernel reads W [N, K] row-major in 16-value vectors, widens them to fp32 (a shift) and
// accumulates every row of x against four rows of W at a time: each W value is loaded
// once per call, x stays in L1. Rows of W are dealt out to the threads in equal ranges.
// Accumulation is fp32 and the result is rounded to bf16 once, as torch's own bf16 matmul
// does. The next block's rows are prefetched a block ahead: without it the hardware
// prefetchers leave this loop at about half the bandwidth.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>

#include "vec.h"

namespace {

constexpr int kRows = 4;  // rows of W per pass: 4 x kTokens accumulators stay in registers
#ifdef __AVX512F__
constexpr int kTokens = 4;  // 32 vector registers
#else
constexpr int kTokens = 2;  // 16 (AVX2): a vf is two of them
#endif

inline vf widen16(const uint16_t* p) {
  return load16(reinterpret_cast<const c10::BFloat16*>(p));
}

inline float widen(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// out[t][r] = sum_k x[t][k] * w[r][k] for R rows of w and T rows of x (fp32, widened).
template <int R, int T>
void dot_block(const uint16_t* w, int64_t k_dim, const float* x, int64_t x_stride,
               c10::BFloat16* out, int64_t out_stride) {
  vf acc[R][T] = {};
  const int64_t k_vec = k_dim - k_dim % kLanes;
  for (int64_t k = 0; k < k_vec; k += kLanes) {
    vf wv[R];
    for (int r = 0; r < R; ++r) {
      // The next block's rows, one block (R rows) ahead: a DRAM latency's worth of bytes.
      __builtin_prefetch(w + (R + r) * k_dim + k);
      wv[r] = widen16(w + r * k_dim + k);
    }
    for (int t = 0; t < T; ++t) {
      vf xv;
      std::memcpy(&xv, x + t * x_stride + k, sizeof xv);
      for (int r = 0; r < R; ++r) acc[r][t] += wv[r] * xv;
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < T; ++t) {
      float s = hsum(acc[r][t]);
      for (int64_t k = k_vec; k < k_dim; ++k) s += widen(w[r * k_dim + k]) * x[t * x_stride + k];
      out[t * out_stride + r] = c10::BFloat16(s);  // round to nearest even
    }
  }
}

template <int R>
void block_for_tokens(const uint16_t* w, int64_t k_dim, const float* x, int64_t tokens,
                      c10::BFloat16* out, int64_t n_dim) {
  switch (tokens) {
    case 1: return dot_block<R, 1>(w, k_dim, x, k_dim, out, n_dim);
    case 2: return dot_block<R, 2>(w, k_dim, x, k_dim, out, n_dim);
    default: break;
  }
  if constexpr (kTokens >= 4) {
    if (tokens == 3) return dot_block<R, 3>(w, k_dim, x, k_dim, out, n_dim);
    if (tokens == 4) return dot_block<R, 4>(w, k_dim, x, k_dim, out, n_dim);
  }
}

// Rows [row_begin, row_end) of w against every row of x. The row loop is the outer one:
// a block of W rows is read from memory once, then from L1 by each group of tokens.
void rows(const uint16_t* w, int64_t k_dim, int64_t row_begin, int64_t row_end,
          const float* x, int64_t tokens, c10::BFloat16* out, int64_t n_dim) {
  for (int64_t r = row_begin; r < row_end;) {
    const bool full = r + kRows <= row_end;
    for (int64_t t = 0; t < tokens; t += kTokens) {
      const int64_t group = std::min<int64_t>(kTokens, tokens - t);
      const float* xt = x + t * k_dim;
      c10::BFloat16* ot = out + t * n_dim + r;
      if (full) block_for_tokens<kRows>(w + r * k_dim, k_dim, xt, group, ot, n_dim);
      else block_for_tokens<1>(w + r * k_dim, k_dim, xt, group, ot, n_dim);
    }
    r += full ? kRows : 1;
  }
}

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "skinny_linear: x [M, K] and weight [N, K] expected, got ", x.sizes(), " and ",
              weight.sizes());
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && x.scalar_type() == at::kBFloat16,
              "skinny_linear: bfloat16 x and weight expected");
  TORCH_CHECK(weight.is_contiguous(), "skinny_linear: weight must be row-major contiguous");
  const int64_t tokens = x.size(0), k_dim = x.size(1), n_dim = weight.size(0);
  // x widened once, here rather than as torch ops: at a decode step's sizes a torch call's
  // dispatch costs more than the conversion.
  std::vector<float> xf(tokens * k_dim);
  const auto xa = x.accessor<c10::BFloat16, 2>();  // any strides
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t k = 0; k < k_dim; ++k) xf[t * k_dim + k] = static_cast<float>(xa[t][k]);
  at::Tensor out = at::empty({tokens, n_dim}, x.options());
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<c10::BFloat16>());
  const float* xp = xf.data();
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  // Equal shares of W's rows, one per thread, each worth a parallel region (>= 32 KiB).
  const int64_t blocks = (n_dim + kRows - 1) / kRows;
  const int64_t min_blocks = std::max<int64_t>(1, (int64_t{32} << 10) / (2 * kRows * k_dim));
  const int64_t threads =
      std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), blocks / min_blocks));
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b0 = blocks * t / threads, b1 = blocks * (t + 1) / threads;
      rows(w, k_dim, b0 * kRows, std::min(b1 * kRows, n_dim), xp, tokens, op, n_dim);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(stallfree, m) {
  m.def("skinny_linear(Tensor x, Tensor weight) -> Tensor");
}

TORCH_LIBRARY_IMPL(stallfree, CPU, m) { m.impl("skinny_linear", &skinny_linear); }
