// Decode attention's scores in AMX tiles, for a bfloat16 cache (used by paged_decode.cpp).
//
// In the vector kernel a score costs a widened K row and a dot product per query head,
// and at a loaded server's batch that arithmetic, not the cache's bytes, set the pace
// (docs/benchmarks.md: "Decode attention in AMX tiles"). Here a tile of 16 tokens' K rows
// is loaded straight from the cache as the A operand (rows of 32 dims, the cache's row
// stride between tokens) and multiplied by the query, packed once per request as the B
// operand: the scores of 16 tokens for up to 16 query heads (whole GQA groups, each head's
// column zero outside its KV head's dims) in one fp32 tile, head_dim / 32 products per KV
// head. The online softmax then runs with a vector lane per query head, and the weighted
// sum of V rows stays in vectors: each widened V row serves the query heads of its group
// from registers. Accumulation is fp32 throughout, as in the vector kernel.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "amx.h"
#include "paged_decode.h"
#include "vec.h"

namespace {

// Query heads across the columns of a score tile: whole GQA groups, at most 16 heads.
struct ColumnTiles {
  int64_t group;        // query heads per KV head
  int64_t kv_per_tile;  // KV heads whose groups share a tile
  int64_t tiles;
  int64_t chunks;       // head_dim / 32: score products per KV head
  int64_t packed_elems(int64_t kv_heads) const { return kv_heads * chunks * 512; }
};

inline ColumnTiles column_tiles(const Shape& s) {
  const int64_t group = s.heads / s.kv_heads;
  const int64_t per = std::max<int64_t>(1, 16 / group);
  return {group, per, (s.kv_heads + per - 1) / per, s.dim / 32};
}

// Whether a call can take the tile path: a bf16 cache (checked by the caller), whole
// 32-dim chunks, 16-token tiles that never cross a block, groups of at most 16 heads.
inline bool amx_attention_fits(const Shape& s) {
  return amx_usable() && s.dim % 32 == 0 && s.block_size % 16 == 0 &&
         s.heads / s.kv_heads <= 16;
}

#ifdef STALLFREE_AMX

// The B operands for one request's query q [heads, dim] (bf16, unscaled, row stride
// `q_head`): per KV head and 32 dims a tile [16 dim pairs][16 columns][2], the columns
// those of the head's score tile.
inline void pack_query(const Shape& s, const ColumnTiles& ct, const c10::BFloat16* q,
                       int64_t q_head, uint16_t* out) {
  const auto* qs = reinterpret_cast<const uint16_t*>(q);
  std::memset(out, 0, ct.packed_elems(s.kv_heads) * sizeof(uint16_t));
  for (int64_t kv = 0; kv < s.kv_heads; ++kv) {
    for (int64_t c = 0; c < ct.chunks; ++c) {
      uint16_t* b = out + (kv * ct.chunks + c) * 512;
      for (int64_t g = 0; g < ct.group; ++g) {
        const int64_t col = kv % ct.kv_per_tile * ct.group + g;  // its column in its tile
        const uint16_t* qh = qs + (kv * ct.group + g) * q_head + c * 32;
        for (int pair = 0; pair < 16; ++pair) {
          b[(pair * 16 + col) * 2] = qh[2 * pair];
          b[(pair * 16 + col) * 2 + 1] = qh[2 * pair + 1];
        }
      }
    }
  }
}

// Lines of a tile ahead, asked for a few at a time between the work: a burst of all of
// them at once stalls the core until the line fill buffers drain.
constexpr int kTrickle = 4;  // lines asked for per V row weighed
struct Trickle {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t next = 0, lines = 0;
  inline void step(int n) {
    for (int i = 0; i < n && next < lines; ++i, ++next) {
      const char* base = (next & 1) ? v : k;
      _mm_prefetch(base + (next >> 1) * 64, _MM_HINT_T0);
    }
  }
};

// acc[h] = acc[h] * alpha[h] + sum_t p[t][h] v[t] for NH consecutive query heads of one KV
// head: `acc` their held outputs (C vectors each), `p` and `alpha` at their first column.
template <int C, int NH>
inline void weigh_values(const c10::BFloat16* v, int64_t row_len, int n, const float* p,
                         const float* alpha, float* acc, Trickle& pf) {
  vf a[NH][C];
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < C; ++c) a[h][c] = load16(acc + (h * C + c) * kLanes) * alpha[h];
  for (int t = 0; t < n; ++t) {
    pf.step(kTrickle);
    vf vr[C];
    load_row<c10::BFloat16, C>(v + t * row_len, vr);
    for (int h = 0; h < NH; ++h) {
      const float w = p[t * 16 + h];
      for (int c = 0; c < C; ++c) a[h][c] += w * vr[c];
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < C; ++c) store16(acc + (h * C + c) * kLanes, a[h][c]);
}

template <int C>
void weigh_group(const c10::BFloat16* v, int64_t row_len, int n, const float* p,
                 const float* alpha, float* acc, int64_t group, Trickle& pf) {
  constexpr int kMaxHeads = C >= 8 ? 2 : 4;  // accumulators and a V row stay in registers
  for (int64_t h = 0; h < group; h += kMaxHeads) {
    const int64_t nh = std::min<int64_t>(kMaxHeads, group - h);
    float* a = acc + h * C * kLanes;
    switch (nh) {
      case 1: weigh_values<C, 1>(v, row_len, n, p + h, alpha + h, a, pf); break;
      case 2: weigh_values<C, 2>(v, row_len, n, p + h, alpha + h, a, pf); break;
      case 3: weigh_values<C, 3>(v, row_len, n, p + h, alpha + h, a, pf); break;
      default: weigh_values<C, 4>(v, row_len, n, p + h, alpha + h, a, pf); break;
    }
  }
}

// The tokens of one work item against the packed query, into its softmax state (the same
// state and held order as the vector kernel's `attend`). Tiles must be configured. Tiles
// start at multiples of 16 tokens, so they never cross a block: an item that begins
// elsewhere (at a sliding window's first token) masks its first tile's leading tokens.
template <int C>
void attend_amx(const Shape& s, const ColumnTiles& ct, const uint16_t* qpack, float scale,
                const c10::BFloat16* k_cache, const c10::BFloat16* v_cache,
                const int64_t* table, const Item& item, const Partial& out) {
  const int64_t H = s.heads, bs = s.block_size, D = s.dim, row_len = s.kv_heads * D;
  std::fill(out.max, out.max + H, -std::numeric_limits<float>::infinity());
  std::fill(out.sum, out.sum + H, 0.f);
  std::fill(out.acc, out.acc + H * D, 0.f);
  const vf minus_inf = vf{} - std::numeric_limits<float>::infinity();
  alignas(64) float scores[16 * 16];
  alignas(64) float alpha[16];
  auto first_row = [&](int64_t t) {  // cache offset of token t's row
    const int64_t block = table[t / bs];
    TORCH_CHECK(block >= 0 && block < s.num_blocks, "block id ", block, " outside the cache");
    return (block * bs + t % bs) * row_len;
  };
  const int64_t tile_bytes = 16 * row_len * int64_t(sizeof(c10::BFloat16));
  const int64_t first = item.begin / 16 * 16;
  int64_t row = first_row(first);
  for (int64_t start = first; start < item.end; start += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, item.end - start));
    const int skip = static_cast<int>(std::max<int64_t>(0, item.begin - start));  // masked
    const int64_t next = start + 16 < item.end ? first_row(start + 16) : -1;
    // A tile's 16 rows are contiguous (one block holds them). The next tile was asked for
    // one tile ago (at the item's start, in a burst); the one after trickles in below.
    if (next >= 0 && start == first) {
      Trickle burst{reinterpret_cast<const char*>(k_cache + next),
                    reinterpret_cast<const char*>(v_cache + next), 0, 2 * tile_bytes / 64};
      burst.step(static_cast<int>(burst.lines));
    }
    Trickle pf;
    if (start + 32 < item.end) {
      const int64_t ahead = first_row(start + 32);
      pf = {reinterpret_cast<const char*>(k_cache + ahead),
            reinterpret_cast<const char*>(v_cache + ahead), 0, 2 * tile_bytes / 64};
    }
    const c10::BFloat16* k = k_cache + row;
    for (int64_t tile = 0; tile < ct.tiles; ++tile) {
      const int64_t kv0 = tile * ct.kv_per_tile;
      const int64_t kv1 = std::min(s.kv_heads, kv0 + ct.kv_per_tile);
      const int64_t h0 = kv0 * ct.group;
      const int cols = static_cast<int>((kv1 - kv0) * ct.group);
      _tile_zero(0);
      for (int64_t kv = kv0; kv < kv1; ++kv)
        for (int64_t c = 0; c < ct.chunks; ++c) {
          _tile_loadd(1, k + kv * D + c * 32, row_len * int64_t(sizeof(c10::BFloat16)));
          _tile_loadd(2, qpack + (kv * ct.chunks + c) * 512, 64);
          _tile_dpbf16ps(0, 1, 2);
        }
      _tile_stored(0, scores, 64);
      // Online softmax with a lane per query head; tokens past n (the tile's tail, rows of
      // whatever the block held) and before `skip` are masked out.
      vf srow[16];
      vf m_tile = minus_inf;
      for (int t = 0; t < 16; ++t) {
        srow[t] = t < n && t >= skip ? s.cap(load16(scores + t * 16) * scale) : minus_inf;
        m_tile = m_tile > srow[t] ? m_tile : srow[t];
      }
      const vf m_old = load_any(out.max + h0, cols);
      const vf m_new = m_old > m_tile ? m_old : m_tile;
      const vf a = exp_nonpositive(m_old - m_new);
      vf sum = load_any(out.sum + h0, cols) * a;
      for (int t = 0; t < n; ++t) {
        const vf p = t < skip ? vf{} : exp_nonpositive(srow[t] - m_new);
        sum += p;
        store16(scores + t * 16, p);
      }
      store_any(out.max + h0, m_new, cols);
      store_any(out.sum + h0, sum, cols);
      store16(alpha, a);
      for (int64_t kv = kv0; kv < kv1; ++kv) {
        const int64_t col = (kv - kv0) * ct.group;
        weigh_group<C>(v_cache + row + kv * D, row_len, n, scores + col, alpha + col,
                       out.acc + (h0 + col) * D, ct.group, pf);
      }
    }
    pf.step(static_cast<int>(pf.lines));  // whatever the work did not reach
    row = next;
  }
}

#endif  // STALLFREE_AMX

}  // namespace
