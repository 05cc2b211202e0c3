// x @ W.T for bfloat16 x and W in AMX tiles (CPU), at any number of rows of x; on CPUs
// with AVX512_BF16 but no AMX, from the same packing in vectors (pair_linear_vec.h).
//
// A decode step's matmuls have one row of x per running sequence: at 8-64 rows they must
// stream W once and do little arithmetic per byte, yet AVX-512 fp32 FMAs cannot keep up
// with the bytes past a few rows, and oneDNN's bf16 path read the weights at about half
// the bandwidth there (docs/benchmarks.md: "AMX matmuls"). AMX's tile multiply does a
// 16x16x32 block in one instruction, so the stream of W is the only cost up to ~64 rows.
//
// W is reordered once, at load (amx_pack), into the layout the tile multiply reads:
// blocks of 16 output columns, each a run of K/32 tiles of 1 KiB, a tile holding 16 pairs
// of k values for each of its 16 columns ([N/16][K/32][16][16][2]). A thread walks its
// share of column blocks two at a time against 16 or 32 rows of x: four fp32 accumulator
// tiles, two of x, two of W (all eight tile registers). W is read in one sequential run
// per thread. Up to 16 rows (one row tile) the hardware prefetcher streams it on its own:
// software prefetches of the next pair made those 1.15x slower. With two row tiles the
// next pair is prefetched into L2 while this one runs: without that, served runs of 32
// decodes beside the client process measured 436-463 output tok/s, with it 473-512
// (docs/benchmarks.md). Rows of x beyond 256 are taken in chunks so that they stay in L2
// while a pair of W blocks is reused from L1. Accumulation is fp32 and the result is
// rounded to bf16 once, as torch's bf16 matmul does.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>

#include "vec.h"

#include "amx.h"
#include "column_pairs.h"
#include "pair_linear_vec.h"

namespace {

constexpr int64_t kRowChunk = 256;     // rows of x kept in L2 per sweep over W

#ifdef __AVX512BF16__
// Rounding to bf16 in one instruction: to nearest even as round_bf16, but denormals flush
// to zero, far below any value the epilogue below meets.
inline vf round_fast(vf v) {
  const auto h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(reinterpret_cast<__m512>(v)));
  return reinterpret_cast<vf>(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline void store_fast(c10::BFloat16* p, vf v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(reinterpret_cast<__m512>(v))));
}
#else
inline vf round_fast(vf v) { return round_bf16(v); }
inline void store_fast(c10::BFloat16* p, vf v) { store16(p, v); }
#endif

// silu(gate) * up from `rows` rows of gate and up sums (rows `stride` floats apart),
// rounded where torch's unfused ops round (each product, the SiLU, the result), into `rows`
// rows of out.
void store_gated(const float* gate, const float* up, int64_t stride, int rows,
                 c10::BFloat16* out, int64_t ld) {
  for (int r = 0; r < rows; ++r) {
    const vf g = round_fast(load16(gate + r * stride));
    store_fast(out + r * ld, round_fast(silu(g)) * round_fast(load16(up + r * stride)));
  }
}


#ifdef STALLFREE_AMX

inline void store_acc(int tile_index, float* acc) {
  switch (tile_index) {  // tile numbers must be immediates
    case 0: _tile_stored(0, acc, 64); break;
    case 1: _tile_stored(1, acc, 64); break;
    case 2: _tile_stored(2, acc, 64); break;
    default: _tile_stored(3, acc, 64); break;
  }
}

// silu(gate) * up from a gate tile and its up tile.
void store_gated_tiles(int gate_tile, int rows, c10::BFloat16* out, int64_t ld) {
  alignas(64) float gate[16 * 16], up[16 * 16];
  store_acc(gate_tile, gate);
  store_acc(gate_tile + 1, up);
  store_gated(gate, up, 16, rows, out, ld);
}

// One accumulator tile (16 x 16 fp32) rounded to bf16 into `rows` rows of out.
void store_tile(int tile_index, int rows, c10::BFloat16* out, int64_t ld) {
  alignas(64) float acc[16 * 16];
  store_acc(tile_index, acc);
  for (int r = 0; r < rows; ++r) store16(out + r * ld, load16(acc + r * 16));
}

