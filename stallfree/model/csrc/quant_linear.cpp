// x @ W.T from a weight that stays quantized in memory (CPU), in the panels of
// quant_panels.h: the quant rows of stallfree/model/quant_formats.py (made at load from a GGUF
// file's Q4_0, Q4_1, Q4_K, Q5_K, Q6_K or Q8_0 blocks, or from float weights as int8), 8 rows
// side by side. w = scale * q + min, with one float32 scale (and min) per group of 32 or 16.
//
// A decode step's matmuls have a few rows of x and must stream W once: the bytes of W set the
// time, and a 4-bit weight is a fifth of a float32 one. x is quantized per row to int8 in
// blocks of 32 (one float scale each), as llama.cpp's CPU dot products do, and a block's
// products are summed in integers: 4 values of x, broadcast, against the 8 rows' 4 bytes in
// each 32-bit lane (AVX-512 VNNI: vpdpbusd; AVX2: vpmaddubsw + vpmaddwd). With the rows in
// the lanes, a block ends in one vector of 8 rows' sums, scaled by one vector of their
// scales: no horizontal sums, and the float work is a fraction of the integer work. A
// group's min term is its min times the float sum of x over the group. Each pass over a
// panel serves up to 4 rows of x, and a row's result depends on its own row of x only,
// whatever the batch around it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "quant_panels.h"

namespace {

// x [M, K] quantized per row in blocks of 32: q int8 and one scale per block, and the float
// sums of x over every 16 and every 32 values (a group's min times its sum is the min term).
struct QuantizedX {
  std::vector<int8_t> q;
  std::vector<float> scale, sum16, sum32;
  std::vector<int32_t> qsum16;  // sums of q per 16 values
  int64_t blocks;  // per row

  QuantizedX(const float* x, int64_t rows, int64_t k)
      : q(rows * k), scale(rows * k / 32), sum16(rows * k / 16), sum32(rows * k / 32),
        qsum16(rows * k / 16), blocks(k / 32) {
    at::parallel_for(0, rows * blocks, 256, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const float* v = x + b * 32;
        float amax = 0.f, lo = 0.f, hi = 0.f;
        // A NaN in x makes the block's scale NaN, so it reaches the output as the float
        // kernels' would (std::max would drop it, and NaN cast to int8 is undefined).
        for (int i = 0; i < 32; ++i)
          if (!(std::fabs(v[i]) <= amax)) amax = std::fabs(v[i]);
        for (int i = 0; i < 16; ++i) lo += v[i];
        for (int i = 16; i < 32; ++i) hi += v[i];
        const float d = amax / 127.f, inv = d > 0.f && d == d ? 1.f / d : 0.f;
        int32_t qlo = 0, qhi = 0;
        for (int i = 0; i < 32; ++i) {
          q[b * 32 + i] = static_cast<int8_t>(std::nearbyint(v[i] * inv));
          (i < 16 ? qlo : qhi) += q[b * 32 + i];
        }
        qsum16[2 * b] = qlo;
        qsum16[2 * b + 1] = qhi;
        scale[b] = d;
        sum16[2 * b] = lo;
        sum16[2 * b + 1] = hi;
        sum32[b] = lo + hi;
      }
    });
  }

  const int8_t* block(int64_t row, int64_t b) const { return &q[(row * blocks + b) * 32]; }
  float block_scale(int64_t row, int64_t b) const { return scale[row * blocks + b]; }
};

// Products of a panel's 8 rows with rows m0.. of x: lanes are the panel's rows, so sums never
// cross lanes, and a block's integer sums are scaled once per block by the 8 rows' scales.
#if defined(__AVX2__)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr bool kVnni = true;  // vpdpbusd: unsigned weight bytes times signed x bytes
#else
constexpr bool kVnni = false;  // vpmaddubsw + vpmaddwd
#endif
constexpr int kTileX = 4;  // rows of x per pass over a panel

// The 8 rows' quants of quad j (values 4j..4j+3 of the block): 4-bit ones as unsigned bytes;
// 8-bit ones signed, or (for vpdpbusd, which wants the weight unsigned) offset by 128, the
// offset's products taken back through the x sums the accumulators start from.
template <int Bits>
inline __m256i quad(const uint8_t* quants, int j) {
  if constexpr (Bits == 4) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants + 32 * (j % 4)));
    const __m256i low = _mm256_set1_epi8(0x0f);
    return _mm256_and_si256(j < 4 ? v : _mm256_srli_epi16(v, 4), low);
  } else {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants + 32 * j));
    return kVnni ? _mm256_xor_si256(v, _mm256_set1_epi8(static_cast<char>(0x80))) : v;
  }
}

