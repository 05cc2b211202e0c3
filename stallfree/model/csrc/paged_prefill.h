// Prefill attention over the paged KV cache (CPU): what its paths share, and the bf16 one.
//
// A prefill chunk's queries attend causally to everything cached before them and to
// themselves. The torch path gathers the chunk's context into a dense buffer and runs SDPA
// with an explicit mask, which computes the masked half of the scores too; at a 512-token
// chunk it was the largest cost of a prefill after the matmuls (docs/benchmarks.md). Here
// each work item is 16 query positions of one query head against its keys in steps of 32,
// flash-attention style, stopping at the last key its queries see:
//   scores^T [32 keys x 16 queries] = K [keys x dims] . Q^T: K rows read straight from the
//     cache, the item's queries packed once into pairs of dims;
//   online softmax with a vector lane per query, keys down the rows;
//   out^T [dims x 16 queries] += V^T . P^T: V^T comes from a per-call copy of the chunk's
//     values in pair-interleaved order (made once per chunk and KV head and shared by every
//     item of its GQA group), P^T from pairs of score rows.
// For a bfloat16 cache the two products run in AMX tiles (paged_prefill_tiles.h) or, on CPUs
// with AVX512_BF16 but no AMX, in vector dot products of bf16 pairs (paged_prefill_vec.h);
// both take the same packed operands. Accumulation is fp32; P is rounded to bf16 for its
// product, as torch's CPU flash attention does. A float32 cache takes paged_prefill_f32.h,
// with items and steps of its own sizes.
//
// With a sliding window (Mistral, Gemma's local layers) a query at position p sees only keys
// (p - window, p]: an item starts at the step holding the first key any of its queries sees,
// and masks, besides the causal diagonal, the keys below each query's window. Soft-capped
// scores (Gemma 2) are capped as they come out of the product, before the masks.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "paged_decode_softcap.h"
#include "vec.h"

