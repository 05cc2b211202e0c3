// x @ W.T from a weight that stays quantized in memory (CPU): the "quant rows" layouts of
// stallfree/model/quant_formats.py, made at load from a GGUF file's blocks (Q4_0, Q4_1, Q4_K,
// Q5_K, Q6_K, Q8_0) or from float weights (int8). Each row of W holds its quants (4-bit
// nibbles or int8), then one float32 scale per group of 16 or 32 values, then (where the
// format has them) one float32 min per group: w = scale * q + min.
//
// A decode step's matmuls have a few rows of x and must stream W once: the bytes of W set the
// time, and a 4-bit row is a fifth of a float32 one. The products run as llama.cpp's CPU dot
// products do: x is quantized per row to int8 in blocks of 32 (one float scale each), and a
// block's 32 products are summed in integers (AVX2: vpmaddubsw + vpmaddwd; AVX-512 VNNI:
// vpdpbusd), then scaled in float. The min term needs no integer work: a group's min times
// the group's sum of x, taken from x in float. A tile of W's rows meets a tile of x's rows,
// so each decoded block serves several rows of x: at a 512-row prefill chunk this took
// 0.62x the float32 kernel's time on a 2-core EPYC (AVX-512 VNNI), where dequantizing tiles
// of W for the float32 kernel took 1.3x (docs/benchmarks.md, "Quantized weights").
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>


namespace {

// The formats of quant_formats.py, by code.
struct Format {
  int bits, group;
  bool has_min;
};

Format format_of(int64_t code) {
  switch (code) {
    case 1: return {4, 32, true};    // q4_32
    case 2: return {8, 32, false};   // q8_32
    case 3: return {8, 32, true};    // q8_32m
    case 4: return {8, 16, false};   // q8_16
    case 5: return {8, 16, true};    // q8_16m
  }
  TORCH_CHECK(false, "quant_linear: unknown format code ", code);
  return {};
}

int64_t row_bytes(const Format& f, int64_t k) {
  return k * f.bits / 8 + 4 * (k / f.group) * (f.has_min ? 2 : 1);
}

// x [M, K] quantized per row in blocks of 32: q int8 and one scale per block, and the float
// sums of x over every 16 and every 32 values (a group's min times its sum is the min term).
struct QuantizedX {
  std::vector<int8_t> q;
  std::vector<float> scale, sum16, sum32;
  int64_t blocks;  // per row

  QuantizedX(const float* x, int64_t rows, int64_t k)
      : q(rows * k), scale(rows * k / 32), sum16(rows * k / 16), sum32(rows * k / 32),
        blocks(k / 32) {
    at::parallel_for(0, rows * blocks, 256, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const float* v = x + b * 32;
        float amax = 0.f, lo = 0.f, hi = 0.f;
        for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
        for (int i = 0; i < 16; ++i) lo += v[i];
        for (int i = 16; i < 32; ++i) hi += v[i];
        const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
        for (int i = 0; i < 32; ++i)
          q[b * 32 + i] = static_cast<int8_t>(std::nearbyint(v[i] * inv));
        scale[b] = d;
        sum16[2 * b] = lo;
        sum16[2 * b + 1] = hi;
        sum32[b] = lo + hi;
      }
    });
  }

  const int8_t* block(int64_t row, int64_t b) const { return &q[(row * blocks + b) * 32]; }
  float block_scale(int64_t row, int64_t b) const { return scale[row * blocks + b]; }
  const float* sums(int group, int64_t row) const {
    return group == 16 ? &sum16[row * 2 * blocks] : &sum32[row * blocks];
  }
};

float dot_floats(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float total = 0.f;
#if defined(__AVX2__)
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  total = _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
#endif
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}

// A weight row's quants, scales and mins.
template <int Bits, int Group>
struct Row {
  const uint8_t* q = nullptr;
  const float* scale = nullptr;
  const float* mins = nullptr;

  Row() = default;
  Row(const uint8_t* row, int64_t k)
      : q(row), scale(reinterpret_cast<const float*>(row + k * Bits / 8)),
        mins(scale + k / Group) {}

  int value(int64_t i) const {  // the portable path's and the tests' reading of one quant
    return Bits == 4 ? (q[i / 32 * 16 + i % 16] >> (i % 32 < 16 ? 0 : 4)) & 0x0f
                     : static_cast<int8_t>(q[i]);
  }
};