// acc + the 4-value dot products of each lane's w bytes with x's 4 bytes (in every lane).
template <int Bits>
inline __m256i dot4(__m256i acc, __m256i w, __m256i magnitude, __m256i x) {
  if constexpr (kVnni) {
    return _mm256_dpbusd_epi32(acc, w, x);
  } else {
    // vpmaddubsw wants one operand unsigned: |w| times x with w's sign (4-bit w is unsigned).
    const __m256i pairs = Bits == 4 ? _mm256_maddubs_epi16(w, x)
                                    : _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x, w));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
}

template <int Bits, int Group, bool HasMin, int MB>
void panel_dots(const uint8_t* panel, const QuantizedX& xq, int64_t m0, float* out) {
  constexpr Format f{Bits, Group, HasMin};
  constexpr int kHalves = Group == 16 ? 2 : 1;
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < xq.blocks; ++b) {
    const uint8_t* block = panel + b * f.block_bytes();
    const float* scales = reinterpret_cast<const float*>(block + f.quant_bytes());
    __m256i sums[MB][kHalves];
    for (int m = 0; m < MB; ++m)
      for (int h = 0; h < kHalves; ++h) {
        const int32_t* q = &xq.qsum16[((m0 + m) * xq.blocks + b) * 2];
        const int32_t offset = kHalves == 2 ? q[h] : q[0] + q[1];
        sums[m][h] = Bits == 8 && kVnni ? _mm256_set1_epi32(-128 * offset) : _mm256_setzero_si256();
      }
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m256i w = quad<Bits>(block, j);
      const __m256i magnitude = Bits == 8 && !kVnni ? _mm256_abs_epi8(w) : w;
      for (int m = 0; m < MB; ++m) {
        int32_t x4;
        std::memcpy(&x4, xq.block(m0 + m, b) + 4 * j, 4);
        sums[m][j / (8 / kHalves)] =
            dot4<Bits>(sums[m][j / (8 / kHalves)], w, magnitude, _mm256_set1_epi32(x4));
      }
    }
    for (int m = 0; m < MB; ++m) {
      const __m256 xs = _mm256_set1_ps(xq.block_scale(m0 + m, b));
      for (int h = 0; h < kHalves; ++h) {
        const __m256 ws = _mm256_mul_ps(_mm256_loadu_ps(scales + 8 * h), xs);
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[m][h]), ws, acc[m]);
        if constexpr (HasMin) {
          const int64_t row = (m0 + m) * xq.blocks + b;
          const float x_sum = kHalves == 2 ? xq.sum16[2 * row + h] : xq.sum32[row];
          acc[m] = _mm256_fmadd_ps(_mm256_loadu_ps(scales + 8 * (kHalves + h)),
                                   _mm256_set1_ps(x_sum), acc[m]);
        }
      }
    }
  }
  for (int m = 0; m < MB; ++m) _mm256_storeu_ps(out + m * kPanelRows, acc[m]);
}
#else
constexpr int kTileX = 1;

// The portable path: the same sums in scalars.
template <int Bits, int Group, bool HasMin, int MB>
void panel_dots(const uint8_t* panel, const QuantizedX& xq, int64_t m0, float* out) {
  constexpr Format f{Bits, Group, HasMin};
  for (int r = 0; r < kPanelRows; ++r) {
    float total = 0.f;
    for (int64_t b = 0; b < xq.blocks; ++b) {
      const uint8_t* block = panel + b * f.block_bytes();
      const float* scales = reinterpret_cast<const float*>(block + f.quant_bytes());
      const int8_t* x = xq.block(m0, b);
      for (int g = 0; g < 32 / Group; ++g) {
        int32_t sum = 0;
        for (int i = g * Group; i < (g + 1) * Group; ++i) {
          const int quad = i / 4, at = (Bits == 4 ? quad % 4 : quad) * 32 + r * 4 + i % 4;
          const int q = Bits == 8 ? static_cast<int8_t>(block[at])
                                  : (quad < 4 ? block[at] : block[at] >> 4) & 0x0f;
          sum += q * x[i];
        }
        total += scales[g * kPanelRows + r] * xq.block_scale(m0, b) * sum;
        if (HasMin) {
          const int64_t row = m0 * xq.blocks + b;
          total += scales[(32 / Group + g) * kPanelRows + r] *
                   (Group == 16 ? xq.sum16[2 * row + g] : xq.sum32[row]);
        }
      }
    }
    out[r] = total;
  }
}
#endif

// panel_dots for mb <= MB rows of x (the last pass over a panel).
template <int Bits, int Group, bool HasMin, int MB = kTileX>
void edge_dots(int mb, const uint8_t* panel, const QuantizedX& xq, int64_t m0, float* out) {
  if constexpr (MB > 1)
    if (mb < MB) return edge_dots<Bits, Group, HasMin, MB - 1>(mb, panel, xq, m0, out);
  panel_dots<Bits, Group, HasMin, MB>(panel, xq, m0, out);
}