namespace {

constexpr int64_t kQueries = 16;  // query positions per item: the lanes of a score row
constexpr int64_t kKeys = 32;     // keys per step: 16 pairs of bf16

struct Chunk {
  int64_t first_row, query_len, context_len;
  const int64_t* table;
  int64_t values;      // offset of its per-KV-head V^T copies in the scratch buffer
  int64_t first_step;  // the first step of kKeys keys any of its queries sees (window)
};

// One work item: query positions [tile * queries-per-item, ...) of chunk `chunk`, query head
// `head`, and the steps [first, steps) of keys its queries see.
struct Item {
  int64_t chunk, head, tile, first, steps;
};

struct Layout {
  int64_t heads, kv_heads, dim, block_size, num_blocks, q_row, q_head;
  int64_t window;  // > 0: the sliding window's length; 0: full causal attention
  SoftCap cap;
  int64_t extra = 0;  // elements after a row's dims: an int8 cache's scale (paged_int8.h)
  int64_t row_len() const { return kv_heads * (dim + extra); }
  int64_t steps(int64_t keys) const { return (keys + kKeys - 1) / kKeys; }
  // The first key a query at position `pos` sees.
  int64_t first_key(int64_t pos) const {
    return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
  }
  // The V^T copies of one KV head of chunk c: its steps from the first it sees.
  int64_t values_per_head(const Chunk& c) const {
    return (steps(c.context_len) - c.first_step) * dim * kKeys;
  }
  // Of the keys [key, ...) (as many as a register has query lanes), the lanes below which
  // the causal diagonal hides key `key` (queries at positions pos0 + lane; keys at or past
  // `limit` from every lane), and the lane from which the window hides it.
  int64_t hidden_below(int64_t key, int64_t pos0, int64_t limit, int64_t lanes) const {
    return key >= limit ? lanes : std::max<int64_t>(0, key - pos0);
  }
  int64_t hidden_from(int64_t key, int64_t pos0, int64_t lanes) const {
    return window > 0 ? std::clamp<int64_t>(key - pos0 + window, 0, lanes) : lanes;
  }
  // Whether a step of `keys` keys from t0 holds a key some lane must not see.
  bool masks(int64_t t0, int64_t keys, int64_t pos0, int64_t lanes) const {
    return t0 + keys - 1 > pos0 || (window > 0 && t0 - pos0 + window < lanes);
  }
};

// Cache offset of token t's row in a chunk's table.
inline int64_t token_row(const Layout& l, const Chunk& c, int64_t t) {
  const int64_t block = c.table[t / l.block_size];
  TORCH_CHECK(block >= 0 && block < l.num_blocks, "block id ", block, " outside the cache");
  return (block * l.block_size + t % l.block_size) * l.row_len();
}

// One step's values of KV head kv, packed for V^T . P^T: for each dim d a row of 16 words,
// word k = (V[2k][d], V[2k+1][d]) of the step's 32 keys; keys past the context are zeros,
// so their (zero) weights never meet a NaN.
inline void copy_values(const Layout& l, const Chunk& c, const uint16_t* v_cache, int64_t kv,
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

#if defined(__AVX512BF16__)
#define PREFILL_KERNEL 1
#include <immintrin.h>

// Per-thread buffers of one item.
struct Scratch {
  explicit Scratch(int64_t dim) : qpack(dim / 32 * 256), out(dim * kQueries) {}
  std::vector<uint32_t> qpack;  // per 32 dims: [16 dim pairs][16 queries]
  std::vector<float> out;       // out^T [dim][16 queries], unnormalised
  alignas(64) float scores[kKeys * kQueries];
  alignas(64) uint32_t weights[kKeys / 2 * kQueries];  // P^T in pairs: [16 key pairs][16]
};

// 2^y for finite y <= kSlack (a weight may exceed the max by that much; down to -1e29, which
// gives 0): y = n + f, |f| <= 1/2, a degree-5 polynomial for 2^f (relative error ~2.4e-6,
// far below bf16's) and scalef for 2^n.
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

// One item's attention. Products: the two matrix products (paged_prefill_tiles.h,
// paged_prefill_vec.h) and where they keep out^T between steps:
//   begin(s): out^T = 0;  scores(k0, k1, k_stride, s): s.scores = the step's two halves
//   (the second only where k1 is not null);  accumulate(values, s): out^T += V^T . P^T from
//   s.weights;  to_memory(s) / from_memory(s): out^T into s.out and back (around a rescale,
//   and to_memory at the end).
template <typename Products>
void attend_item(const Layout& l, const Chunk& c, const Item& it, const uint16_t* q,
                 const uint16_t* k_cache, const uint32_t* values, float scale,
                 c10::BFloat16* out, Scratch& s, Products& mma) {
  const int64_t D = l.dim, chunks = D / 32;
  const int64_t kv = it.head / (l.heads / l.kv_heads);
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
  const SoftCap cap = l.cap.unscaled(scale);  // the scores are held unscaled
  __m512 max = _mm512_set1_ps(kMasked);  // running max, in log2 units
  __m512 sum = _mm512_setzero_ps();
  mma.begin(s);
  const int64_t k_stride = l.row_len();
  for (int64_t step = it.first; step < it.steps; ++step) {
    const int64_t t0 = step * kKeys;
    // The step's second 16 keys only where a query sees them.
    const uint16_t* k0 = k_cache + token_row(l, c, t0) + kv * D;
    const uint16_t* k1 = t0 + 16 < limit ? k_cache + token_row(l, c, t0 + 16) + kv * D : nullptr;
    mma.scores(k0, k1, k_stride, s);
    // The step's max; on the diagonal (or past the last key) and at the window's lower edge
    // the hidden scores are masked first: key t is hidden from query lane q when
    // t > pos0 + q, or t <= pos0 + q - window. Capped scores are capped before.
    __m512 step_max = _mm512_set1_ps(kMasked);
    const bool masked = l.masks(t0, kKeys, pos0, kQueries);
    // The lanes each key is hidden from, whose weights are then set to exactly 0: a lane
    // that sees no key of a step (below its window) would otherwise weigh its masked scores
    // against a max taken from them, where the product's rounding is no longer negligible.
    __mmask16 hidden[kKeys];
    for (int64_t t = 0; t < kKeys; ++t) {
      float* row = s.scores + t * kQueries;
      __m512 x = _mm512_load_ps(row);
      if (cap.on()) x = reinterpret_cast<__m512>(cap(reinterpret_cast<vf>(x)));
      if (masked) {
        const int64_t key = t0 + t;
        hidden[t] =
            _mm512_cmplt_epi32_mask(
                lane, _mm512_set1_epi32(int(l.hidden_below(key, pos0, limit, kQueries)))) |
            _mm512_cmpge_epi32_mask(lane,
                                    _mm512_set1_epi32(int(l.hidden_from(key, pos0, kQueries))));
        x = _mm512_mask_mov_ps(x, hidden[t], _mm512_set1_ps(kMasked));
      }
      if (masked || cap.on()) _mm512_store_ps(row, x);
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
      mma.to_memory(s);
      for (int64_t r = 0; r < D; ++r) {
        float* o = s.out.data() + r * kQueries;
        _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_loadu_ps(o), alpha));
      }
      mma.from_memory(s);
    }
    // Weights 2^(score * scale * log2(e) - max), rounded to bf16 in pairs of rows for P^T.
    for (int64_t k = 0; k < kKeys / 2; ++k) {
      __m512 p[2];
      for (int j = 0; j < 2; ++j) {
        const __m512 x = _mm512_load_ps(s.scores + (2 * k + j) * kQueries);
        p[j] = exp2_nonpositive(_mm512_fmsub_ps(x, to_log2, max));
        if (masked) p[j] = _mm512_maskz_mov_ps(_knot_mask16(hidden[2 * k + j]), p[j]);
        sum = _mm512_add_ps(sum, p[j]);
      }
      const __m512i bf = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p[1], p[0]));
      _mm512_store_si512(s.weights + k * kQueries, _mm512_permutexvar_epi16(interleave, bf));
    }
    mma.accumulate(values + (step - c.first_step) * D * 16, s);
  }
  mma.to_memory(s);
  const vf inv = reinterpret_cast<vf>(_mm512_div_ps(_mm512_set1_ps(1.f), sum));
  for (int64_t d0 = 0; d0 < D; d0 += 16) {
    vf rows[16];  // [dim][query], then [query][dim]
    for (int64_t r = 0; r < 16; ++r) rows[r] = load16(s.out.data() + (d0 + r) * kQueries) * inv;
    transpose16(rows);
    for (int64_t i = 0; i < nq; ++i)
      store16(out + ((c.first_row + q0 + i) * l.heads + it.head) * D + d0, rows[i]);
  }
}

#endif  // PREFILL_KERNEL

}  // namespace