#if defined(__AVX2__)
// A tile is R rows of W against MB rows of x: W's blocks are decoded once for MB rows of x,
// x's once for R rows of W. AVX-512 VL gives 32 vector registers: 4 x 4 sums; AVX2's 16
// hold 2 x 4.
#if defined(__AVX512VL__)
constexpr int kTileW = 4;
#else
constexpr int kTileW = 2;
#endif
constexpr int kTileX = 4;

// 32 products of unsigned u and signed s summed to 8 int32 lanes, lane i holding values
// 4i..4i+3 (so lanes 0-3 are the block's first 16 values).
inline __m256i dot_u8_s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int Bits>
inline __m256i load_block(const uint8_t* q, int64_t b) {
  if constexpr (Bits == 4) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * b));
    const __m128i low = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), low),
                            _mm_and_si128(packed, low));
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * b));
  }
}

// out[r * MB + m] = row r of W . row m0 + m of x.
template <int Bits, int Group, bool HasMin, int R, int MB>
void tile_dots(const uint8_t* w, int64_t stride, int64_t k, const QuantizedX& xq, int64_t m0,
               float* out) {
  Row<Bits, Group> rows[R];
  for (int r = 0; r < R; ++r) rows[r] = Row<Bits, Group>(w + r * stride, k);
  __m256 acc[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < xq.blocks; ++b) {
    __m256i wv[R], uv[R];
    __m256 ws[R];
    for (int r = 0; r < R; ++r) {
      wv[r] = load_block<Bits>(rows[r].q, b);
      // Signed weights: |w| times x with w's sign, as the byte products want one operand
      // unsigned; 4-bit quants are unsigned already.
      uv[r] = Bits == 4 ? wv[r] : _mm256_sign_epi8(wv[r], wv[r]);
      const float* s = rows[r].scale;
      ws[r] = Group == 32 ? _mm256_set1_ps(s[b])
                          : _mm256_set_m128(_mm_set1_ps(s[2 * b + 1]), _mm_set1_ps(s[2 * b]));
    }
    for (int m = 0; m < MB; ++m) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.block(m0 + m, b)));
      const __m256 xs = _mm256_set1_ps(xq.block_scale(m0 + m, b));
      for (int r = 0; r < R; ++r) {
        const __m256i sx = Bits == 4 ? xv : _mm256_sign_epi8(xv, wv[r]);
        const __m256 dot = _mm256_cvtepi32_ps(dot_u8_s8(uv[r], sx));
        acc[r][m] = _mm256_fmadd_ps(dot, _mm256_mul_ps(ws[r], xs), acc[r][m]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m)
      out[r * MB + m] = hsum(acc[r][m]) +
          (HasMin ? dot_floats(rows[r].mins, xq.sums(Group, m0 + m), k / Group) : 0.f);
}
#else
constexpr int kTileW = 1;
constexpr int kTileX = 1;

// The portable path: one row of W against one of x, the same sums in scalars.
template <int Bits, int Group, bool HasMin, int R, int MB>
void tile_dots(const uint8_t* w, int64_t stride, int64_t k, const QuantizedX& xq, int64_t m0,
               float* out) {
  const Row<Bits, Group> row(w, k);
  float total = 0.f;
  for (int64_t b = 0; b < xq.blocks; ++b) {
    const int8_t* x = xq.block(m0, b);
    for (int half = 0; half < 2; ++half) {
      int32_t sum = 0;
      for (int i = 16 * half; i < 16 * half + 16; ++i) sum += row.value(32 * b + i) * x[i];
      total += row.scale[Group == 32 ? b : 2 * b + half] * xq.block_scale(m0, b) * sum;
    }
  }
  out[0] = total + (HasMin ? dot_floats(row.mins, xq.sums(Group, m0), k / Group) : 0.f);
}
#endif

// tile_dots for r <= R rows of W and mb <= MB rows of x (a tile at an edge).
template <int Bits, int Group, bool HasMin, int R = kTileW, int MB = kTileX>
void edge_dots(int r, int mb, const uint8_t* w, int64_t stride, int64_t k,
               const QuantizedX& xq, int64_t m0, float* out) {
  if constexpr (R > 1)
    if (r < R) return edge_dots<Bits, Group, HasMin, R - 1, MB>(r, mb, w, stride, k, xq, m0, out);
  if constexpr (MB > 1)
    if (mb < MB) return edge_dots<Bits, Group, HasMin, R, MB - 1>(r, mb, w, stride, k, xq, m0, out);
  tile_dots<Bits, Group, HasMin, R, MB>(w, stride, k, xq, m0, out);
}