// 16 * RowTiles rows of x (row stride `lda` bytes) against one or two column blocks of W,
// whose tiles start at w0 and w1; the sums stay in tiles 0-1 (row tile 0) and 2-3.
template <int RowTiles, bool Two>
inline void block(const uint8_t* x, int64_t lda, const uint8_t* w0, const uint8_t* w1,
                  int64_t k_tiles, const uint8_t* prefetch) {
  _tile_zero(0);
  if (Two) _tile_zero(1);
  if (RowTiles == 2) _tile_zero(2);
  if (RowTiles == 2 && Two) _tile_zero(3);
  for (int64_t kb = 0; kb < k_tiles; ++kb) {
    if (prefetch != nullptr) {
      const char* p = reinterpret_cast<const char*>(prefetch + kb * 2 * kTileBytes);
      for (int line = 0; line < 2 * kTileBytes; line += 64) _mm_prefetch(p + line, _MM_HINT_T1);
    }
    _tile_loadd(4, x + kb * 64, lda);
    if (RowTiles == 2) _tile_loadd(5, x + 16 * lda + kb * 64, lda);
    _tile_loadd(6, w0 + kb * kTileBytes, 64);
    if (Two) _tile_loadd(7, w1 + kb * kTileBytes, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (Two) _tile_dpbf16ps(1, 4, 7);
    if (RowTiles == 2) _tile_dpbf16ps(2, 5, 6);
    if (RowTiles == 2 && Two) _tile_dpbf16ps(3, 5, 7);
  }
}

// Column blocks [col_begin, col_end) against rows [row_begin, row_end). Gated: the blocks
// alternate gate and up (amx_pack of a `gated` weight), and each pair's silu(gate) * up
// goes to out's column block c / 2 (out has n / 2 columns).
template <int RowTiles>
void column_blocks(const uint8_t* x, int64_t rows, int64_t lda, const uint8_t* w,
                   int64_t k_tiles, int64_t col_begin, int64_t col_end, int64_t row_begin,
                   int64_t row_end, c10::BFloat16* out, int64_t n, bool gated) {
  const int64_t block_bytes = k_tiles * kTileBytes;
  const int64_t ld = gated ? n / 2 : n;
  for (int64_t c = col_begin; c < col_end; c += 2) {
    const bool two = c + 1 < col_end;
    const uint8_t* w0 = w + c * block_bytes;
    for (int64_t r0 = row_begin; r0 < row_end; r0 += 16 * RowTiles) {
      // Two row tiles: the next pair, on the first sweep only (later row groups reuse this).
      const uint8_t* next = RowTiles == 2 && r0 == row_begin && c + 2 < col_end
                                ? w0 + 2 * block_bytes
                                : nullptr;
      const uint8_t* xr = x + r0 * lda;
      if (two)
        block<RowTiles, true>(xr, lda, w0, w0 + block_bytes, k_tiles, next);
      else
        block<RowTiles, false>(xr, lda, w0, nullptr, k_tiles, next);
      const int valid0 = static_cast<int>(std::min<int64_t>(16, rows - r0));
      const int valid1 = static_cast<int>(std::min<int64_t>(16, rows - r0 - 16));
      if (gated) {
        c10::BFloat16* o = out + r0 * ld + c / 2 * 16;
        store_gated_tiles(0, valid0, o, ld);
        if (RowTiles == 2 && valid1 > 0) store_gated_tiles(2, valid1, o + 16 * ld, ld);
        continue;
      }
      c10::BFloat16* o = out + r0 * ld + c * 16;
      store_tile(0, valid0, o, ld);
      if (two) store_tile(1, valid0, o + 16, ld);
      if (RowTiles == 2 && valid1 > 0) {
        store_tile(2, valid1, o + 16 * ld, ld);
        if (two) store_tile(3, valid1, o + 16 * ld + 16, ld);
      }
    }
  }
}

#endif  // STALLFREE_AMX

void check_weight(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16,
              "amx_pack: a 2-d bfloat16 weight expected, got ", w.sizes(), " ", w.scalar_type());
  TORCH_CHECK(w.size(0) % 16 == 0 && w.size(1) % 32 == 0,
              "amx_pack: weight rows must be a multiple of 16 and columns of 32, got ",
              w.sizes());
}

// W [N, K] -> [N/16][K/32][16 k-pairs][16 columns][2], the tile multiply's B operand.
at::Tensor amx_pack(const at::Tensor& weight) {
  check_weight(weight);
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), k_tiles = k / 32;
  at::Tensor out = at::empty({n * k}, w.options());
  const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, n / 16, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb)
      for (int64_t kb = 0; kb < k_tiles; ++kb) {
        uint16_t* tile = dst + (nb * k_tiles + kb) * 512;
        for (int pair = 0; pair < 16; ++pair)
          for (int col = 0; col < 16; ++col)
            for (int e = 0; e < 2; ++e)
              tile[(pair * 16 + col) * 2 + e] = src[(nb * 16 + col) * k + kb * 32 + 2 * pair + e];
      }
  });
  return out;
}

#ifdef PAIR_LINEAR_VEC
// The packing's products in vectors (pair_linear_vec.h).
void vector_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, bool gated,
                   at::Tensor& out) {
  const int64_t rows = x.size(0), k = x.size(1), col_blocks = n / 16;
  const int64_t ld = gated ? n / 2 : n;
  const auto* xa = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wa = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  auto* oa = out.data_ptr<c10::BFloat16>();
  const auto store = [&](int64_t r0, int count, int64_t c, const float* acc, bool two) {
    if (gated) {
      store_gated(acc, acc + 16, 32, count, oa + r0 * ld + c / 2 * 16, ld);
      return;
    }
    for (int r = 0; r < count; ++r) {
      c10::BFloat16* o = oa + (r0 + r) * ld + c * 16;
      store16(o, load16(acc + r * 32));
      if (two) store16(o + 16, load16(acc + r * 32 + 16));
    }
  };
  by_column_pairs(col_blocks, [&](int64_t c0, int64_t c1) {
    pair_linear_vec(xa, rows, k, wa, k / 2, c0, c1, store);
  });
}
#endif

