// x @ W.T for float32 x and W (CPU), at any number of rows of x, from a packing of W read
// in vectors of the build's native width: the matmuls of the float32 engine, the dtype on
// CPUs without fast bf16.
//
// At a decode step's 1-32 rows the matmuls must stream W once; torch's float32 paths read
// it at 5-18 GB/s on a 2-core EPYC whose sum reads at 60 (F.linear on the [N, K] weight, and
// oneDNN from its own blocked layout; docs/benchmarks.md). W is reordered once, at load
// (f32_pack), into blocks of 16 output columns, each a run of K vectors holding its 16
// columns' values at one k ([N/16][K][16]). A row of x broadcast one value at a time
// against a block's vector is a rank-1 update: no horizontal sums at any row count, and W
// read in one sequential run per thread. A micro-block is up to kMicroRows rows of x against
// two column blocks, its accumulators in registers. A thread walks its share of column
// blocks two at a time; while the first row group passes over a pair, the next pair is
// asked into L2, where the hardware prefetcher alone leaves such streams at about half the
// bandwidth (the bf16 kernels' finding, pair_linear_vec.h). Rows of x are taken in chunks
// that stay in L2 beside the pair they pass over.
//
// The inner loop's vectors are native_vec.h's, of the register width (one zmm, or one ymm
// in AVX2 builds), not vec.h's 16-lane `vf`, which GCC 12 keeps in memory in AVX2 builds.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "column_pairs.h"
#include "native_vec.h"
#include "vec.h"

