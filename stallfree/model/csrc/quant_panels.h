// The panel layout of quantized weights (quant_linear.cpp reads it; quant_panels.cpp writes
// it from quant rows and reads rows back).
//
// quant_formats.py's rows keep each weight row whole: a row's quants, then its scales and
// mins. The kernel instead wants 8 rows side by side in one vector, so that a vector of
// products holds 8 outputs (no horizontal sums) and one vector of 8 rows' scales scales them
// all: a panel is 8 rows of W, stored block by block (32 values of K); a block holds
//   quants: for each run of 4 values of K (a quad), 8 rows x 4 bytes = 32 bytes
//           (8-bit: 8 quads, 256 bytes, int8 as in the rows; 4-bit: quads j and j + 4 in the
//           low and high nibbles of one 32-byte run, 128 bytes)
//   scales: float32 [32 / group][8]: per group of the block, the 8 rows' scales
//   mins:   likewise, where the format has them.
// Rows past N (the last panel's padding) are zeros: their outputs are zeros, never stored.
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>

namespace {

constexpr int64_t kPanelRows = 8;

// The formats of quant_formats.py, by code.
struct Format {
  int bits, group;
  bool has_min;

  int64_t row_bytes(int64_t k) const { return k * bits / 8 + 4 * (k / group) * (has_min ? 2 : 1); }
  int64_t quant_bytes() const { return 32 * kPanelRows * bits / 8; }  // per block
  int64_t groups() const { return 32 / group; }                       // per block
  int64_t block_bytes() const {
    return quant_bytes() + 4 * kPanelRows * groups() * (has_min ? 2 : 1);
  }
  int64_t panel_bytes(int64_t k) const { return k / 32 * block_bytes(); }
};

// Every format once: X(code, bits, group, has_min), in quant_formats.py's codes. format_of
// and quant_linear.cpp's kernel choice expand it.
#define STALLFREE_QUANT_FORMATS(X) \
  X(1, 4, 32, true)   /* q4_32 */  \
  X(2, 8, 32, false)  /* q8_32 */  \
  X(3, 8, 32, true)   /* q8_32m */ \
  X(4, 8, 16, false)  /* q8_16 */  \
  X(5, 8, 16, true)   /* q8_16m */

inline Format format_of(int64_t code) {
  switch (code) {
#define STALLFREE_FORMAT_CASE(c, bits, group, has_min) \
  case c:                                              \
    return {bits, group, has_min};
    STALLFREE_QUANT_FORMATS(STALLFREE_FORMAT_CASE)
#undef STALLFREE_FORMAT_CASE
  }
  TORCH_CHECK(false, "quant: unknown format code ", code);
  return {};
}

inline int64_t panels_of(int64_t n) { return (n + kPanelRows - 1) / kPanelRows; }

}  // namespace
