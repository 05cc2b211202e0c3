// Prefill attention over the paged KV cache in AMX tiles (CPU, bfloat16 cache).
//
// A prefill chunk's queries attend causally to everything cached before them and to
// themselves. The torch path gathers the chunk's context into a dense buffer and runs SDPA
// with an explicit mask, which computes the masked half of the scores too; at a 512-token
// chunk it was the largest cost of a prefill after the matmuls (docs/benchmarks.md). Here
// each work item is 16 query positions of one query head against its keys in blocks of 32,
// flash-attention style, stopping at the last key its queries see:
//   scores^T [32 keys x 16 queries] = K [keys x dims] . Q^T: K rows loaded as tiles straight
//     from the cache (A operand), the item's queries packed once into pairs (B operand);
//   online softmax with a vector lane per query, keys down the rows;
//   out^T [dims x 16 queries] += V^T . P^T: V^T comes from a per-call copy of the chunk's
//     values in pair-interleaved order (A operand, made once per chunk and KV head and
//     shared by every item of its GQA group), P^T from pairs of score rows (B operand).
// Accumulation is fp32; P is rounded to bf16 for its product, as torch's CPU flash
// attention does. Work items are taken from a shared counter, longest first, since causal
// items differ in cost up to the chunk's length.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "amx.h"
#include "vec.h"

