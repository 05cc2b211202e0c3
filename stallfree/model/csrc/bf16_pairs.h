// The AVX512_BF16 dot product the vector paths build on: 16 fp32 lanes, each adding the
// two products of a pair of bf16 values with one pair broadcast from memory.
#pragma once

#ifdef __AVX512BF16__
#include <immintrin.h>

#include <cstdint>

namespace {

// acc + (pair.lo * lanes[i].lo + pair.hi * lanes[i].hi) in every lane i.
inline __m512 dot_pair(__m512 acc, uint32_t pair, __m512bh lanes) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(static_cast<int>(pair)), lanes);
}

}  // namespace

#endif
