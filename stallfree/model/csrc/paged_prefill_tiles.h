// The prefill kernel's two products in AMX tiles (see paged_prefill.h).
//
// Tiles 0-3 hold up to four 16-dim slices of out^T, kept there across steps when the head
// has at most 64 dims; 4 and 5 a step's scores; 6 the A operand (K rows loaded straight
// from the cache, then V^T) and 7 the B operand (Q^T, then P^T).
#pragma once

#include "amx.h"
#include "paged_prefill.h"

#if defined(PREFILL_KERNEL) && defined(STALLFREE_AMX)
#define PREFILL_TILES 1

namespace {

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

struct TileProducts {
  int64_t dim;
  int slices() const { return static_cast<int>(dim / 16); }
  bool held() const { return slices() <= 4; }  // out^T stays in tiles 0-3 across steps

  void begin(Scratch& s) {
    if (held())
      for (int i = 0; i < slices(); ++i) slice(i, kZero);
    else
      std::fill(s.out.begin(), s.out.end(), 0.f);
  }

  void scores(const uint16_t* k0, const uint16_t* k1, int64_t k_stride, Scratch& s) {
    const int64_t stride = k_stride * int64_t(sizeof(uint16_t));
    _tile_zero(4);
    _tile_zero(5);
    for (int64_t cc = 0; cc < dim / 32; ++cc) {
      _tile_loadd(7, s.qpack.data() + cc * 256, 64);
      _tile_loadd(6, k0 + cc * 32, stride);
      _tile_dpbf16ps(4, 6, 7);
      if (k1 != nullptr) {
        _tile_loadd(6, k1 + cc * 32, stride);
        _tile_dpbf16ps(5, 6, 7);
      }
    }
    _tile_stored(4, s.scores, 64);
    if (k1 != nullptr) _tile_stored(5, s.scores + 16 * kQueries, 64);
  }

  void to_memory(Scratch& s) {
    if (held())
      for (int i = 0; i < slices(); ++i) slice(i, kStore, s.out.data() + i * 256);
  }

  void from_memory(Scratch& s) {
    if (held())
      for (int i = 0; i < slices(); ++i) slice(i, kLoad, s.out.data() + i * 256);
  }

  void accumulate(const uint32_t* v, Scratch& s) {
    _tile_loadd(7, s.weights, 64);
    for (int64_t d0 = 0; d0 < dim; d0 += 64) {  // four slices at a time
      const int n = static_cast<int>(std::min<int64_t>(4, (dim - d0) / 16));
      for (int i = 0; i < n; ++i) {
        if (!held()) slice(i, kLoad, s.out.data() + (d0 + 16 * i) * kQueries);
        _tile_loadd(6, v + (d0 + 16 * i) * 16, 64);
        slice(i, kMultiply);
        if (!held()) slice(i, kStore, s.out.data() + (d0 + 16 * i) * kQueries);
      }
    }
  }
};

}  // namespace

#endif  // PREFILL_TILES