namespace {

constexpr int64_t kQueries = 16;  // query positions per item: the lanes of a score row
constexpr int64_t kKeys = 32;     // keys per step: one bf16 pair tile deep

struct Chunk {
  int64_t first_row, query_len, context_len;
  const int64_t* table;
  int64_t values;  // offset of its per-KV-head V^T copies in the scratch buffer
};

struct Layout {
  int64_t heads, kv_heads, dim, block_size, num_blocks, q_row, q_head;
  int64_t row_len() const { return kv_heads * dim; }
  int64_t steps(int64_t keys) const { return (keys + kKeys - 1) / kKeys; }
  int64_t values_per_head(int64_t keys) const { return steps(keys) * dim * kKeys; }
};

// Cache offset of token t's row in a chunk's table.
inline int64_t token_row(const Layout& l, const Chunk& c, int64_t t) {
  const int64_t block = c.table[t / l.block_size];
  TORCH_CHECK(block >= 0 && block < l.num_blocks, "block id ", block, " outside the cache");
  return (block * l.block_size + t % l.block_size) * l.row_len();
}

// One step's values of KV head kv as the A operand of V^T . P^T: for each dim d a row of
// 16 words, word k = (V[2k][d], V[2k+1][d]) of the step's 32 keys; keys past the context
// are zeros, so their (zero) weights never meet a NaN.
void copy_values(const Layout& l, const Chunk& c, const uint16_t* v_cache, int64_t kv,
                 int64_t step, uint32_t* out) {
  const int64_t t0 = step * kKeys;
  const uint16_t* rows[kKeys];
  for (int64_t t = 0; t < kKeys; ++t)
    rows[t] = t0 + t < c.context_len ? v_cache + token_row(l, c, t0 + t) + kv * l.dim : nullptr;
  for (int64_t d0 = 0; d0 < l.dim; d0 += 16) {
    vf w[16];  // [key pair][16 dims], then transposed to [dim][16 key pairs]
    for (int64_t k = 0; k < 16; ++k) {
      vu pair = {};
      for (int64_t j = 0; j < 2; ++j) {
        if (rows[2 * k + j] == nullptr) continue;
        vh h;
        std::memcpy(&h, rows[2 * k + j] + d0, sizeof h);
        pair |= __builtin_convertvector(h, vu) << (16 * j);
      }
      w[k] = reinterpret_cast<vf>(pair);
    }
    transpose16(w);
    std::memcpy(out + d0 * 16, w, sizeof w);
  }
}

#if defined(STALLFREE_AMX) && defined(__AVX512BF16__)
#define PREFILL_TILES 1

struct Item {
  int64_t chunk, head, tile, steps;
};

// Per-thread buffers of one item.
struct Scratch {
  explicit Scratch(int64_t dim) : qpack(dim / 32 * 256), out(dim * kQueries) {}
  std::vector<uint32_t> qpack;  // per 32 dims: [16 dim pairs][16 queries]
  std::vector<float> out;       // out^T [dim][16 queries], unnormalised
  alignas(64) float scores[kKeys * kQueries];
  alignas(64) uint32_t weights[kKeys / 2 * kQueries];  // P^T in pairs: [16 key pairs][16]
};

// Tile numbers are immediates. Tiles 0-3 hold up to four 16-dim slices of out^T; 4 and 5
// a step's scores; 6 the A operand (K rows, then V^T) and 7 the B operand (Q^T, then P^T).
enum SliceOp { kZero, kLoad, kStore, kMultiply };

// The _tile_ macros take their register's number as written in the source.
#define SLICE_OPS(I)                          \
  switch (op) {                               \
    case kZero: _tile_zero(I); break;         \
    case kLoad: _tile_loadd(I, p, 64); break; \
    case kStore: _tile_stored(I, p, 64); break; \
    default: _tile_dpbf16ps(I, 6, 7); break;  \
  }

inline void slice(int i, SliceOp op, void* p = nullptr) {
  switch (i) {
    case 0: SLICE_OPS(0); break;
    case 1: SLICE_OPS(1); break;
    case 2: SLICE_OPS(2); break;
    default: SLICE_OPS(3); break;
  }
}
#undef SLICE_OPS

// 2^y for finite y <= 0 (down to -1e29, which gives 0): y = n + f, |f| <= 1/2, a degree-5
// polynomial for 2^f (relative error ~2.4e-6, far below bf16's) and scalef for 2^n.
inline __m512 exp2_nonpositive(__m512 y) {
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 p = _mm512_set1_ps(1.3333558e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// Scores of masked keys: finite, so they give exactly 0 below with no NaN on the way.
constexpr float kMasked = -1e30f;
// The softmax's max moves only when a score passes it by this much (in log2 units): the
// weights then stay below 2^8, exact enough in fp32 sums and bf16 products, and the held
// output is rescaled a few times per item instead of at every step.
constexpr float kSlack = 8.f;

void attend_item(const Layout& l, const Chunk& c, const Item& it, const uint16_t* q,
                 const uint16_t* k_cache, const uint32_t* values, float scale,
                 c10::BFloat16* out, Scratch& s) {
  const int64_t D = l.dim, chunks = D / 32, slices = D / 16;
  const int64_t kv = it.head / (l.heads / l.kv_heads);
  const bool held = slices <= 4;  // out^T stays in tiles 0-3 across steps
  const int64_t q0 = it.tile * kQueries;
  const int64_t nq = std::min(kQueries, c.query_len - q0);
  const int64_t pos0 = c.context_len - c.query_len + q0;  // the first query's position
  const int64_t limit = pos0 + nq;                        // keys any of them sees
  // Q^T in pairs: word (r, query) of 32-dim chunk cc holds dims 32cc + 2r and 32cc + 2r + 1.
  for (int64_t cc = 0; cc < chunks; ++cc) {
    vf w[16] = {};
    for (int64_t i = 0; i < nq; ++i)
      std::memcpy(&w[i], q + (c.first_row + q0 + i) * l.q_row + it.head * l.q_head + cc * 32,
                  sizeof w[i]);
    transpose16(w);
    std::memcpy(s.qpack.data() + cc * 256, w, sizeof w);
  }
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  // Word q of a pair of weight rows: (row 2k, lane q) in its low half, (2k + 1, q) high.
  const __m512i interleave = _mm512_set_epi16(
      31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4,
      19, 3, 18, 2, 17, 1, 16, 0);
  const __m512 to_log2 = _mm512_set1_ps(scale * 1.44269504f);
  __m512 max = _mm512_set1_ps(kMasked);  // running max, in log2 units
  __m512 sum = _mm512_setzero_ps();
  if (held)
    for (int i = 0; i < slices; ++i) slice(i, kZero);
  else
    std::fill(s.out.begin(), s.out.end(), 0.f);
  const int64_t k_stride = l.row_len() * int64_t(sizeof(uint16_t));
  for (int64_t step = 0; step < it.steps; ++step) {
    const int64_t t0 = step * kKeys;
    // The step's two 16-key halves in tiles 4 and 5 (the second only where a query sees it).
    const bool second = t0 + 16 < limit;
    const uint16_t* k0 = k_cache + token_row(l, c, t0) + kv * D;
    const uint16_t* k1 = second ? k_cache + token_row(l, c, t0 + 16) + kv * D : nullptr;
    _tile_zero(4);
    _tile_zero(5);
    for (int64_t cc = 0; cc < chunks; ++cc) {
      _tile_loadd(7, s.qpack.data() + cc * 256, 64);
      _tile_loadd(6, k0 + cc * 32, k_stride);
      _tile_dpbf16ps(4, 6, 7);
      if (second) {
        _tile_loadd(6, k1 + cc * 32, k_stride);
        _tile_dpbf16ps(5, 6, 7);
      }
    }
    _tile_stored(4, s.scores, 64);
    if (second) _tile_stored(5, s.scores + 16 * kQueries, 64);
    // The step's max; on the diagonal (or past the last key) the hidden scores are masked
    // first: key t is hidden from query lane q when t > pos0 + q.
    __m512 step_max = _mm512_set1_ps(kMasked);
    const bool diagonal = t0 + kKeys - 1 > pos0;
    for (int64_t t = 0; t < kKeys; ++t) {
      float* row = s.scores + t * kQueries;
      __m512 x = _mm512_load_ps(row);
      if (diagonal) {
        const int64_t key = t0 + t;
        const int64_t hidden_below = key >= limit ? kQueries : std::max<int64_t>(0, key - pos0);
        const __mmask16 hide = _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(int(hidden_below)));
        x = _mm512_mask_mov_ps(x, hide, _mm512_set1_ps(kMasked));
        _mm512_store_ps(row, x);
      }
      step_max = _mm512_max_ps(step_max, x);
    }
    step_max = _mm512_mul_ps(step_max, to_log2);
    const __mmask16 moved =
        _mm512_cmp_ps_mask(step_max, _mm512_add_ps(max, _mm512_set1_ps(kSlack)), _CMP_GT_OQ);
    if (moved) {  // rescale what was accumulated under the old max
      const __m512 new_max = _mm512_mask_mov_ps(max, moved, step_max);
      const __m512 alpha = exp2_nonpositive(_mm512_sub_ps(max, new_max));
      sum = _mm512_mul_ps(sum, alpha);
      max = new_max;
      if (held)
        for (int i = 0; i < slices; ++i) slice(i, kStore, s.out.data() + i * 256);
      for (int64_t r = 0; r < D; ++r) {
        float* o = s.out.data() + r * kQueries;
        _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_loadu_ps(o), alpha));
      }
      if (held)
        for (int i = 0; i < slices; ++i) slice(i, kLoad, s.out.data() + i * 256);
    }
    // Weights 2^(score * scale * log2(e) - max), rounded to bf16 in pairs of rows for P^T.
    for (int64_t k = 0; k < kKeys / 2; ++k) {
      __m512 p[2];
      for (int j = 0; j < 2; ++j) {
        const __m512 x = _mm512_load_ps(s.scores + (2 * k + j) * kQueries);
        p[j] = exp2_nonpositive(_mm512_fmsub_ps(x, to_log2, max));
        sum = _mm512_add_ps(sum, p[j]);
      }
      const __m512i bf = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p[1], p[0]));
      _mm512_store_si512(s.weights + k * kQueries, _mm512_permutexvar_epi16(interleave, bf));
    }
    _tile_loadd(7, s.weights, 64);
    const uint32_t* v = values + step * D * 16;
    for (int64_t d0 = 0; d0 < D; d0 += 64) {  // four slices at a time
      const int n = static_cast<int>(std::min<int64_t>(4, (D - d0) / 16));
      for (int i = 0; i < n; ++i) {
        if (!held) slice(i, kLoad, s.out.data() + (d0 + 16 * i) * kQueries);
        _tile_loadd(6, v + (d0 + 16 * i) * 16, 64);
        slice(i, kMultiply);
        if (!held) slice(i, kStore, s.out.data() + (d0 + 16 * i) * kQueries);
      }
    }
  }
  if (held)
    for (int i = 0; i < slices; ++i) slice(i, kStore, s.out.data() + i * 256);
  const vf inv = reinterpret_cast<vf>(_mm512_div_ps(_mm512_set1_ps(1.f), sum));
  for (int64_t d0 = 0; d0 < D; d0 += 16) {
    vf rows[16];  // [dim][query], then [query][dim]
    for (int64_t r = 0; r < 16; ++r) rows[r] = load16(s.out.data() + (d0 + r) * kQueries) * inv;
    transpose16(rows);
    for (int64_t i = 0; i < nq; ++i)
      store16(out + ((c.first_row + q0 + i) * l.heads + it.head) * D + d0, rows[i]);
  }
}

