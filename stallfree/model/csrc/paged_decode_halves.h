// Decode attention's two products for builds without AVX-512 (an AVX2 CPU's), in 8-float
// halves of the kernel's 16-lane vectors.
//
// There a vf is two registers, and GCC 12 keeps such 64-byte values in memory between
// operations: a scalar's splat became 16 stores and a load, the accumulators of the weighted
// V rows lived on the stack, and an x86-64-v3 build's fp32 kernel ran 3-4x slower than the
// AVX-512 build on the same CPU, behind the torch path it replaces (docs/benchmarks.md).
// Written over vf8 halves, the same loops keep every value in registers. Rows are held as
// load_row holds them (paged_decode.h), so query, output and softmax state are unchanged.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "paged_decode.h"
#include "vec.h"

#ifndef __AVX512F__
namespace {

typedef uint32_t vu8 __attribute__((vector_size(32)));
typedef uint16_t vh8 __attribute__((vector_size(16)));

// Lanes [8 * half, 8 * half + 8) of vector c of a row, as load_row holds it.
template <typename T, int C>
inline vf8 load_half(const T* p, int c, int half) {
  if constexpr (kSplit<T, C>) {  // words of two dims: the even one low, the odd one high
    vu8 u;
    std::memcpy(&u, p + (c - c % 2) * kLanes + half * kLanes, sizeof u);
    return reinterpret_cast<vf8>(c % 2 == 0 ? u << 16 : u & 0xffff0000u);
  } else if constexpr (std::is_same_v<T, float>) {
    vf8 v;
    std::memcpy(&v, p + c * kLanes + half * 8, sizeof v);
    return v;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    vh8 h;
    std::memcpy(&h, p + c * kLanes + half * 8, sizeof h);
    return reinterpret_cast<vf8>(__builtin_convertvector(h, vu8) << 16);
  } else {  // c10::Half, widened as load16 widens it
#ifdef __FLT16_MANT_DIG__
    typedef _Float16 vhf8 __attribute__((vector_size(16)));
    vhf8 h;
    std::memcpy(&h, p + c * kLanes + half * 8, sizeof h);
    return __builtin_convertvector(h, vf8);
#else
    vf8 v;
    for (int l = 0; l < 8; ++l) v[l] = static_cast<float>(p[c * kLanes + half * 8 + l]);
    return v;
#endif
  }
}

inline float hsum8(vf8 a) {
  const vf4 s = __builtin_shufflevector(a, a, 0, 1, 2, 3) +
                __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (s[0] + s[2]) + (s[1] + s[3]);
}

// key_scores (paged_decode_pairs.h) in halves: each row's products summed to its score at
// once, where the 16 rows' products side by side would not fit the 16 registers.
template <typename T, int C>
inline vf key_scores_halves(const vf* qh, const T* k, const int64_t* rows,
                            const TileAhead<T, C * kLanes>* ahead, int first) {
  vf8 q[2 * C];
  std::memcpy(q, qh, sizeof q);
  alignas(64) float score[kLanes];
  for (int j = 0; j < kLanes; ++j) {
    if (ahead != nullptr) ahead->ask_k(first + j);
    vf8 prod = q[0] * load_half<T, C>(k + rows[j], 0, 0);
    for (int i = 1; i < 2 * C; ++i) prod += q[i] * load_half<T, C>(k + rows[j], i / 2, i % 2);
    score[j] = hsum8(prod);
  }
  vf s;
  std::memcpy(&s, score, sizeof s);
  return s;
}

// One query head's weighted V rows for the tile's n tokens (weights p[0] for tokens 0-15,
// p[1] for 16-31), added to its output so far (acc_out, D floats) scaled by alpha.
template <typename T, int C>
inline void weighted_values_halves(const T* v, const int64_t* rows, int n, const vf* p,
                                   float alpha, float* acc_out,
                                   const TileAhead<T, C * kLanes>* ahead) {
  vf8 acc[2 * C];
  std::memcpy(acc, acc_out, sizeof acc);
  for (vf8& a : acc) a *= alpha;
  alignas(64) float weight[2 * kLanes];
  std::memcpy(weight, p, sizeof weight);
  for (int j = 0; j < n; ++j) {
    if (ahead != nullptr) ahead->ask_v(j);
    const vf8 w = vf8{} + weight[j];
    for (int i = 0; i < 2 * C; ++i) acc[i] += w * load_half<T, C>(v + rows[j], i / 2, i % 2);
  }
  std::memcpy(acc_out, acc, sizeof acc);
}

}  // namespace
#endif  // __AVX512F__
