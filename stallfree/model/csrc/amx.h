// AMX tiles for the CPU kernels: whether the build targets them, the process's permission
// to use them, and the one tile shape every kernel here uses.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define STALLFREE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace {

constexpr int64_t kTileBytes = 1024;  // 16 rows x 64 bytes

// Linux lets a process use the tile registers only once it asks (5.16 and later).
inline bool amx_permission_granted() {
  static const bool granted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile register 16 rows of 64 bytes: 16 fp32 sums, or 32 bf16 values (16 pairs).
// amx_linear.cpp shortens its first row tile's sums and A operand (tiles 0, 1, 4) to
// `first_rows` and its second's (2, 3, 5) to `second_rows`, so that x needs no padding to
// whole tiles below 32 rows; tiles 6-7 keep 16. Per thread; a kernel sets it at the start
// of its parallel region and releases the tiles at the end, since other libraries (oneDNN)
// configure their own.
inline void configure_tiles(int first_rows = 16, int second_rows = 16) {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) {
    cfg.rows[i] = i == 0 || i == 1 || i == 4 ? first_rows
                  : i < 6                    ? second_rows
                                             : 16;
    cfg.colsb[i] = 64;
  }
  _tile_loadconfig(&cfg);
}

}  // namespace
#endif

namespace {

inline bool amx_usable() {
#ifdef STALLFREE_AMX
  return amx_permission_granted();
#else
  return false;
#endif
}

}  // namespace