#endif  // PREFILL_TILES

// q [T, Hq, D] bf16 (last dim contiguous; rows may be strided), kv_cache [2, num_blocks,
// block_size, Hkv, D] bf16 contiguous, with every chunk's own keys and values written.
// Chunk i owns the next query_lens[i] rows of q and sees context_lens[i] keys through
// block_tables[i]. Returns [T, Hq, D] bf16.
at::Tensor paged_prefill(const at::Tensor& q, const at::Tensor& kv_cache,
                         const at::Tensor& block_tables, const at::Tensor& query_lens,
                         const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.device().is_cpu() && kv_cache.device().is_cpu(), "paged_prefill runs on CPU");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.scalar_type() == at::kBFloat16,
              "paged_prefill: q must be bf16 [T, Hq, D] with contiguous rows of a head");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() &&
                  kv_cache.scalar_type() == at::kBFloat16,
              "paged_prefill: kv_cache must be a contiguous bf16 [2, blocks, bs, Hkv, D]");
  const Layout l{q.size(1), kv_cache.size(3), q.size(2), kv_cache.size(2), kv_cache.size(1),
                 q.stride(0), q.stride(1)};
  TORCH_CHECK(kv_cache.size(4) == l.dim && l.heads % l.kv_heads == 0,
              "paged_prefill: q and kv_cache disagree on head_dim or the GQA group");
  TORCH_CHECK(amx_usable() && l.dim % 32 == 0 && l.block_size % 16 == 0,
              "paged_prefill needs AMX, head_dim % 32 == 0 and block_size % 16 == 0");
  const int64_t n = query_lens.numel();
  TORCH_CHECK(query_lens.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong &&
                  query_lens.is_contiguous() && context_lens.is_contiguous() &&
                  context_lens.numel() == n,
              "paged_prefill: query_lens and context_lens must be contiguous int64 [chunks]");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == n &&
                  block_tables.scalar_type() == at::kLong && block_tables.is_contiguous(),
              "paged_prefill: block_tables must be a contiguous int64 [chunks, max_blocks]");
  std::vector<Chunk> chunks(n);
  int64_t rows = 0, values = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t ql = query_lens.data_ptr<int64_t>()[i];
    const int64_t ctx = context_lens.data_ptr<int64_t>()[i];
    TORCH_CHECK(ql >= 1 && ql <= ctx && ctx <= block_tables.size(1) * l.block_size,
                "paged_prefill: chunk ", i, " has query_len ", ql, " and context ", ctx,
                " (need 1 <= query_len <= context <= its block table's capacity)");
    chunks[i] = {rows, ql, ctx, block_tables.data_ptr<int64_t>() + i * block_tables.size(1),
                 values};
    rows += ql;
    values += l.kv_heads * l.values_per_head(ctx) / 2;
  }
  TORCH_CHECK(rows == q.size(0), "paged_prefill: query_lens sum to ", rows, ", q has ",
              q.size(0), " rows");
  at::Tensor out = at::empty({rows, l.heads, l.dim}, q.options());
