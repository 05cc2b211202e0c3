// What the decode-attention kernels (paged_decode.cpp, paged_decode_amx.h) share: the
// cache's shape, work items and their softmax state, and how a row is held in vectors.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "paged_decode_softcap.h"
#include "paged_int8.h"
#include "vec.h"

namespace {

struct Shape {
  int64_t heads, kv_heads, dim, block_size, num_blocks, max_blocks;
  SoftCap cap;  // applied to every score (off: the default)
};

// One work item: tokens [begin, end) of request `row`. With a sliding window a request's
// first item begins at its window's first token, which need not be a multiple of 16.
struct Item {
  int64_t row, begin, end;
};

// Softmax state of one item: running max and sum per query head, unnormalised output.
struct Partial {
  float* max;
  float* sum;
  float* acc;
};

// How a row is held in vectors. A bf16 row is widened by splitting each 32-bit word into
// its two halves (one shift, one mask: no shuffle), so its vectors hold the even and the odd
// dims of 32 consecutive ones; other dtypes are held in order. The query and the output are
// held in the same order, so a dot product or a weighted sum never needs the row reordered.
template <typename T, int C>
constexpr bool kSplit = std::is_same_v<T, c10::BFloat16> && C % 2 == 0;

template <typename T, int C>
inline int64_t dim_of(int c, int lane) {  // the dim a held lane stands for
  if constexpr (kSplit<T, C>)
    return (c / 2) * 2 * kLanes + 2 * lane + c % 2;
  else
    return c * kLanes + lane;
}

template <typename T, int C>
inline void load_row(const T* p, vf* out) {
  if constexpr (kSplit<T, C>) {
    for (int c = 0; c < C; c += 2) {
      vu u;
      std::memcpy(&u, p + c * kLanes, sizeof u);
      out[c] = reinterpret_cast<vf>(u << 16);
      out[c + 1] = reinterpret_cast<vf>(u & 0xffff0000u);
    }
  } else {
    for (int c = 0; c < C; ++c) out[c] = load16(p + c * kLanes);
  }
}

// Where the rows asked for ahead go: into L2 on CPUs without AMX, where that let more of a
// tile's lines be on their way at once (1.04-1.31x per layer on a 2-core EPYC,
// docs/benchmarks.md); into L1 where the kernel was tuned on AMX CPUs.
#if defined(__AMX_TILE__)
constexpr int kPrefetchLocality = 3;
#else
constexpr int kPrefetchLocality = 2;
#endif

// Asks for `bytes` bytes from p on. Rows of a float cache are whole lines; an int8 cache's
// (D + 4 bytes) start anywhere in one, so their last byte's line is asked for too (`odd`).
template <typename T, bool odd = false>
__attribute__((always_inline)) inline void prefetch_bytes(const T* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(p) + b, 0, kPrefetchLocality);
  if constexpr (odd)
    __builtin_prefetch(reinterpret_cast<const char*>(p) + bytes - 1, 0, kPrefetchLocality);
}

// The rows of a tile ahead, asked for a token at a time: its token j's K bytes or V bytes, if
// it has a token j; D dims of one KV head (a compile-time count, so the asking unrolls), and
// an int8 row's scale.
template <typename T, int D>
struct TileAhead {
  static constexpr int64_t kBytes = row_elems<T>(D) * int64_t(sizeof(T));
  static constexpr bool kOdd = kRowExtra<T> != 0;
  const T* k;  // the cache at the KV head's first dim
  const T* v;
  const int64_t* rows;
  int n;
  __attribute__((always_inline)) void ask_k(int j) const {
    if (j < n) prefetch_bytes<T, kOdd>(k + rows[j], kBytes);
  }
  __attribute__((always_inline)) void ask_v(int j) const {
    if (j < n) prefetch_bytes<T, kOdd>(v + rows[j], kBytes);
  }
};

// Bytes [offset, offset + bytes) of n tokens' K and V rows (cache offsets `rows`), at once.
template <typename T>
inline void prefetch_rows(const T* k, const T* v, const int64_t* rows, int n, int64_t offset,
                          int64_t bytes) {
  constexpr bool odd = kRowExtra<T> != 0;
  for (int j = 0; j < n; ++j) {
    prefetch_bytes<T, odd>(k + rows[j] + offset, bytes);
    prefetch_bytes<T, odd>(v + rows[j] + offset, bytes);
  }
}

}  // namespace