at::Tensor run_linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t n, bool gated,
                      bool tiles) {
#ifndef PAIR_LINEAR_VEC
  TORCH_CHECK(tiles && amx_usable(),
              "amx_linear: this CPU or build has neither AMX (or tiles=False) nor AVX512_BF16");
#endif
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16 &&
                  packed.scalar_type() == at::kBFloat16,
              "amx_linear: bfloat16 x [M, K] and packed weight expected");
  const int64_t rows = x_in.size(0), k = x_in.size(1);
  TORCH_CHECK(k % 32 == 0 && n % 16 == 0 && packed.numel() == n * k,
              "amx_linear: packed weight of ", packed.numel(), " values does not fit x ",
              x_in.sizes(), " and n = ", n);
  TORCH_CHECK(!gated || n % 32 == 0, "amx_linear_silu_mul: n must be a multiple of 32, got ", n);
  at::Tensor out = at::empty({rows, gated ? n / 2 : n}, x_in.options());
  if (rows == 0) return out;
  if (!tiles || !amx_usable()) {
#ifdef PAIR_LINEAR_VEC
    vector_linear(x_in.contiguous(), packed, n, gated, out);
#endif
    return out;
  }
#ifdef STALLFREE_AMX
  // Below 32 rows (a decode step's sequences) the tiles are configured for the rows there
  // are; from 32, rows are padded to whole pairs of row tiles with zeros, so every tile
  // load reads real memory. The copy cost ~5 us a call: 10% of a batch-1 decode step.
  const int64_t row_tiles = rows <= 16 ? 1 : 2;
  const int first_rows = static_cast<int>(std::min<int64_t>(16, rows));
  const int second_rows = rows > 16 && rows < 32 ? static_cast<int>(rows - 16) : 16;
  const int64_t padded = rows < 32 ? rows : (rows + 31) / 32 * 32;
  at::Tensor x = x_in.contiguous();
  if (padded != rows) {
    at::Tensor p = at::zeros({padded, k}, x.options());
    p.narrow(0, 0, rows).copy_(x);
    x = p;
  }
  const auto* xa = reinterpret_cast<const uint8_t*>(x.data_ptr());
  const auto* wa = reinterpret_cast<const uint8_t*>(packed.data_ptr());
  auto* oa = out.data_ptr<c10::BFloat16>();
  const int64_t k_tiles = k / 32, col_blocks = n / 16, lda = k * 2;
  by_column_pairs(col_blocks, [&](int64_t c0, int64_t c1) {
    configure_tiles(first_rows, second_rows);
    for (int64_t r = 0; r < padded; r += kRowChunk) {
      const int64_t r_end = std::min(padded, r + kRowChunk);
      if (row_tiles == 1)
        column_blocks<1>(xa, rows, lda, wa, k_tiles, c0, c1, r, r_end, oa, n, gated);
      else
        column_blocks<2>(xa, rows, lda, wa, k_tiles, c0, c1, r, r_end, oa, n, gated);
    }
    _tile_release();
  });
#endif
  return out;
}

// `tiles`: in AMX tiles where the CPU allows (else in AVX512_BF16 vectors).
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, bool tiles) {
  return run_linear(x, packed, n, false, tiles);
}

// x @ W.T for W = [gate; up] ([n, K], packed with its 16-row blocks of gate and up
// alternating), then silu(gate) * up: [M, n / 2], the gate and up products never stored.
at::Tensor amx_linear_silu_mul(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                               bool tiles) {
  return run_linear(x, packed, n, true, tiles);
}

}  // namespace

// Whether the kernels' AVX512_BF16 paths were compiled in (the compiler knew this CPU's
// flag): asked by the Python side before it counts on them.
bool bf16_vectors_built() {
#ifdef __AVX512BF16__
  return true;
#else
  return false;
#endif
}

TORCH_LIBRARY_FRAGMENT(stallfree, m) {
  m.def("amx_usable() -> bool", &amx_usable);
  m.def("bf16_vectors_built() -> bool", &bf16_vectors_built);
  m.def("amx_pack(Tensor weight) -> Tensor");
  m.def("amx_linear(Tensor x, Tensor packed, int n, bool tiles=True) -> Tensor");
  m.def("amx_linear_silu_mul(Tensor x, Tensor packed, int n, bool tiles=True) -> Tensor");
}

TORCH_LIBRARY_IMPL(stallfree, CPU, m) {
  m.impl("amx_pack", &amx_pack);
  m.impl("amx_linear", &amx_linear);
  m.impl("amx_linear_silu_mul", &amx_linear_silu_mul);
}
