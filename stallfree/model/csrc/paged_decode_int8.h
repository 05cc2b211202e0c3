// Decode attention's tile over an int8 cache (paged_int8.h), for paged_decode.cpp.
//
// Widening int8 takes two instructions per vector (vpmovsxbd, vcvtdq2ps) where a float row
// is used as loaded, and widened once per query head as the other dtypes are, the rows took
// as long as they saved: the float32 kernel's compute plus the widening ran about as long
// as its DRAM reads did. So each row is widened once per KV head, for every query head of
// its GQA group: the tile's K rows into a buffer in L1 that the float path's scores read
// (key_scores<float>), each V row into registers, weighed into up to kInt8Heads heads'
// outputs at once. A row's scale multiplies its score, and its softmax weight where the
// weight meets the (unscaled) V row: one product per score instead of one per value.
#pragma once

#include <algorithm>
#include <cstdint>

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

// The tile's n K rows (int8 values at k + rows[j]) widened, unscaled, to rows j * D of buf;
// the tile ahead's K rows are asked for a row at a time.
template <int D>
inline void widen_keys(const int8_t* k, const int64_t* rows, int n, float* buf,
                       const TileAhead<int8_t, D>& ahead) {
  for (int j = 0; j < n; ++j) {
    ahead.ask_k(j);
    for (int i = 0; i < D; i += kWidth) store_vn(buf + j * D + i, load_vn_int8(k + rows[j] + i));
  }
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

// attend_tile (paged_decode.cpp) over an int8 cache: k and v at the cache's start, rows the
// offsets of the tile's tokens (the tail repeating the first), next the tile ahead's.
template <int C>
void attend_tile_int8(const Shape& s, const vf* q, const int8_t* k, const int8_t* v,
                      const int64_t* rows, int n, const Partial& out, const int64_t* next,
                      int n_next) {
  constexpr int D = C * kLanes;
  const int64_t group = s.heads / s.kv_heads;
  alignas(64) float keys[kTile * D];  // the widened K rows of one KV head
  int64_t at[kTile];                  // their offsets in it; the tail repeats the first
  for (int j = 0; j < kTile; ++j) at[j] = (j < n ? j : 0) * D;
  const TileAhead<float, D> none{nullptr, nullptr, nullptr, 0};
  for (int64_t kv = 0; kv < s.kv_heads; ++kv) {
    const int64_t head = kv * row_elems<int8_t>(D);
    const TileAhead<int8_t, D> ahead{k + head, v + head, next, n_next};
    vf key_scale[2], value_scale[2];
    tile_scales(k + head, rows, D, key_scale);
    tile_scales(v + head, rows, D, value_scale);
    widen_keys<D>(k + head, rows, n, keys, ahead);
    for (int64_t h0 = kv * group; h0 < (kv + 1) * group; h0 += kInt8Heads) {
      const int count = static_cast<int>(std::min<int64_t>(kInt8Heads, (kv + 1) * group - h0));
      vf p[kInt8Heads][2];
      float alpha[kInt8Heads];
      softmax_steps<float, C, kInt8Heads, true>(q, keys, at, n, out, h0, count, p, alpha, none,
                                                s.cap, key_scale);
      alignas(64) float w[kInt8Heads][kTile];  // after the sums: the weights of V's values
      for (int i = 0; i < count; ++i)
        for (int half = 0; half < 2; ++half) {
          const vf x = p[i][half] * value_scale[half];
          std::memcpy(w[i] + half * kLanes, &x, sizeof x);
        }
      const TileAhead<int8_t, D>* asks = h0 == kv * group ? &ahead : nullptr;
      float* acc = out.acc + h0 * D;
      switch (count) {  // the heads' count a constant, so their outputs stay in registers
        case 1: weighted_values_int8<D, 1>(v + head, rows, n, w, alpha, acc, asks); break;
        case 2: weighted_values_int8<D, 2>(v + head, rows, n, w, alpha, acc, asks); break;
        case 3: weighted_values_int8<D, 3>(v + head, rows, n, w, alpha, acc, asks); break;
        default:
          if constexpr (kInt8Heads >= 4)
            weighted_values_int8<D, kInt8Heads>(v + head, rows, n, w, alpha, acc, asks);
      }
    }
  }
}

}  // namespace
