// The prefill kernel's two products in AVX512_BF16 vectors, for CPUs without AMX (see
// paged_prefill.h). Each instruction multiplies 16 pairs of bf16 (one per query lane) by
// one pair broadcast from memory and adds them to 16 fp32 sums, so both products read the
// same packed operands as the tiles: K rows straight from the cache (a pair of dims
// broadcast), Q^T and P^T in pairs (one vector per pair row), V^T in pairs (broadcast).
// out^T lives in Scratch::out; 16 rows of it at a time are held in registers.
#pragma once

#include "bf16_pairs.h"
#include "paged_prefill.h"

#ifdef PREFILL_KERNEL

namespace {

struct VectorProducts {
  int64_t dim;

  void begin(Scratch& s) { std::fill(s.out.begin(), s.out.end(), 0.f); }

  // 16 keys' rows (k_stride apart) against every query: row t of `scores`, lane q.
  void half(const uint16_t* k, int64_t k_stride, const Scratch& s, float* scores) const {
    __m512 acc[16];
    for (auto& a : acc) a = _mm512_setzero_ps();
    for (int64_t cc = 0; cc < dim / 32; ++cc)
      for (int64_t r = 0; r < 16; ++r) {
        const __m512bh qr = (__m512bh)_mm512_loadu_si512(s.qpack.data() + cc * 256 + r * 16);
        const int64_t word = cc * 16 + r;
#pragma GCC unroll 16
        for (int t = 0; t < 16; ++t) {
          uint32_t pair;
          std::memcpy(&pair, k + t * k_stride + 2 * word, sizeof pair);
          acc[t] = dot_pair(acc[t], pair, qr);
        }
      }
    for (int t = 0; t < 16; ++t) _mm512_store_ps(scores + t * kQueries, acc[t]);
  }

  void scores(const uint16_t* k0, const uint16_t* k1, int64_t k_stride, Scratch& s) {
    half(k0, k_stride, s, s.scores);
    if (k1 != nullptr) half(k1, k_stride, s, s.scores + 16 * kQueries);
  }

  void to_memory(Scratch&) {}
  void from_memory(Scratch&) {}

  void accumulate(const uint32_t* v, Scratch& s) {
    for (int64_t d0 = 0; d0 < dim; d0 += 16) {
      float* out = s.out.data() + d0 * kQueries;
      __m512 acc[16];
      for (int i = 0; i < 16; ++i) acc[i] = _mm512_loadu_ps(out + i * kQueries);
      for (int64_t k = 0; k < 16; ++k) {
        const __m512bh w = (__m512bh)_mm512_load_si512(s.weights + k * kQueries);
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) acc[i] = dot_pair(acc[i], v[(d0 + i) * 16 + k], w);
      }
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(out + i * kQueries, acc[i]);
    }
  }
};

}  // namespace

#endif  // PREFILL_KERNEL
