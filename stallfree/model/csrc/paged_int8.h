// The int8 KV cache's rows, as the attention kernels read them in place
// (paged_decode_int8.h, paged_prefill_f32.h).
//
// An int8 cache [2, blocks, block_size, Hkv, D + 4] holds per (token, KV head) D int8 values
// q and then the row's float32 scale s (native byte order), x ~ s * q: symmetric, one scale
// per row (model/kv_quant.py writes it). Since the scale is the row's, a score is
// s_k * (q . k_q) and a weighted value p * s_v * v_q: decode widens the int8 values to float
// and applies each scale once per row (to the score, and to the softmax weight); prefill
// dequantizes a step's rows into a buffer its float32 loops read as they read a float
// cache's.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "native_vec.h"
#include "vec.h"

namespace {

// Elements after a row's D values: the int8 row's scale (4 bytes); none for float rows.
template <typename T>
constexpr int64_t kRowExtra = std::is_same_v<T, int8_t> ? int64_t(sizeof(float)) : 0;

// Elements per (token, KV head) row of a cache of T with head size D.
template <typename T>
constexpr int64_t row_elems(int64_t dim) {
  return dim + kRowExtra<T>;
}

// The scale of an int8 row whose values start at p (D of them).
inline float row_scale(const int8_t* p, int64_t dim) {
  float s;
  std::memcpy(&s, p + dim, sizeof s);
  return s;
}

// int8 values widened to fp32: vpmovsxbd + vcvtdq2ps, in intrinsics, since GCC 12 widens a
// vector of int8 (__builtin_convertvector) a lane at a time through the general registers.

// 8 values, whatever the build's width.
inline vf8 load8_int8(const int8_t* p) {
#if defined(__AVX2__)
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<vf8>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
#else
  vf8 v;
  for (int l = 0; l < 8; ++l) v[l] = p[l];
  return v;
#endif
}

// A register's worth (native_vec.h: 16 lanes, or 8 in AVX2 builds).
inline vn load_vn_int8(const int8_t* p) {
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<vn>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)));
#else
  static_assert(kWidth == 8);
  return reinterpret_cast<vn>(load8_int8(p));
#endif
}

// The scales of a decode tile's 2 * kLanes rows (cache offsets `rows`, at the KV head's
// first value), as two vectors: lane j of out[0] for row j, of out[1] for row 16 + j. Read
// once per KV head and tile, for every query head of its GQA group.
inline void tile_scales(const int8_t* base, const int64_t* rows, int64_t dim, vf* out) {
  alignas(64) float s[2 * kLanes];
  for (int j = 0; j < 2 * kLanes; ++j) s[j] = row_scale(base + rows[j], dim);
  std::memcpy(out, s, sizeof s);
}

// `count` rows of an int8 cache (from p, `stride` bytes apart), dequantized to s * q in fp32
// into out (D floats apart): for the float32 prefill loops, the same values, rounded the same,
// as a float cache holding s * q would give them.
inline void dequantize_rows(const int8_t* p, int64_t stride, int64_t count, int64_t dim,
                            float* out) {
  for (int64_t t = 0; t < count; ++t, p += stride, out += dim) {
    const vn s = splat(row_scale(p, dim));
    for (int64_t d = 0; d < dim; d += kWidth) store_vn(out + d, load_vn_int8(p + d) * s);
  }
}

}  // namespace
