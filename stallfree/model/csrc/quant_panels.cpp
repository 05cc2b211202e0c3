// Quant rows (quant_formats.py) to panels (quant_panels.h) at load, and rows read back from
// panels: for the torch path, the tied embedding's lookups and the tests.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#include "quant_panels.h"

namespace {

// Where value `i` (0-31) of a block's row `r` sits in the block's quants: (byte, high nibble).
inline int64_t panel_byte(const Format& f, int64_t r, int64_t i, bool* high) {
  const int64_t quad = i / 4, t = i % 4;
  *high = f.bits == 4 && quad >= 4;
  return (f.bits == 4 ? quad % 4 : quad) * 32 + r * 4 + t;
}

// Value `i` (0-31) of block b of a quant row, and where a row keeps its scales.
inline uint8_t row_quant(const Format& f, const uint8_t* row, int64_t b, int64_t i) {
  if (f.bits == 8) return row[32 * b + i];
  const uint8_t byte = row[16 * b + i % 16];
  return i < 16 ? byte & 0x0f : byte >> 4;
}

void check_rows(const at::Tensor& rows, const Format& f, int64_t k) {
  TORCH_CHECK(k > 0 && k % 32 == 0, "quant panels: K must be a positive multiple of 32, got ", k);
  TORCH_CHECK(rows.scalar_type() == at::kByte && rows.dim() == 2 && rows.is_contiguous() &&
                  rows.size(1) == f.row_bytes(k),
              "quant panels: contiguous uint8 rows [N, ", f.row_bytes(k), "] expected, got ",
              rows.sizes());
}

at::Tensor quant_pack_panels(const at::Tensor& rows, int64_t k, int64_t code) {
  const Format f = format_of(code);
  check_rows(rows, f, k);
  const int64_t n = rows.size(0), blocks = k / 32, stride = f.row_bytes(k);
  at::Tensor panels = at::zeros({panels_of(n), f.panel_bytes(k)}, rows.options());
  const uint8_t* src = rows.data_ptr<uint8_t>();
  uint8_t* dst = panels.data_ptr<uint8_t>();
  at::parallel_for(0, n, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t row = r0; row < r1; ++row) {
      const uint8_t* in = src + row * stride;
      const float* scales = reinterpret_cast<const float*>(in + k * f.bits / 8);
      const float* mins = scales + k / f.group;
      const int64_t r = row % kPanelRows;
      for (int64_t b = 0; b < blocks; ++b) {
        uint8_t* block = dst + row / kPanelRows * f.panel_bytes(k) + b * f.block_bytes();
        for (int64_t i = 0; i < 32; ++i) {
          bool high;
          uint8_t& byte = block[panel_byte(f, r, i, &high)];
          const uint8_t q = row_quant(f, in, b, i);
          byte |= high ? static_cast<uint8_t>(q << 4) : q;
        }
        float* block_scales = reinterpret_cast<float*>(block + f.quant_bytes());
        for (int64_t g = 0; g < f.groups(); ++g) {
          block_scales[g * kPanelRows + r] = scales[b * f.groups() + g];
          if (f.has_min)
            block_scales[(f.groups() + g) * kPanelRows + r] = mins[b * f.groups() + g];
        }
      }
    }
  });
  return panels;
}

// Rows `ids` of the weight, as quant rows.
at::Tensor quant_panel_rows(const at::Tensor& panels, const at::Tensor& ids, int64_t n,
                            int64_t k, int64_t code) {
  const Format f = format_of(code);
  TORCH_CHECK(panels.scalar_type() == at::kByte && panels.is_contiguous() && panels.dim() == 2 &&
                  panels.size(0) == panels_of(n) && panels.size(1) == f.panel_bytes(k),
              "quant_panel_rows: panels of ", n, " rows and K = ", k, " expected");
  const at::Tensor index = ids.to(at::kLong).contiguous();
  const int64_t count = index.numel(), blocks = k / 32, stride = f.row_bytes(k);
  at::Tensor rows = at::zeros({count, stride}, panels.options());
  const int64_t* id = index.data_ptr<int64_t>();
  for (int64_t j = 0; j < count; ++j)
    TORCH_CHECK(id[j] >= 0 && id[j] < n, "quant_panel_rows: row ", id[j], " outside [0, ", n, ")");
  const uint8_t* src = panels.data_ptr<uint8_t>();
  uint8_t* dst = rows.data_ptr<uint8_t>();
  at::parallel_for(0, count, 16, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      uint8_t* out = dst + j * stride;
      float* scales = reinterpret_cast<float*>(out + k * f.bits / 8);
      float* mins = scales + k / f.group;
      const int64_t r = id[j] % kPanelRows;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* block = src + id[j] / kPanelRows * f.panel_bytes(k) + b * f.block_bytes();
        for (int64_t i = 0; i < 32; ++i) {
          bool high;
          const uint8_t byte = block[panel_byte(f, r, i, &high)];
          const uint8_t q = f.bits == 8 ? byte : high ? byte >> 4 : byte & 0x0f;
          if (f.bits == 8)
            out[32 * b + i] = q;
          else
            out[16 * b + i % 16] |= i < 16 ? q : static_cast<uint8_t>(q << 4);
        }
        const float* block_scales = reinterpret_cast<const float*>(block + f.quant_bytes());
        for (int64_t g = 0; g < f.groups(); ++g) {
          scales[b * f.groups() + g] = block_scales[g * kPanelRows + r];
          if (f.has_min) mins[b * f.groups() + g] = block_scales[(f.groups() + g) * kPanelRows + r];
        }
      }
    }
  });
  return rows;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(stallfree, m) {
  m.def("quant_pack_panels(Tensor rows, int k, int format) -> Tensor");
  m.def("quant_panel_rows(Tensor panels, Tensor ids, int n, int k, int format) -> Tensor");
}

TORCH_LIBRARY_IMPL(stallfree, CPU, m) {
  m.impl("quant_pack_panels", &quant_pack_panels);
  m.impl("quant_panel_rows", &quant_panel_rows);
}