// Tiles of W ahead of the one in use that are asked into L2: a tile's rows are short runs
// (432 bytes for a 4-bit row of 576 values), too short for the hardware prefetcher to reach
// the memory bandwidth on its own.
constexpr int64_t kPrefetchTiles = 4;

inline void prefetch(const uint8_t* p, int64_t bytes) {
  for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(p + at, 0, 2);
}

// out [M, ld] = x @ W.T (gated: out column c is silu(row c) * row (c + ld) of W). Threads
// take runs of W's row tiles; each walks all of x's rows for a tile while it is in L1.
template <int Bits, int Group, bool HasMin>
void matmul(const uint8_t* w, int64_t stride, int64_t k, const QuantizedX& xq, int64_t rows,
            int64_t ld, bool gated, float* out) {
  const int64_t tiles = (ld + kTileW - 1) / kTileW;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    float sums[kTileW * kTileX], up[kTileW * kTileX];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t c = t * kTileW;
      const int r = static_cast<int>(std::min<int64_t>(kTileW, ld - c));
      const int64_t ahead = c + kPrefetchTiles * kTileW;
      if (ahead < ld) {
        const int64_t bytes = std::min<int64_t>(kTileW, ld - ahead) * stride;
        prefetch(w + ahead * stride, bytes);
        if (gated) prefetch(w + (ahead + ld) * stride, bytes);
      }
      for (int64_t m0 = 0; m0 < rows; m0 += kTileX) {
        const int mb = static_cast<int>(std::min<int64_t>(kTileX, rows - m0));
        edge_dots<Bits, Group, HasMin>(r, mb, w + c * stride, stride, k, xq, m0, sums);
        if (gated)
          edge_dots<Bits, Group, HasMin>(r, mb, w + (c + ld) * stride, stride, k, xq, m0, up);
        for (int i = 0; i < r; ++i)
          for (int m = 0; m < mb; ++m) {
            float v = sums[i * mb + m];
            if (gated) v = v / (1.f + std::exp(-v)) * up[i * mb + m];
            out[(m0 + m) * ld + c + i] = v;
          }
      }
    }
  });
}

using Matmul = void (*)(const uint8_t*, int64_t, int64_t, const QuantizedX&, int64_t, int64_t,
                        bool, float*);

Matmul matmul_for(int64_t code) {
  switch (code) {
    case 1: return matmul<4, 32, true>;
    case 2: return matmul<8, 32, false>;
    case 3: return matmul<8, 32, true>;
    case 4: return matmul<8, 16, false>;
    case 5: return matmul<8, 16, true>;
  }
  TORCH_CHECK(false, "quant_linear: unknown format code ", code);
  return nullptr;
}

at::Tensor run(const at::Tensor& x_in, const at::Tensor& w, int64_t n, int64_t k,
               int64_t code, bool gated) {
  const Format f = format_of(code);
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == k && k % 32 == 0,
              "quant_linear: x [M, K] with K = ", k, " a multiple of 32 expected, got ",
              x_in.sizes());
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.dim() == 2 &&
                  w.size(0) == n && w.size(1) == row_bytes(f, k),
              "quant_linear: uint8 rows [", n, ", ", row_bytes(f, k), "] expected, got ",
              w.sizes());
  TORCH_CHECK(!gated || n % 2 == 0, "quant_linear_silu_mul: n must be even, got ", n);
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t rows = x.size(0), ld = gated ? n / 2 : n;
  at::Tensor out = at::empty({rows, ld}, x.options());
  if (rows > 0 && ld > 0) {
    const QuantizedX xq(x.data_ptr<float>(), rows, k);
    matmul_for(code)(w.data_ptr<uint8_t>(), w.size(1), k, xq, rows, ld, gated,
                     out.data_ptr<float>());
  }
  return x_in.scalar_type() == at::kFloat ? out : out.to(x_in.scalar_type());
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& w, int64_t n, int64_t k,
                        int64_t format) {
  return run(x, w, n, k, format, false);
}

// W = [gate; up] ([n, K] rows): silu(x @ gate.T) * (x @ up.T), [M, n / 2].
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
