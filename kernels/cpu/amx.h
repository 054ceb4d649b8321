// AMX's per-process permission and the one tile shape the native kernels use, shared by the
// kernels that multiply on AMX tiles (w8a8_matmul.cc, attention_amx.h).
//
// Linux hands AMX's tile data state to a process only after it asks (arch_prctl); without it the
// first tile instruction faults. Each thread that runs tile instructions loads a tile
// configuration first and releases it after (the configuration is per thread).
#pragma once

#if defined(__AMX_TILE__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace jaxrunner_cpu {

// Whether the kernel grants this process AMX's tile data, asked once.
inline bool AmxGranted() {
  static const bool granted = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// All eight tiles as 16 rows of 64 bytes, on the calling thread.
inline void ConfigureTiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

}  // namespace jaxrunner_cpu

#endif
