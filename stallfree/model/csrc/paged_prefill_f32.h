// Prefill attention over a float32 cache (see paged_prefill.h), the float32 engine's: CPUs
// without fast bf16, where torch's SDPA took ~40% of a float32 prefill at 512-token chunks
// (docs/benchmarks.md). An item is one register's worth of query positions of one query
// head (16, or 8 in AVX2 builds), its keys taken in steps of 16. With the queries in
// the lanes, both products are rank-1 updates against one value broadcast from memory, so
// neither needs a horizontal sum nor K or V reordered:
//   scores^T[t] = sum_d K[t][d] * Q^T[d]   (K rows read in place from the cache; Q^T packed
//                                           once per item, already scaled)
//   out^T[d]   += V[t][d] * P^T[t]         (V rows read in place; out^T in the scratch, a
//                                           register's worth of dims at a time)
// The softmax is online, as in the bf16 paths (paged_prefill.h): its max moves only by more
// than kF32Slack, and masked keys weigh exactly 0. An int8 cache's rows (paged_int8.h) take
// the same loops, each step's rows dequantized first (Int8Rows).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "native_vec.h"
#include "paged_int8.h"
#include "paged_prefill.h"

namespace {

constexpr int64_t kF32Queries = kWidth;  // query positions per item: the lanes
// Keys per step: 16 in AVX2 builds too, where a step's softmax and its pass over out^T then
// cover twice the keys that 8 would. Their scores are summed 8 keys per pass over the dims,
// one accumulator each: the 8 row pointers fit the general registers, where with 16 the
// AVX-512 build parked them in vector registers and moved one out before each FMA (the
// passes of 8 took ~0.9x the time per layer).
constexpr int64_t kF32Keys = 16;
constexpr int64_t kPassKeys = 8;
constexpr float kF32Masked = -1e30f;     // a masked score, finite: no NaN on its way to 0
constexpr float kF32Slack = 5.f;         // how far a score may pass the max (e^5 ~ 148)

// e^x per lane (vec.h), exactly 0 where x is below its clamp (masked keys, a first step's
// rescale from the initial max).
inline vn exp_or_zero(vn x) { return x < splat(-87.f) ? vn{} : exp_nonpositive(x); }

struct F32Scratch {
  explicit F32Scratch(int64_t dim) : qt(dim * kF32Queries), out(dim * kF32Queries) {}
  std::vector<float> qt;   // Q^T [dim][queries], times the softmax scale
  std::vector<float> out;  // out^T [dim][queries], unnormalised
  alignas(64) float weights[kF32Keys * kF32Queries];  // P^T [key][queries]
};

// kPassKeys keys' scores^T: their K rows from k (row_len apart) against every query.
inline void pass_scores(const float* k, int64_t row_len, const F32Scratch& s, int64_t dim,
                        vn* scores) {
  vn acc[kPassKeys];
  for (int64_t t = 0; t < kPassKeys; ++t) acc[t] = vn{};
  for (int64_t d = 0; d < dim; ++d) {
    const vn qd = load_vn(s.qt.data() + d * kF32Queries);
#pragma GCC unroll 16
    for (int64_t t = 0; t < kPassKeys; ++t) acc[t] += splat(k[t * row_len + d]) * qd;
  }
  for (int64_t t = 0; t < kPassKeys; ++t) scores[t] = acc[t];
}

// out^T += V^T . P^T over the step's first `keys` keys (V rows from v, row_len apart).
inline void step_values(const float* v, int64_t row_len, int64_t keys, int64_t dim,
                        F32Scratch& s) {
  for (int64_t d0 = 0; d0 < dim; d0 += kWidth) {
    vn acc[kWidth];
    for (int64_t r = 0; r < kWidth; ++r) acc[r] = load_vn(s.out.data() + (d0 + r) * kF32Queries);
    for (int64_t t = 0; t < keys; ++t) {
      const vn p = load_vn(s.weights + t * kF32Queries);
      const float* row = v + t * row_len + d0;
#pragma GCC unroll 16
      for (int64_t r = 0; r < kWidth; ++r) acc[r] += splat(row[r]) * p;
    }
    for (int64_t r = 0; r < kWidth; ++r) store_vn(s.out.data() + (d0 + r) * kF32Queries, acc[r]);
  }
}

// Where a step's K and V rows come from, as float rows `stride` apart: keys(offset) the
// step's kF32Keys K rows, values(offset, n) its first n V rows, from cache offset `offset`.
// A float cache's are read in place.
struct F32Rows {
  const float* k;
  const float* v;
  int64_t stride;  // the cache's row length
  const float* keys(int64_t offset) const { return k + offset; }
  const float* values(int64_t offset, int64_t) const { return v + offset; }
};

// An int8 cache's (paged_int8.h) are dequantized into a buffer of the thread's first: the
// loops below then read the values a float cache holding s * q would give them, so over
// such a cache the two paths agree to the bit. Each item dequantizes its steps' rows again
// (the items of a GQA group and of a chunk's query tiles share them, as they share a float
// cache's rows from L2): a call took 1.05-1.2x the float cache's time at 64 dims (2-core
// EPYC, 512-token chunks after 1,536 and 0 cached tokens); prefill is bound by its
// products, not by the cache's bytes.
struct Int8Rows {
  Int8Rows(const int8_t* k, const int8_t* v, int64_t row_len, int64_t dim)
      : k(k), v(v), row_len(row_len), dim(dim), stride(dim), buf(2 * kF32Keys * dim) {}
  const int8_t* k;
  const int8_t* v;
  int64_t row_len, dim, stride;
  std::vector<float> buf;  // the step's K rows, then its V rows
  const float* keys(int64_t offset) {
    dequantize_rows(k + offset, row_len, kF32Keys, dim, buf.data());
    return buf.data();
  }
  const float* values(int64_t offset, int64_t n) {
    dequantize_rows(v + offset, row_len, n, dim, buf.data() + kF32Keys * dim);
    return buf.data() + kF32Keys * dim;
  }
};

// One item's attention into out [rows, heads, dim]. Keys past the context are read only for
// scores that are then masked (a step's rows lie in one block: block_size % 16 == 0),
// and never as values, so whatever the slots past it hold cannot reach the output. Not
// inlined: inlined into its thread's loop (as GCC 12 did once it was a template), the
// float32 path took 1.05-1.1x the time per call (2-core EPYC, 512-token chunks).
template <typename Rows>
__attribute__((noinline)) void attend_item_f32(const Layout& l, const Chunk& c, const Item& it,
                                               const float* q, Rows& cache, float scale,
                                               float* out, F32Scratch& s) {
  const int64_t D = l.dim, row_len = cache.stride;
  const int64_t kv = it.head / (l.heads / l.kv_heads);
  const int64_t q0 = it.tile * kF32Queries;
  const int64_t nq = std::min(kF32Queries, c.query_len - q0);
  const int64_t pos0 = c.context_len - c.query_len + q0;  // the first query's position
  const int64_t limit = pos0 + nq;                        // keys any of them sees
  std::fill(s.qt.begin(), s.qt.end(), 0.f);
  for (int64_t i = 0; i < nq; ++i) {
    const float* row = q + (c.first_row + q0 + i) * l.q_row + it.head * l.q_head;
    for (int64_t d = 0; d < D; ++d) s.qt[d * kF32Queries + i] = row[d] * scale;
  }
  std::fill(s.out.begin(), s.out.end(), 0.f);
  vn lane;
  for (int i = 0; i < kWidth; ++i) lane[i] = static_cast<float>(i);
  vn max = splat(kF32Masked), sum = vn{};
  for (int64_t step = it.first; step < it.steps; ++step) {
    const int64_t t0 = step * kF32Keys;
    const int64_t offset = token_row(l, c, t0) + kv * (D + l.extra);
    const float* k = cache.keys(offset);
    vn scores[kF32Keys];
    for (int64_t t = 0; t < kF32Keys; t += kPassKeys)
      pass_scores(k + t * row_len, row_len, s, D, scores + t);
    if (l.cap.on())
      for (int64_t t = 0; t < kF32Keys; ++t) scores[t] = l.cap(scores[t]);
    // On the diagonal, key t0 + t is hidden from query lane i when t0 + t > pos0 + i; keys
    // past the last query's position are hidden from every lane; at a sliding window's lower
    // edge, when t0 + t <= pos0 + i - window. A lane may see no key of the item's first step:
    // its weights there are 1 under the initial max, and the rescale by 0 when its max moves
    // to a key it sees (a later step) wipes them.
    if (l.masks(t0, kF32Keys, pos0, kF32Queries))
      for (int64_t t = 0; t < kF32Keys; ++t) {
        const int64_t key = t0 + t;
        const float below = l.hidden_below(key, pos0, limit, kF32Queries);
        const float from = l.hidden_from(key, pos0, kF32Queries);
        scores[t] = (lane < splat(below)) | (lane >= splat(from)) ? splat(kF32Masked) : scores[t];
      }
    vn step_max = scores[0];
    for (int64_t t = 1; t < kF32Keys; ++t)
      step_max = scores[t] > step_max ? scores[t] : step_max;
    const vni moved = step_max > max + kF32Slack;
    bool any = false;
    for (int i = 0; i < kWidth; ++i) any |= moved[i] != 0;
    if (any) {  // rescale what was accumulated under the old max
      const vn new_max = moved ? step_max : max;
      const vn alpha = exp_or_zero(max - new_max);
      sum *= alpha;
      max = new_max;
      for (int64_t d = 0; d < D; ++d) {
        float* o = s.out.data() + d * kF32Queries;
        store_vn(o, load_vn(o) * alpha);
      }
    }
    for (int64_t t = 0; t < kF32Keys; ++t) {
      const vn p = exp_or_zero(scores[t] - max);
      sum += p;
      store_vn(s.weights + t * kF32Queries, p);
    }
    const int64_t keys = std::min(kF32Keys, limit - t0);
    step_values(cache.values(offset, keys), row_len, keys, D, s);
  }
  alignas(64) float inv[kWidth];
  store_vn(inv, 1.f / sum);
  for (int64_t i = 0; i < nq; ++i) {
    float* o = out + ((c.first_row + q0 + i) * l.heads + it.head) * D;
    for (int64_t d = 0; d < D; ++d) o[d] = s.out[d * kF32Queries + i] * inv[i];
  }
}

}  // namespace
