// Decode attention's scores and online softmax over one tile of tokens (paged_decode.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "paged_decode.h"
#include "paged_decode_pairs.h"
#include "vec.h"

namespace {

// Tokens per tile: two vectors of scores per query head, so the softmax's reductions across
// lanes and its rescaling come once per 32 keys (1.04-1.23x per layer at 1-64 decodes
// against tiles of 16, 2-core EPYC).
constexpr int kTile = 2 * kLanes;

// The scores of query heads [h0, h0 + count) (count <= HG) for the tile's n tokens and their
// softmax step: each head's running max and sum move; p[i] gets its weights (tokens 0-15,
// 16-31) and alpha[i] the factor by which what it accumulated so far shrinks (1 unless its
// max rose). The heads go through each stage together: their reductions are short
// dependent chains (a max across lanes, an exp, a sum), and side by side they overlap where
// one head at a time waits on each (1.55x on L2-resident KV against one head at a time, in
// the bf16-pairs path; caches of other dtypes take one head per pass, int8 ones up to 4,
// paged_decode_int8.h). `cap` soft-caps the scores before the tail is masked.
template <typename T, int C, int HG>
inline void softmax_steps(const vf* q, const T* k, const int64_t* rows, int n,
                          const Partial& out, int64_t h0, int count, vf (*p)[2], float* alpha,
                          const TileAhead<T, C * kLanes>& ahead, const SoftCap& cap) {
  const vi lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const vf minus_inf = vf{} - std::numeric_limits<float>::infinity();
  const int n0 = std::min(n, kLanes), n1 = n - n0;
  vf scores[HG][2];
  float m[HG];
  for (int i = 0; i < count; ++i) {
    const TileAhead<T, C * kLanes>* asks = i == 0 ? &ahead : nullptr;
    const vf s0 = cap(key_scores<T, C>(q + (h0 + i) * C, k, rows, asks, 0));
    scores[i][0] = lane < n0 ? s0 : minus_inf;
    if (n1 > 0) {
      const vf s = cap(key_scores<T, C>(q + (h0 + i) * C, k, rows + kLanes, asks, kLanes));
      scores[i][1] = lane < n1 ? s : minus_inf;
    } else {
      scores[i][1] = minus_inf;
    }
  }
  for (int i = 0; i < count; ++i) {
    const vf both = scores[i][0] > scores[i][1] ? scores[i][0] : scores[i][1];
    m[i] = std::max(out.max[h0 + i], hmax(both));
  }
  for (int i = 0; i < count; ++i) {
    const int64_t h = h0 + i;
    alpha[i] = m[i] > out.max[h] ? std::exp(out.max[h] - m[i]) : 1.f;
    out.max[h] = m[i];
    p[i][0] = lane < n0 ? exp_nonpositive(scores[i][0] - m[i]) : vf{};
    p[i][1] = lane < n1 ? exp_nonpositive(scores[i][1] - m[i]) : vf{};
  }
  for (int i = 0; i < count; ++i)
    out.sum[h0 + i] = out.sum[h0 + i] * alpha[i] + hsum(p[i][0] + p[i][1]);
}

}  // namespace