#ifndef PREFILL_TILES
  TORCH_CHECK(false, "paged_prefill: built without AMX and AVX512_BF16");
#else
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<c10::BFloat16>());
  const auto* k_cache = reinterpret_cast<const uint16_t*>(kv_cache.data_ptr<c10::BFloat16>());
  const uint16_t* v_cache = k_cache + kv_cache.numel() / 2;
  // The values in pairs, per chunk, KV head and step of 32 keys; every word is written
  // below, so the buffer is not zeroed first.
  std::unique_ptr<uint32_t[]> pairs(new uint32_t[values]);
  std::vector<std::array<int64_t, 3>> copies;  // chunk, KV head, step
  for (int64_t i = 0; i < n; ++i)
    for (int64_t kv = 0; kv < l.kv_heads; ++kv)
      for (int64_t st = 0; st < l.steps(chunks[i].context_len); ++st) copies.push_back({i, kv, st});
  const int64_t words_per_step = l.dim * kKeys / 2;
  at::parallel_for(0, static_cast<int64_t>(copies.size()), 8, [&](int64_t a, int64_t b) {
    for (int64_t j = a; j < b; ++j) {
      const auto [i, kv, st] = copies[j];
      const Chunk& c = chunks[i];
      uint32_t* dst = pairs.get() + c.values +
                      (kv * l.steps(c.context_len) + st) * words_per_step;
      copy_values(l, c, v_cache, kv, st, dst);
    }
  });
  std::vector<Item> items;
  for (int64_t i = 0; i < n; ++i) {
    const Chunk& c = chunks[i];
    for (int64_t tile = 0; tile * kQueries < c.query_len; ++tile) {
      const int64_t seen = c.context_len - c.query_len +
                           std::min(c.query_len, (tile + 1) * kQueries);
      for (int64_t h = 0; h < l.heads; ++h) items.push_back({i, h, tile, l.steps(seen)});
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.steps > b.steps; });
  std::atomic<int64_t> next{0};
  const int64_t threads = std::max<int64_t>(
      1, std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(items.size())));
  auto* op = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    Scratch scratch(l.dim);
    configure_tiles();
    for (int64_t j; (j = next.fetch_add(1)) < static_cast<int64_t>(items.size());) {
      const Item& it = items[j];
      const Chunk& c = chunks[it.chunk];
      const int64_t kv = it.head / (l.heads / l.kv_heads);
      attend_item(l, c, it, qp, k_cache,
                  pairs.get() + c.values + kv * l.values_per_head(c.context_len) / 2,
                  static_cast<float>(scale), op, scratch);
    }
    _tile_release();
  });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(stallfree, m) {
  m.def("paged_prefill(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor query_lens, "
        "Tensor context_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(stallfree, CPU, m) { m.impl("paged_prefill", &paged_prefill); }