namespace {

// A micro-block's accumulators, the block rows of W and the broadcast value of x fill the
// registers: 12 rows x two blocks (24 + 2 + 1 of 32 zmm), or in AVX2 6 rows x one block
// (12 + 2 + 1 of 16 ymm; two blocks of 3 rows, whose W then came from memory at every
// FMA, took 1.04-1.06x as long at 128-512 rows). A call of at most kPairRows rows takes two
// blocks per micro-block in any build: at a decode step's few rows the matmul streams W,
// and two blocks per pass keep twice the loads and independent sums in flight (in an AVX2
// build on a 2-core EPYC, 1.15-1.24x faster at 1-4 rows, though 3-4 rows spill a few of
// the 16 ymm). It is its own instantiation of column_blocks: with both micro-blocks
// reachable in one function, GCC 12 compiled the AVX2 build's 6-row path into one that
// took twice as long at 32-512 rows (docs/benchmarks.md).
#ifdef __AVX512F__
constexpr int kMicroRows = 12;
constexpr bool kBlockPairs = true;
constexpr int kPairRows = kMicroRows;
#else
constexpr int kMicroRows = 6;
constexpr bool kBlockPairs = false;
constexpr int kPairRows = 4;
#endif
static_assert(kPairRows <= kMicroRows, "a paired micro-block fits the accumulators");
constexpr int kBlock = 16;                  // columns per packed block
constexpr int kParts = kBlock / kWidth;     // registers per block row
constexpr int64_t kChunkBytes = 384 << 10;  // x rows held in L2 at once

// M rows of x (row stride lda) against column blocks w0 and, if Two, w1 (k_dim vectors of
// 16 each); sums to acc [M][32]. `next`, where not null: two blocks to ask L2 for, two
// lines per k, so that they arrive over this pass.
template <int M, bool Two>
inline void micro_block(const float* x, int64_t lda, const float* w0, const float* w1,
                        int64_t k_dim, float* acc, const float* next) {
  vn a0[M][kParts], a1[M][kParts];
  for (int m = 0; m < M; ++m)
    for (int p = 0; p < kParts; ++p) a0[m][p] = a1[m][p] = vn{};
  for (int64_t k = 0; k < k_dim; ++k) {
    if (next != nullptr) {
      __builtin_prefetch(next + 2 * kBlock * k, 0, 2);
      __builtin_prefetch(next + 2 * kBlock * k + kBlock, 0, 2);
    }
    // One load per register: a single copy of a whole block row into the array went
    // through the stack in 16-byte pieces in AVX2 builds.
    vn b0[kParts], b1[kParts];
#pragma GCC unroll 2
    for (int p = 0; p < kParts; ++p) {
      std::memcpy(&b0[p], w0 + kBlock * k + p * kWidth, sizeof(vn));
      if (Two) std::memcpy(&b1[p], w1 + kBlock * k + p * kWidth, sizeof(vn));
    }
#pragma GCC unroll 12
    for (int m = 0; m < M; ++m) {
      const vn xb = splat(x[m * lda + k]);
#pragma GCC unroll 2
      for (int p = 0; p < kParts; ++p) {
        a0[m][p] += xb * b0[p];
        if (Two) a1[m][p] += xb * b1[p];
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int p = 0; p < kParts; ++p) {
      std::memcpy(acc + m * 2 * kBlock + p * kWidth, &a0[m][p], sizeof(vn));
      if (Two) std::memcpy(acc + m * 2 * kBlock + kBlock + p * kWidth, &a1[m][p], sizeof(vn));
    }
}

template <bool Two, int M = kMicroRows>
inline void micro_block_any(int rows, const float* x, int64_t lda, const float* w0,
                            const float* w1, int64_t k_dim, float* acc, const float* next) {
  if constexpr (M > 1)
    if (rows < M) return micro_block_any<Two, M - 1>(rows, x, lda, w0, w1, k_dim, acc, next);
  micro_block<M, Two>(x, lda, w0, w1, k_dim, acc, next);
}

// Rows [row_begin, row_end) of x [rows, k_dim] against column blocks [col_begin, col_end).
// Gated: the blocks alternate gate and up (f32_pack of a `gated` weight), and each pair's
// silu(gate) * up goes to out's column block c / 2 (out has n / 2 columns). Pairs:
// micro-blocks of up to kPairRows rows, each against two blocks.
template <bool Pairs>
void column_blocks(const float* x, int64_t k_dim, const float* w, int64_t col_begin,
                   int64_t col_end, int64_t row_begin, int64_t row_end, float* out,
                   int64_t ld, bool gated) {
  constexpr int kRows = Pairs ? kPairRows : kMicroRows;  // rows per micro-block
  alignas(64) float acc[kMicroRows * 2 * kBlock];
  const int64_t block = k_dim * kBlock;
  for (int64_t c = col_begin; c < col_end; c += 2) {
    const bool two = c + 1 < col_end;
    const float* w0 = w + c * block;
    const float* next = c + 2 < col_end ? w0 + 2 * block : nullptr;
    for (int64_t r0 = row_begin; r0 < row_end; r0 += kRows) {
      const int n = static_cast<int>(std::min<int64_t>(kRows, row_end - r0));
      const float* ask = r0 == row_begin ? next : nullptr;
      const float* xr = x + r0 * k_dim;
      if (Pairs && two) {
        micro_block_any<true, kPairRows>(n, xr, k_dim, w0, w0 + block, k_dim, acc, ask);
      } else {
        micro_block_any<false>(n, xr, k_dim, w0, nullptr, k_dim, acc, ask);
        if (two)  // its sums in acc's second half, as the pair's would be
          micro_block_any<false>(n, xr, k_dim, w0 + block, nullptr, k_dim, acc + kBlock,
                                 nullptr);
      }
      for (int r = 0; r < n; ++r) {
        const float* sums = acc + r * 2 * kBlock;
        if (gated) {
          const vf product = silu(load16(sums)) * load16(sums + kBlock);
          store16(out + (r0 + r) * ld + c / 2 * kBlock, product);
          continue;
        }
        float* o = out + (r0 + r) * ld + c * kBlock;
        std::memcpy(o, sums, (two ? 2 : 1) * kBlock * sizeof(float));
      }
    }
  }
}

void check_shapes(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat,
              "f32_pack: a 2-d float32 weight expected, got ", weight.sizes(), " ",
              weight.scalar_type());
  TORCH_CHECK(weight.size(0) % kBlock == 0,
              "f32_pack: weight rows must be a multiple of 16, got ", weight.sizes());
}

// W [N, K] -> [N/16][K][16]: each block of 16 rows of W transposed.
at::Tensor f32_pack(const at::Tensor& weight) {
  check_shapes(weight);
  const int64_t n = weight.size(0), k = weight.size(1);
  return weight.reshape({n / kBlock, kBlock, k}).transpose(1, 2).contiguous().reshape({n * k});
}

at::Tensor run_linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t n,
                      bool gated) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat &&
                  packed.scalar_type() == at::kFloat && packed.is_contiguous(),
              "f32_linear: float32 x [M, K] and a contiguous packed weight expected");
  const int64_t rows = x_in.size(0), k = x_in.size(1);
  TORCH_CHECK(n % kBlock == 0 && packed.numel() == n * k, "f32_linear: packed weight of ",
              packed.numel(), " values does not fit x ", x_in.sizes(), " and n = ", n);
  TORCH_CHECK(!gated || n % (2 * kBlock) == 0,
              "f32_linear_silu_mul: n must be a multiple of 32, got ", n);
  const int64_t ld = gated ? n / 2 : n;
  at::Tensor out = at::empty({rows, ld}, x_in.options());
  if (rows == 0 || k == 0) return out.zero_();  // K = 0: empty sums, as F.linear gives
  const at::Tensor x = x_in.contiguous();
  const float* xa = x.data_ptr<float>();
  const float* wa = packed.data_ptr<float>();
  float* oa = out.data_ptr<float>();
  const int64_t chunk = std::max<int64_t>(
      kMicroRows, kChunkBytes / (k * int64_t(sizeof(float))) / kMicroRows * kMicroRows);
  by_column_pairs(n / kBlock, [&](int64_t c0, int64_t c1) {
    for (int64_t r = 0; r < rows; r += chunk) {
      const int64_t end = std::min(rows, r + chunk);
      if (rows <= kPairRows)
        column_blocks<true>(xa, k, wa, c0, c1, r, end, oa, ld, gated);
      else
        column_blocks<kBlockPairs>(xa, k, wa, c0, c1, r, end, oa, ld, gated);
    }
  });
  return out;
}

at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  return run_linear(x, packed, n, false);
}

// x @ W.T for W = [gate; up] ([n, K], packed with its 16-row blocks of gate and up
// alternating), then silu(gate) * up: [M, n / 2], the gate and up products never stored.
at::Tensor f32_linear_silu_mul(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  return run_linear(x, packed, n, true);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(stallfree, m) {
  m.def("f32_pack(Tensor weight) -> Tensor");
  m.def("f32_linear(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("f32_linear_silu_mul(Tensor x, Tensor packed, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(stallfree, CPU, m) {
  m.impl("f32_pack", &f32_pack);
  m.impl("f32_linear", &f32_linear);
  m.impl("f32_linear_silu_mul", &f32_linear_silu_mul);
}
