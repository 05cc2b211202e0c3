// x @ W.T in AVX512_BF16 vectors from the tile multiply's packing (see amx_linear.cpp), for
// CPUs with AVX512_BF16 but no AMX.
//
// A column block of the packing is a run of K/2 vectors of 64 bytes, vector p holding the
// k-pair p of its 16 columns: the B operand of the vector bf16-pair dot product as it
// stands. Rows of x are broadcast a pair at a time. A micro-block is up to 12 rows against
// two column blocks: 24 fp32 accumulators, two W vectors and the broadcast in the 32
// registers. A thread walks its column-block pairs; each pair (36-98 KB at the default
// model's widths) stays in L2 while every row group of x passes over it, and the next
// pair is asked for meanwhile. At a decode step's 8-64 rows oneDNN's bf16 path took
// 1.3-1.6x this kernel's time on a 2-core EPYC (docs/benchmarks.md).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

#include "bf16_pairs.h"
#include "vec.h"

#ifdef __AVX512BF16__
#define PAIR_LINEAR_VEC 1
#include <immintrin.h>

namespace {

constexpr int kVecRows = 12;  // rows of x per micro-block

// M rows of x (row stride lda) against column blocks w0 and, if Two, w1 (k_pairs vectors
// each); sums to acc [M][2][16]. `next`, where not null: two blocks to ask L2 for, two
// lines per k-pair, so that they arrive over this pass.
template <int M, bool Two>
inline void pair_block(const uint16_t* x, int64_t lda, const uint16_t* w0, const uint16_t* w1,
                       int64_t k_pairs, float* acc, const uint16_t* next) {
  __m512 a0[M], a1[M];
  for (int m = 0; m < M; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
  for (int64_t p = 0; p < k_pairs; ++p) {
    if (next != nullptr) {
      _mm_prefetch(reinterpret_cast<const char*>(next + p * 64), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(next + p * 64 + 32), _MM_HINT_T1);
    }
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(w0 + p * 32);
    const __m512bh b1 = Two ? (__m512bh)_mm512_loadu_si512(w1 + p * 32) : b0;
#pragma GCC unroll 12
    for (int m = 0; m < M; ++m) {
      uint32_t pair;
      std::memcpy(&pair, x + m * lda + 2 * p, sizeof pair);
      a0[m] = dot_pair(a0[m], pair, b0);
      if (Two) a1[m] = dot_pair(a1[m], pair, b1);
    }
  }
  for (int m = 0; m < M; ++m) {
    _mm512_storeu_ps(acc + m * 32, a0[m]);
    if (Two) _mm512_storeu_ps(acc + m * 32 + 16, a1[m]);
  }
}

template <bool Two, int M = kVecRows>
inline void pair_block_any(int rows, const uint16_t* x, int64_t lda, const uint16_t* w0,
                           const uint16_t* w1, int64_t k_pairs, float* acc,
                           const uint16_t* next) {
  if constexpr (M > 1)
    if (rows < M) return pair_block_any<Two, M - 1>(rows, x, lda, w0, w1, k_pairs, acc, next);
  pair_block<M, Two>(x, lda, w0, w1, k_pairs, acc, next);
}

// rows x K (row stride lda) against column blocks [col_begin, col_end) of a packing of
// k_pairs pairs per block; each micro-block's sums go to `store(rows, c, acc, two)` with acc
// [rows][2][16] for blocks c and c + 1.
template <typename Store>
void pair_linear_vec(const uint16_t* x, int64_t rows, int64_t lda, const uint16_t* w,
                     int64_t k_pairs, int64_t col_begin, int64_t col_end, Store&& store) {
  alignas(64) float acc[kVecRows * 32];
  const int64_t block = k_pairs * 32;
  for (int64_t c = col_begin; c < col_end; c += 2) {
    const bool two = c + 1 < col_end;
    const uint16_t* w0 = w + c * block;
    // The first pass over this pair brings the next one into L2 (later passes read this
    // one from there). Measured on a 2-core EPYC, the 30 layers' weights: 1.56x faster at
    // 32 rows and 1.5x at 8 than without (docs/benchmarks.md), where the hardware
    // prefetcher alone left the stream at 17-20 GB/s.
    const uint16_t* next = c + 2 < col_end ? w0 + 2 * block : nullptr;
    for (int64_t r0 = 0; r0 < rows; r0 += kVecRows) {
      const int n = static_cast<int>(std::min<int64_t>(kVecRows, rows - r0));
      const uint16_t* ask = r0 == 0 ? next : nullptr;
      if (two)
        pair_block_any<true>(n, x + r0 * lda, lda, w0, w0 + block, k_pairs, acc, ask);
      else
        pair_block_any<false>(n, x + r0 * lda, lda, w0, nullptr, k_pairs, acc, ask);
      store(r0, n, c, acc, two);
    }
  }
}

}  // namespace

#endif  // PAIR_LINEAR_VEC
