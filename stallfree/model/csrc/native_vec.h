// float vectors of the build's register width (one zmm, or one ymm in AVX2 builds), for the
// float32 kernels' inner loops (f32_linear.cpp, paged_prefill_f32.h, argmax_rows.cpp). GCC 12
// keeps vec.h's 64-byte `vf` values in memory where the target has no 64-byte registers
// (paged_decode_halves.h), so loops that must stay in registers on AVX2 use these instead.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace {

#ifdef __AVX512F__
typedef float vn __attribute__((vector_size(64)));
typedef int32_t vni __attribute__((vector_size(64)));
#else
typedef float vn __attribute__((vector_size(32)));
typedef int32_t vni __attribute__((vector_size(32)));
#endif
constexpr int kWidth = sizeof(vn) / sizeof(float);  // lanes per register

// s in every lane: vn{} + s costs an add (0 + -0 is +0), and GCC builds a lane-by-lane
// splat loop one masked broadcast per lane.
inline vn splat(float s) {
#if defined(__AVX512F__)
  return (vn)_mm512_set1_ps(s);
#elif defined(__AVX__)
  return (vn)_mm256_set1_ps(s);
#else
  return vn{} + s;  // a CPU without AVX: correct, if slower
#endif
}

// kWidth floats from / to an unaligned address.
inline vn load_vn(const float* p) {
  vn v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store_vn(float* p, vn v) { std::memcpy(p, &v, sizeof v); }

}  // namespace
