// What the AMX kernels share: tile shapes, the tile configuration, and the permission to use tiles.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace infer {

constexpr int64_t kTileRows = 16;  // rows of an A tile, k-pairs of a B tile
constexpr int64_t kTileK = 32;     // bfloat16 values of k per tile row
constexpr int64_t kBlockN = 16;    // output columns per B / C tile

// Every kernel here uses eight tiles of 16 rows x 64 bytes; what each holds is the kernel's business.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = kTileRows;
  }
  // Not _tile_loadconfig: GCC 12's tells the compiler it reads 8 bytes (a pointer's worth) of the configuration, so
  // the stores of the tile shapes may be dropped as dead wherever this is inlined (seen: a worker's setup loading a
  // configuration with only its first 32 bytes written, a fault in ldtilecfg). This asm reads all 64.
  __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
}

// The 2 x 2 blocking every AMX linear uses: C tiles 0-3 accumulate 32 rows x 32 columns (tiles 2-3: rows 16-31,
// only where `two`), A tiles 4-5 hold rows of x, B tiles 6-7 weights.
inline void zero_accumulators(bool two) {
  _tile_zero(0);
  _tile_zero(1);
  if (two) {
    _tile_zero(2);
    _tile_zero(3);
  }
}

// The accumulators into c, 32 rows of 32 four-byte sums (float32 or int32), c[16..31] only where `two`
template <typename T>
inline void store_accumulators(T (*c)[32], bool two) {
  _tile_stored(0, &c[0][0], 128);
  _tile_stored(1, &c[0][16], 128);
  if (two) {
    _tile_stored(2, &c[16][0], 128);
    _tile_stored(3, &c[16][16], 128);
  }
}

// One k step of that blocking: B tiles 6-7 from b0 and b1 (ldb bytes a row), A tile 4 from a and, where `two`, A
// tile 5 from 16 rows further (lda bytes a row), and their four products into the C tiles: bfloat16 pairs summed in
// float32 (tdpbf16ps) or, INT8, unsigned by signed bytes summed exactly in int32 (tdpbusd). (The two are spelled
// out: the tile intrinsics are macros that need literal tile numbers, not template arguments.)
template <bool INT8>
inline void tile_step(const void* a, int64_t lda, const void* b0, const void* b1, int64_t ldb, bool two) {
  _tile_loadd(6, b0, ldb);
  _tile_loadd(7, b1, ldb);
  _tile_loadd(4, a, lda);
#if defined(__AMX_INT8__)
  if constexpr (INT8) {
    _tile_dpbusd(0, 4, 6);
    _tile_dpbusd(1, 4, 7);
    if (two) {
      _tile_loadd(5, static_cast<const char*>(a) + 16 * lda, lda);
      _tile_dpbusd(2, 5, 6);
      _tile_dpbusd(3, 5, 7);
    }
    return;
  }
#endif
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  if (two) {
    _tile_loadd(5, static_cast<const char*>(a) + 16 * lda, lda);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
}

// Asks the kernel for permission to use AMX tile data in this process (Linux 5.16+); false if refused.
inline bool enable_amx() {
  constexpr int kArchReqXcompPerm = 0x1023;
  constexpr int kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// Whether this process may use AMX tile data, asked once (refused: the kernels' vector paths throughout)
inline bool amx_granted() {
  static const bool granted = enable_amx();
  return granted;
}

}  // namespace infer