// Panels ahead of the one in use asked into L2: a thread walks its panels in one sequential
// run, but at one row of x it computes too little per byte for the hardware prefetcher alone
// to keep the memory busy.
constexpr int64_t kPrefetchPanels = 2;

inline void prefetch(const uint8_t* p, int64_t bytes) {
  for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(p + at, 0, 2);
}

// out [M, ld] = x @ W.T from W's panels; gated: out column c is silu(row c) * row (c + ld),
// the up rows starting at panel ld / 8 (ld a multiple of 8).
template <int Bits, int Group, bool HasMin>
void matmul(const uint8_t* panels, int64_t k, const QuantizedX& xq, int64_t rows, int64_t ld,
            bool gated, float* out) {
  constexpr Format f{Bits, Group, HasMin};
  const int64_t bytes = f.panel_bytes(k), count = panels_of(ld), up = gated ? ld / kPanelRows : 0;
  at::parallel_for(0, count, 1, [&](int64_t p0, int64_t p1) {
    float sums[kTileX * kPanelRows], ups[kTileX * kPanelRows];
    for (int64_t p = p0; p < p1; ++p) {
      if (p + kPrefetchPanels < p1) {
        prefetch(panels + (p + kPrefetchPanels) * bytes, bytes);
        if (gated) prefetch(panels + (p + kPrefetchPanels + up) * bytes, bytes);
      }
      const int64_t c = p * kPanelRows;
      const int64_t width = std::min<int64_t>(kPanelRows, ld - c);
      for (int64_t m0 = 0; m0 < rows; m0 += kTileX) {
        const int mb = static_cast<int>(std::min<int64_t>(kTileX, rows - m0));
        edge_dots<Bits, Group, HasMin>(mb, panels + p * bytes, xq, m0, sums);
        if (gated) edge_dots<Bits, Group, HasMin>(mb, panels + (p + up) * bytes, xq, m0, ups);
        for (int m = 0; m < mb; ++m)
          for (int64_t r = 0; r < width; ++r) {
            float v = sums[m * kPanelRows + r];
            if (gated) v = v / (1.f + std::exp(-v)) * ups[m * kPanelRows + r];
            out[(m0 + m) * ld + c + r] = v;
          }
      }
    }
  });
}

using Matmul = void (*)(const uint8_t*, int64_t, const QuantizedX&, int64_t, int64_t, bool,
                        float*);

Matmul matmul_for(int64_t code) {
  switch (code) {
#define STALLFREE_MATMUL_CASE(c, bits, group, has_min) \
  case c:                                              \
    return matmul<bits, group, has_min>;
    STALLFREE_QUANT_FORMATS(STALLFREE_MATMUL_CASE)
#undef STALLFREE_MATMUL_CASE
  }
  TORCH_CHECK(false, "quant_linear: unknown format code ", code);
  return nullptr;
}

at::Tensor run(const at::Tensor& x_in, const at::Tensor& w, int64_t n, int64_t k,
               int64_t code, bool gated) {
  const Format f = format_of(code);
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == k && k > 0 && k % 32 == 0,
              "quant_linear: x [M, K] with K = ", k, " a positive multiple of 32 expected, got ",
              x_in.sizes());
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.dim() == 2 &&
                  w.size(0) == panels_of(n) && w.size(1) == f.panel_bytes(k),
              "quant_linear: the panels of ", n, " rows (", panels_of(n), " x ",
              f.panel_bytes(k), " bytes, quant_pack_panels) expected, got ", w.sizes());
  TORCH_CHECK(!gated || n % (2 * kPanelRows) == 0,
              "quant_linear_silu_mul: n must be a multiple of 16, got ", n);
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t rows = x.size(0), ld = gated ? n / 2 : n;
  at::Tensor out = at::empty({rows, ld}, x.options());
  if (rows > 0 && ld > 0) {
    const QuantizedX xq(x.data_ptr<float>(), rows, k);
    matmul_for(code)(w.data_ptr<uint8_t>(), k, xq, rows, ld, gated, out.data_ptr<float>());
  }
  return x_in.scalar_type() == at::kFloat ? out : out.to(x_in.scalar_type());
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& w, int64_t n, int64_t k,
                        int64_t format) {
  return run(x, w, n, k, format, false);
}

// W = [gate; up] ([n, K] rows in panels): silu(x @ gate.T) * (x @ up.T), [M, n / 2].
at::Tensor quant_linear_silu_mul(const at::Tensor& x, const at::Tensor& w, int64_t n, int64_t k,
                                 int64_t format) {
  return run(x, w, n, k, format, true);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(stallfree, m) {
  m.def("quant_linear(Tensor x, Tensor w, int n, int k, int format) -> Tensor");
  m.def("quant_linear_silu_mul(Tensor x, Tensor w, int n, int k, int format) -> Tensor");
}

TORCH_LIBRARY_IMPL(stallfree, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_linear_silu_mul", &quant_linear_silu_mul);
}
