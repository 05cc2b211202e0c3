// Decode attention's tile over an int8 cache (paged_int8.h), for paged_decode.cpp.
//
// Widening int8 takes two instructions per vector (vpmovsxbd, vcvtdq2ps) where a float row
// is used as loaded; widened once per query head, as the other dtypes are, the rows took
// as long as they saved (the float kernel's compute plus the widening ran about as long as
// its DRAM reads). So each row is widened once per pass of up to kInt8Heads query heads of
// its GQA group, into registers, and serves them together:
//   scores  each K row's 8-float pieces go into every head's sums, 4 rows at a time, and a
//           tree of adds finishes 4 rows' sums at once (key_scores_int8): in 8-float
//           vectors on AVX-512 too, where the float path's 16 rows a head in 16-float
//           vectors (key_scores, hsum16) took 1.1x the time with the rows widened once into
//           a buffer, and 1.4x in AVX2 builds;
//   values  each V row widened into registers, weighed into every head's output at once.
// A row's scale multiplies its score, and its softmax weight where the weight meets the
// (unscaled) V row: one product per score instead of one per value.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "native_vec.h"
#include "paged_decode.h"
#include "paged_decode_softmax.h"
#include "paged_int8.h"
#include "vec.h"

namespace {

// Query heads per pass (their outputs in registers over the V rows: kInt8Heads * kInt8Piece
// accumulators, with a widened vector and the heads' weights beside them, fit AVX-512's 32
// registers and AVX2's 16), and the row's native vectors per pass over the tile's V rows.
#ifdef __AVX512F__
constexpr int kInt8Heads = 4;
#else
constexpr int kInt8Heads = 3;
#endif
constexpr int kInt8Piece = 4;

// Neighbouring lanes of a and b added, within each 128-bit half (as vhaddps).
inline vf8 pair_sums(vf8 a, vf8 b) {
  return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) +
         __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

// The lane sums of a0..a3, in order: neighbours added twice, then the two halves.
inline vf4 sums4(vf8 a0, vf8 a1, vf8 a2, vf8 a3) {
  const vf8 t = pair_sums(pair_sums(a0, a1), pair_sums(a2, a3));
  return __builtin_shufflevector(t, t, 0, 1, 2, 3) + __builtin_shufflevector(t, t, 4, 5, 6, 7);
}

// The unscaled scores of N query heads (their vectors from qh on, C per head) against the
// tile's rows 0..n-1 (int8 values at k + rows[j]): scores[h][0] for rows 0-15, [1] for
// 16-31 (lanes past n: the first row's, or 0). `ahead` is asked for the tile ahead's K
// rows. 4 * N sums and a widened piece in registers: 13 of AVX2's 16 at N = 3.
template <int C, int N>
inline void key_scores_int8(const vf* qh, const int8_t* k, const int64_t* rows, int n,
                            vf (*scores)[2], const TileAhead<int8_t, C * kLanes>& ahead) {
  constexpr int V = 2 * C;  // 8-float pieces of a row
  vf8 q[N * V];             // read from memory by the products
  std::memcpy(q, qh, sizeof q);
  alignas(64) float s[N][kTile] = {};
  for (int j0 = 0; j0 < n; j0 += 4) {
    for (int j = 0; j < 4; ++j) ahead.ask_k(j0 + j);
    vf8 acc[N][4] = {};
    for (int i = 0; i < V; ++i)
      for (int j = 0; j < 4; ++j) {
        const vf8 r = load8_int8(k + rows[j0 + j] + i * 8);
        for (int h = 0; h < N; ++h) acc[h][j] += q[h * V + i] * r;
      }
    for (int h = 0; h < N; ++h) {
      const vf4 sum = sums4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
      std::memcpy(s[h] + j0, &sum, sizeof sum);
    }
  }
  for (int h = 0; h < N; ++h) std::memcpy(scores[h], s[h], sizeof s[h]);
}

// softmax_steps' (paged_decode_softmax.h) step of query heads [h0, h0 + count) from scores
// formed here (scores[i]: tokens 0-15, 16-31 of the tile's n0 + n1, the lanes past them
// -inf). Its own steps, written out again: with the scores passed to a function shared by
// both, GCC held them in memory in the float path, whose code grew 1.1-1.9x.
template <int HG>
inline void softmax_weights(const vf (*scores)[2], int n0, int n1, const Partial& out,
                            int64_t h0, int count, vf (*p)[2], float* alpha) {
  const vi lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  float m[HG];
  for (int i = 0; i < count; ++i) {
    const vf both = scores[i][0] > scores[i][1] ? scores[i][0] : scores[i][1];
    m[i] = std::max(out.max[h0 + i], hmax(both));
  }
  for (int i = 0; i < count; ++i) {
    const int64_t h = h0 + i;
    alpha[i] = m[i] > out.max[h] ? std::exp(out.max[h] - m[i]) : 1.f;
    out.max[h] = m[i];
    p[i][0] = lane < n0 ? exp_nonpositive(scores[i][0] - m[i]) : vf{};
    p[i][1] = lane < n1 ? exp_nonpositive(scores[i][1] - m[i]) : vf{};
  }
  for (int i = 0; i < count; ++i)
    out.sum[h0 + i] = out.sum[h0 + i] * alpha[i] + hsum(p[i][0] + p[i][1]);
}

// N query heads' (h0, ...) weighted V rows for the tile's n tokens, added to their outputs
// so far (acc_out, D floats per head) scaled by alpha; w[h][j]: head h's weight of token j,
// its row's scale folded in. `ahead` (or null) is asked for the next tile's V rows.
template <int D, int N>
inline void weighted_values_int8(const int8_t* v, const int64_t* rows, int n,
                                 const float (*w)[kTile], const float* alpha, float* acc_out,
                                 const TileAhead<int8_t, D>* ahead) {
  constexpr int V = D / kWidth, P = V < kInt8Piece ? V : kInt8Piece;
  for (int i0 = 0; i0 < V; i0 += P) {
    vn acc[N][P];
    for (int h = 0; h < N; ++h)
      for (int i = 0; i < P; ++i)
        acc[h][i] = load_vn(acc_out + h * D + (i0 + i) * kWidth) * splat(alpha[h]);
    for (int j = 0; j < n; ++j) {
      if (i0 == 0 && ahead != nullptr) ahead->ask_v(j);
      vn wj[N];
      for (int h = 0; h < N; ++h) wj[h] = splat(w[h][j]);
      for (int i = 0; i < P; ++i) {
        const vn r = load_vn_int8(v + rows[j] + (i0 + i) * kWidth);
        for (int h = 0; h < N; ++h) acc[h][i] += wj[h] * r;
      }
    }
    for (int h = 0; h < N; ++h)
      for (int i = 0; i < P; ++i) store_vn(acc_out + h * D + (i0 + i) * kWidth, acc[h][i]);
  }
}

// fn(std::integral_constant<int, count>) for count in [1, kInt8Heads]: a pass's heads as a
// compile-time count, so that their sums stay in registers.
template <typename F>
inline void with_heads(int count, F&& fn) {
  switch (count) {
    case 1: return fn(std::integral_constant<int, 1>());
    case 2: return fn(std::integral_constant<int, 2>());
    case 3: return fn(std::integral_constant<int, 3>());
    default:
      if constexpr (kInt8Heads >= 4) return fn(std::integral_constant<int, kInt8Heads>());
  }
}

// attend_tile (paged_decode.cpp) over an int8 cache: k and v at the cache's start, rows the
// offsets of the tile's tokens (the tail repeating the first), next the tile ahead's.
template <int C>
void attend_tile_int8(const Shape& s, const vf* q, const int8_t* k, const int8_t* v,
                      const int64_t* rows, int n, const Partial& out, const int64_t* next,
                      int n_next) {
  constexpr int D = C * kLanes;
  const int64_t group = s.heads / s.kv_heads;
  const int n0 = std::min(n, kLanes), n1 = n - n0;
  const vi lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const vf minus_inf = vf{} - std::numeric_limits<float>::infinity();
  for (int64_t kv = 0; kv < s.kv_heads; ++kv) {
    const int64_t head = kv * row_elems<int8_t>(D);
    const TileAhead<int8_t, D> ahead{k + head, v + head, next, n_next};
    vf key_scale[2], value_scale[2];
    tile_scales(k + head, rows, D, key_scale);
    tile_scales(v + head, rows, D, value_scale);
    for (int64_t h0 = kv * group; h0 < (kv + 1) * group; h0 += kInt8Heads) {
      const int count = static_cast<int>(std::min<int64_t>(kInt8Heads, (kv + 1) * group - h0));
      const bool first = h0 == kv * group;  // the pass that asks for the tile ahead
      vf scores[kInt8Heads][2];
      const TileAhead<int8_t, D> asks{k + head, v + head, next, first ? n_next : 0};
      with_heads(count, [&](auto heads) {
        key_scores_int8<C, decltype(heads)::value>(q + h0 * C, k + head, rows, n, scores, asks);
      });
      for (int i = 0; i < count; ++i)  // scaled by their rows' scales, capped, masked
        for (int half = 0; half < 2; ++half) {
          const vf x = s.cap(scores[i][half] * key_scale[half]);
          scores[i][half] = lane < (half == 0 ? n0 : n1) ? x : minus_inf;
        }
      vf p[kInt8Heads][2];
      float alpha[kInt8Heads];
      softmax_weights<kInt8Heads>(scores, n0, n1, out, h0, count, p, alpha);
      alignas(64) float w[kInt8Heads][kTile];  // the weights of V's unscaled values
      for (int i = 0; i < count; ++i)
        for (int half = 0; half < 2; ++half) {
          const vf x = p[i][half] * value_scale[half];
          std::memcpy(w[i] + half * kLanes, &x, sizeof x);
        }
      with_heads(count, [&](auto heads) {
        weighted_values_int8<D, decltype(heads)::value>(v + head, rows, n, w, alpha,
                                                        out.acc + h0 * D,
                                                        first ? &ahead : nullptr);
      });
    }
  }
}

}  // namespace
