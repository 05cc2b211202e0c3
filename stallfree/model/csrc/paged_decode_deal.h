// How decode attention's work is shared out (paged_decode.cpp): a request's context may be
// cut into parts, each a work item with its own softmax state, merged at the end; each
// thread walks a run of items.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "paged_decode.h"
#include "vec.h"

namespace {

// Work items in row order, and where each thread's run of them starts (first[t], first[t+1]).
struct Deal {
  std::vector<Item> items;
  std::vector<int64_t> first;
};

// Request r attends to its tokens [lo[r], lens[r]): lo is 0 without a sliding window.

// split > 0: items of at most `split` tokens (0: whole requests), dealt out to the threads
// in runs of about equal tokens (+ a block per item for its query and merge). Cuts fall on
// multiples of `split` of the request's tokens, whatever its window's start.
Deal deal_fixed(const int64_t* lens, const int64_t* lo, int64_t rows, int64_t split,
                int64_t block_size) {
  if (split == 0) split = std::numeric_limits<int64_t>::max() / 4;
  split = (split + kLanes - 1) / kLanes * kLanes;
  Deal d;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t t = lo[r] / split * split; t < lens[r]; t += split)
      d.items.push_back({r, std::max(t, lo[r]), std::min(lens[r], t + split)});
  const int64_t n = static_cast<int64_t>(d.items.size());
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  d.first.assign(threads + 1, n);
  int64_t total = 0;
  for (const Item& it : d.items) total += it.end - it.begin + block_size;
  int64_t acc = 0, th = 0;
  d.first[0] = 0;
  for (int64_t i = 0; i < n && th + 1 < threads; ++i) {
    acc += d.items[i].end - d.items[i].begin + block_size;
    while (th + 1 < threads && acc * threads >= total * (th + 1)) d.first[++th] = i + 1;
  }
  return d;
}

// Automatic: the batch's tokens, requests end to end, cut into one equal span per thread,
// and each span into its requests' parts. Each thread then walks as few items as the
// requests allow: an item's first tile is read without a tile ahead of it, and its softmax
// state is set up and merged. On a 2-core EPYC (cache in DRAM) this took 0.81-0.97x the
// time of items of 1/8 of a thread's share at 1-8 requests of 512 tokens and one of 2,048,
// the same from ~16 requests (docs/benchmarks.md). Spans of fewer than kMinSpan tokens are
// not worth a thread. A cut inside a request falls on a multiple of kLanes of its own
// tokens: the AMX path reads 16-token tiles that must lie within one block.
constexpr int64_t kMinSpan = 64;

Deal deal_spans(const int64_t* lens, const int64_t* lo, int64_t rows) {
  const auto span = [&](int64_t r) { return lens[r] - lo[r]; };  // the tokens r attends to
  int64_t total = 0;
  for (int64_t r = 0; r < rows; ++r) total += span(r);
  const int64_t threads =
      std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), total / kMinSpan));
  // cuts[t]: where thread t's span begins, in the batch's attended tokens.
  std::vector<int64_t> cuts(threads + 1, total);
  cuts[0] = 0;
  for (int64_t t = 1, row = 0, row_start = 0; t < threads; ++t) {
    const int64_t even = total * t / threads;
    while (row_start + span(row) <= even) row_start += span(row++);  // skips empty requests
    // The cut's token in its request, rounded to a multiple of kLanes, inside its window.
    const int64_t token =
        std::min(lens[row], (lo[row] + even - row_start + kLanes / 2) / kLanes * kLanes);
    cuts[t] = std::max(cuts[t - 1], row_start + std::max<int64_t>(0, token - lo[row]));
  }
  Deal d;
  d.first.push_back(0);
  int64_t row = 0, row_start = 0;  // the request holding token `at`, where it starts
  for (int64_t t = 0; t < threads; ++t) {
    for (int64_t at = cuts[t]; at < cuts[t + 1];) {
      while (row_start + span(row) <= at) row_start += span(row++);
      const int64_t stop = std::min(cuts[t + 1], row_start + span(row));
      d.items.push_back({row, lo[row] + at - row_start, lo[row] + stop - row_start});
      at = stop;
    }
    d.first.push_back(static_cast<int64_t>(d.items.size()));
  }
  return d;
}

}  // namespace
