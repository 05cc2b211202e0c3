// Decode attention's two products in bf16-pair dot products, for bf16 caches on CPUs with
// AVX512_BF16 (paged_decode.cpp's vector path): each instruction adds to 16 fp32 lanes the
// products of a pair of bf16 values with another pair, so a row is used as it is stored.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

#include "paged_decode.h"
#include "paged_decode_halves.h"
#include "vec.h"

#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

namespace {

// The scores of query head qh against key rows j = 0..15, lane j holding row j's. With
// AVX512_BF16, a bf16 row is multiplied as it is stored, pairs of dims at a time: two
// instructions per row at 64 dims, where widening it first takes eight. `ahead`, where not
// null, is asked for the K rows of its tokens first + j as row j is reached (null rather
// than a TileAhead of no tokens: with the pointer the loop is 1.05-1.1x faster, 2-core EPYC).
template <typename T, int C>
inline vf key_scores(const vf* qh, const T* k, const int64_t* rows,
                     const TileAhead<T, C * kLanes>* ahead, int first) {
#ifdef __AVX512F__
  vf a[kLanes];  // a[j]: the lane products of row j, summed across lanes by hsum16
#endif
#ifdef __AVX512BF16__
  if constexpr (kSplit<T, C>) {
    __m512bh qb[C / 2];  // the query's pairs, as stored: the even dim low, the odd dim high
    for (int c = 0; c < C; c += 2)
      qb[c / 2] = (__m512bh)((reinterpret_cast<vu>(round_bf16(qh[c])) >> 16) |
                             (reinterpret_cast<vu>(round_bf16(qh[c + 1])) & 0xffff0000u));
#pragma GCC unroll 16
    for (int j = 0; j < kLanes; ++j) {
      if (ahead != nullptr) ahead->ask_k(first + j);
      __m512 sum = _mm512_setzero_ps();
      for (int c = 0; c < C / 2; ++c)
        sum = _mm512_dpbf16_ps(sum, qb[c], (__m512bh)_mm512_loadu_si512(k + rows[j] + c * 32));
      a[j] = reinterpret_cast<vf>(sum);
    }
    return hsum16(a);
  }
#endif
#ifdef __AVX512F__
#pragma GCC unroll 16
  for (int j = 0; j < kLanes; ++j) {
    if (ahead != nullptr) ahead->ask_k(first + j);
    vf kr[C];
    load_row<T, C>(k + rows[j], kr);
    a[j] = qh[0] * kr[0];
    for (int c = 1; c < C; ++c) a[j] += qh[c] * kr[c];
  }
  return hsum16(a);
#else
  return key_scores_halves<T, C>(qh, k, rows, ahead, first);
#endif
}

#ifdef __AVX512BF16__
// The weighted V rows of up to HG query heads of one GQA group (heads [h0, h0 + count)) in
// bf16-pair dot products, added to their outputs so far scaled by alpha: the weights
// rounded to bf16 as torch's flash attention rounds them, two tokens' V rows interleaved
// once (a shift, a mask and an or per vector) and used by every head of the pass, whose
// outputs stay in registers across the tile. `ahead` is asked for the V rows of its token j
// as the loop reaches token j of this one.
template <int C, int HG>
inline void weighted_values_pairs(const c10::BFloat16* v, const int64_t* rows, int n,
                                  const vf (*p)[2], const float* alpha, int64_t h0, int count,
                                  float* acc_out,
                                  const TileAhead<c10::BFloat16, C * kLanes>& ahead) {
  __m512 acc[HG][C];
  uint32_t w[HG][kLanes];
  for (int hl = 0; hl < HG; ++hl) {
    if (hl >= count) break;
    std::memcpy(acc[hl], acc_out + (h0 + hl) * C * kLanes, sizeof acc[hl]);
    for (int c = 0; c < C; ++c) acc[hl][c] = _mm512_mul_ps(acc[hl][c], _mm512_set1_ps(alpha[hl]));
    for (int half = 0; half < 2; ++half) {  // word i: the weights of tokens 2i, 2i + 1
      const __m256bh rounded = _mm512_cvtneps_pbh(reinterpret_cast<__m512>(p[hl][half]));
      std::memcpy(w[hl] + half * kLanes / 2, &rounded, sizeof rounded);
    }
  }
  for (int j = 0; j < n; j += 2) {  // past n: weight 0, and the row repeats the first
    ahead.ask_v(j);
    ahead.ask_v(j + 1);
    __m512bh pairs[C];
    for (int c = 0; c < C; c += 2) {
      vu r0, r1;
      std::memcpy(&r0, v + rows[j] + c * kLanes, sizeof r0);
      std::memcpy(&r1, v + rows[j + 1] + c * kLanes, sizeof r1);
      pairs[c] = (__m512bh)((r0 & 0xffffu) | (r1 << 16));              // even dims
      pairs[c + 1] = (__m512bh)((r0 >> 16) | (r1 & 0xffff0000u));      // odd dims
    }
#pragma GCC unroll 8
    for (int hl = 0; hl < HG; ++hl) {
      if (hl >= count) break;
      const __m512bh weights = (__m512bh)_mm512_set1_epi32(static_cast<int>(w[hl][j / 2]));
      for (int c = 0; c < C; ++c) acc[hl][c] = _mm512_dpbf16_ps(acc[hl][c], weights, pairs[c]);
    }
  }
  for (int hl = 0; hl < count && hl < HG; ++hl)
    std::memcpy(acc_out + (h0 + hl) * C * kLanes, acc[hl], sizeof acc[hl]);
}
#endif

}  // namespace
