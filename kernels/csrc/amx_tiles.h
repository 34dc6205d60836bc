// What every AMX kernel needs (built only at the amx level, kernels/cpu_isa.py):
// the process's permission to use tile data, the tile configuration record,
// and a compiler barrier before tile loads.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <c10/util/Exception.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>

namespace kvmesh {

// Linux hands out AMX tile state only to processes that ask for it (the
// register file is 8 KB of every context switch's save area); once per
// process, for all its threads. `op` names the caller in the error.
inline void require_amx_permission(const char* op) {
  static const int refused = [] {
    constexpr long kArchReqXcompPerm = 0x1023;
    constexpr long kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0 ? 0 : errno;
  }();
  TORCH_CHECK(refused == 0, op,
              ": Linux refused AMX tile data to this process "
              "(arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): ",
              std::strerror(refused), "); run a lower level (KVMESH_CPU_ISA=avx512_bf16)");
}

// The 64-byte operand of ldtilecfg (palette 1: 8 tiles of up to 16 rows x 64 bytes).
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Every one of the first `tiles` tiles at the full 16 rows x 64 bytes.
inline TileConfig full_tiles_config(int tiles) {
  TileConfig config{};
  config.palette_id = 1;
  for (int t = 0; t < tiles; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  return config;
}

// Stores tile `tile` (0..7) to `out` with `stride` bytes per row: the tile
// number must be a literal in the instruction, hence the switch.
inline void store_tile(int tile, void* out, long stride) {
  switch (tile) {
    case 0: _tile_stored(0, out, stride); break;
    case 1: _tile_stored(1, out, stride); break;
    case 2: _tile_stored(2, out, stride); break;
    case 3: _tile_stored(3, out, stride); break;
    case 4: _tile_stored(4, out, stride); break;
    case 5: _tile_stored(5, out, stride); break;
    case 6: _tile_stored(6, out, stride); break;
    default: _tile_stored(7, out, stride); break;
  }
}

// GCC's tile loads take their address as a plain register operand: without
// this barrier the compiler may sink (or drop) the stores they read.
inline void compiler_barrier() { asm volatile("" ::: "memory"); }

}  // namespace kvmesh

#endif  // AMX
