// y = x Wᵀ for small batches, with W kept as 8-bit codes and per-32-block
// float32 scale and offset: W[n, k] = fma(code[n, k], scale[n, k/32], offset[n, k/32]).
//
// Why: a decode step multiplies a handful of rows by every weight, so its
// matmuls are bound by reading the weights. Checkpoints that were quantized
// once (GGUF Q4_1, Q8_0, ...) have float32 weights that are exactly such codes;
// reading 1 byte instead of 4 per weight and rebuilding the float32 value in
// registers gives the very same weights (the fma is exact: code * scale needs
// at most 19 significant bits) at a quarter of the memory traffic. The
// arithmetic stays float32 (activations are never quantized).
// kernels/block_codes.py finds the codes and proves them exact at load time.
//
// Layout, 16 output features per panel (one AVX-512 register of float32):
//   codes:   [num_panels, K, 16]       uint8
//   scales:  [num_panels, K / 32, 16]  float32
//   offsets: [num_panels, K / 32, 16]  float32
// Panels past out_features are zero padding.
//
// Paths by instruction-set level (kernels/cpu_isa.py), chosen at compile time
// since each level is its own library:
//   AVX-512:      one 16-lane register per panel; float32 activations.
//   AVX2 + FMA:   two 8-lane halves per panel, same operations in the same
//                 order, so the float32 results are bitwise those of AVX-512.
//   AVX512-BF16:  also bfloat16 activations: two input features' weights are
//                 rebuilt in float32, rounded to bfloat16 (nearest even, as
//                 torch rounds the model's weights to bfloat16) and interleaved
//                 in pairs, so that one vdpbf16ps multiplies-and-adds 32
//                 weights per row; float32 accumulators, bfloat16 output. A
//                 bfloat16 model's decode rows then cost half the multiply
//                 instructions, which moves the batch size up to which codes
//                 beat oneDNN's bfloat16 matmul.
//   AMX:          bfloat16 activations on AMX tiles: each 32-feature block's
//                 weights rebuilt as above (one B tile: 16 pairs x 16 outputs,
//                 the same bfloat16 values), then one tdpbf16ps per 16 rows
//                 multiplies all 32 features; float32 accumulators in tiles,
//                 bfloat16 output. The codes are still read once per call, but
//                 the multiplies no longer grow ~linearly with the rows, so a
//                 decode batch of 32+ rows stays near the 1-row time. float32
//                 activations run the AVX-512 path.
//   otherwise:    portable C++ (the compiler vectorizes what the level allows;
//                 multiply and add are separate roundings there).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include "amx_tiles.h"
#include "work_stealing.h"

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kCodeBlock = 32;
#if defined(__AVX512F__) || !defined(__AVX2__)
constexpr int64_t kMaxRows = 16;  // rows per register tile: 16 accumulators (of 32 zmm)
#else
constexpr int64_t kMaxRows = 6;  // 2 accumulators per row in 16 ymm registers
#endif
constexpr int64_t kPrefetchAhead = 256;  // k steps (16 bytes each) of codes

// The codes stream from DRAM once per step; ask for them a few KB ahead (past
// the end of this panel that is the next panel, laid out after it).
inline void prefetch_codes(const uint8_t* codes, const uint8_t* next_codes, int64_t K,
                           int64_t kb) {
#if defined(__AVX512F__) || defined(__AVX2__)
  const int64_t ahead_k = kb * kCodeBlock + kPrefetchAhead;
  if (ahead_k >= K && next_codes == nullptr) return;
  const uint8_t* ahead =
      ahead_k < K ? codes + ahead_k * kLanes : next_codes + (ahead_k - K) * kLanes;
  for (int64_t line = 0; line < kCodeBlock * kLanes; line += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T0);
  }
#endif
}

#if defined(__AVX512F__)
template <int ROWS>
void panel_tile(const float* x, int64_t K, const uint8_t* codes, const uint8_t* next_codes,
                const float* scales, const float* offsets, float* y, int64_t ldy,
                int64_t valid_lanes) {
  __m512 acc[ROWS];
  for (int m = 0; m < ROWS; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < K / kCodeBlock; ++kb) {
    const __m512 scale = _mm512_loadu_ps(scales + kb * kLanes);
    const __m512 offset = _mm512_loadu_ps(offsets + kb * kLanes);
    prefetch_codes(codes, next_codes, K, kb);
    for (int64_t kk = 0; kk < kCodeBlock; ++kk) {
      const int64_t k = kb * kCodeBlock + kk;
      const __m128i c8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k * kLanes));
      const __m512 w = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(c8)), scale, offset);
      for (int m = 0; m < ROWS; ++m) {
        acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * K + k]), w, acc[m]);
      }
    }
  }
  const __mmask16 mask = valid_lanes >= kLanes ? 0xFFFF : (__mmask16)((1u << valid_lanes) - 1);
  for (int m = 0; m < ROWS; ++m) _mm512_mask_storeu_ps(y + m * ldy, mask, acc[m]);
}
#elif defined(__AVX2__) && defined(__FMA__)
template <int ROWS>
void panel_tile(const float* x, int64_t K, const uint8_t* codes, const uint8_t* next_codes,
                const float* scales, const float* offsets, float* y, int64_t ldy,
                int64_t valid_lanes) {
  __m256 acc_lo[ROWS], acc_hi[ROWS];
  for (int m = 0; m < ROWS; ++m) acc_lo[m] = acc_hi[m] = _mm256_setzero_ps();
  for (int64_t kb = 0; kb < K / kCodeBlock; ++kb) {
    const __m256 scale_lo = _mm256_loadu_ps(scales + kb * kLanes);
    const __m256 scale_hi = _mm256_loadu_ps(scales + kb * kLanes + 8);
    const __m256 offset_lo = _mm256_loadu_ps(offsets + kb * kLanes);
    const __m256 offset_hi = _mm256_loadu_ps(offsets + kb * kLanes + 8);
    prefetch_codes(codes, next_codes, K, kb);
    for (int64_t kk = 0; kk < kCodeBlock; ++kk) {
      const int64_t k = kb * kCodeBlock + kk;
      const __m128i c8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k * kLanes));
      const __m256 w_lo =
          _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c8)), scale_lo, offset_lo);
      const __m256 w_hi = _mm256_fmadd_ps(
          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(c8, 8))), scale_hi, offset_hi);
      for (int m = 0; m < ROWS; ++m) {
        const __m256 xv = _mm256_set1_ps(x[m * K + k]);
        acc_lo[m] = _mm256_fmadd_ps(xv, w_lo, acc_lo[m]);
        acc_hi[m] = _mm256_fmadd_ps(xv, w_hi, acc_hi[m]);
      }
    }
  }
  for (int m = 0; m < ROWS; ++m) {
    alignas(32) float out[kLanes];
    _mm256_store_ps(out, acc_lo[m]);
    _mm256_store_ps(out + 8, acc_hi[m]);
    for (int64_t l = 0; l < valid_lanes; ++l) y[m * ldy + l] = out[l];
  }
}
#else
template <int ROWS>
void panel_tile(const float* x, int64_t K, const uint8_t* codes, const uint8_t* /*next_codes*/,
                const float* scales, const float* offsets, float* y, int64_t ldy,
                int64_t valid_lanes) {
  float acc[ROWS][kLanes] = {};
  float w[kLanes];
  for (int64_t k = 0; k < K; ++k) {
    const float* scale = scales + (k / kCodeBlock) * kLanes;
    const float* offset = offsets + (k / kCodeBlock) * kLanes;
    for (int64_t l = 0; l < kLanes; ++l) {
      w[l] = std::fma(static_cast<float>(codes[k * kLanes + l]), scale[l], offset[l]);
    }
    for (int m = 0; m < ROWS; ++m) {
      const float xv = x[m * K + k];
#pragma omp simd
      for (int64_t l = 0; l < kLanes; ++l) acc[m][l] += xv * w[l];
    }
  }
  for (int m = 0; m < ROWS; ++m) {
    for (int64_t l = 0; l < valid_lanes; ++l) y[m * ldy + l] = acc[m][l];
  }
}
#endif

using TileFn = void (*)(const float*, int64_t, const uint8_t*, const uint8_t*, const float*,
                        const float*, float*, int64_t, int64_t);

template <int... R>
constexpr auto make_tiles(std::integer_sequence<int, R...>) {
  return std::array<TileFn, sizeof...(R)>{&panel_tile<R + 1>...};
}
constexpr auto kTiles = make_tiles(std::make_integer_sequence<int, kMaxRows>{});


#if defined(__AVX512BF16__)
constexpr bool kBf16Activations = true;

// Two input features (k, k + 1) of the panel's 16 outputs, rebuilt in float32
// and rounded to bfloat16 pairs: word 2l is W[l, k], word 2l + 1 is W[l, k + 1],
// the layout vdpbf16ps multiplies against a broadcast (x[k], x[k + 1]) pair
// (and one row of an AMX B tile).
inline __m512bh weight_pairs(const uint8_t* codes_k, __m512 scale_lo, __m512 scale_hi,
                             __m512 offset_lo, __m512 offset_hi) {
  const __m128i c0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes_k));
  const __m128i c1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes_k + kLanes));
  const __m512 w_lo = _mm512_fmadd_ps(
      _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(c0, c1))), scale_lo, offset_lo);
  const __m512 w_hi = _mm512_fmadd_ps(
      _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(c0, c1))), scale_hi, offset_hi);
  return _mm512_cvtne2ps_pbh(w_hi, w_lo);  // low 16 words from w_lo
}

// One 32-feature block's scale and offset, each lane's value for both
// features of its pair (the word order of weight_pairs).
struct PairScales {
  __m512 scale_lo, scale_hi, offset_lo, offset_hi;
};

inline PairScales pair_scales(const float* scales_kb, const float* offsets_kb) {
  const __m512i pair_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i pair_hi =
      _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
  const __m512 scale = _mm512_loadu_ps(scales_kb);
  const __m512 offset = _mm512_loadu_ps(offsets_kb);
  return {_mm512_permutexvar_ps(pair_lo, scale), _mm512_permutexvar_ps(pair_hi, scale),
          _mm512_permutexvar_ps(pair_lo, offset), _mm512_permutexvar_ps(pair_hi, offset)};
}

inline __m512bh weight_pairs(const uint8_t* codes_k, const PairScales& s) {
  return weight_pairs(codes_k, s.scale_lo, s.scale_hi, s.offset_lo, s.offset_hi);
}

// Rounds 16 float32 lanes to bfloat16 and stores the first valid_lanes.
inline void store_bf16_row(uint16_t* y, __m512 acc, int64_t valid_lanes) {
  const __mmask16 mask = valid_lanes >= kLanes ? 0xFFFF : (__mmask16)((1u << valid_lanes) - 1);
  _mm256_mask_storeu_epi16(y, mask, (__m256i)_mm512_cvtneps_pbh(acc));
}

template <int ROWS>
void panel_tile_bf16(const uint16_t* x, int64_t K, const uint8_t* codes,
                     const uint8_t* next_codes, const float* scales, const float* offsets,
                     uint16_t* y, int64_t ldy, int64_t valid_lanes) {
  __m512 acc[ROWS];
  for (int m = 0; m < ROWS; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < K / kCodeBlock; ++kb) {
    const PairScales s = pair_scales(scales + kb * kLanes, offsets + kb * kLanes);
    prefetch_codes(codes, next_codes, K, kb);
    for (int64_t kk = 0; kk < kCodeBlock; kk += 2) {
      const int64_t k = kb * kCodeBlock + kk;
      const __m512bh w = weight_pairs(codes + k * kLanes, s);
      for (int m = 0; m < ROWS; ++m) {
        int32_t pair;
        std::memcpy(&pair, x + m * K + k, sizeof(pair));
        acc[m] = _mm512_dpbf16_ps(acc[m], w, (__m512bh)_mm512_set1_epi32(pair));
      }
    }
  }
  for (int m = 0; m < ROWS; ++m) store_bf16_row(y + m * ldy, acc[m], valid_lanes);
}

using TileFnBf16 = void (*)(const uint16_t*, int64_t, const uint8_t*, const uint8_t*,
                            const float*, const float*, uint16_t*, int64_t, int64_t);

template <int... R>
constexpr auto make_tiles_bf16(std::integer_sequence<int, R...>) {
  return std::array<TileFnBf16, sizeof...(R)>{&panel_tile_bf16<R + 1>...};
}
constexpr auto kTilesBf16 = make_tiles_bf16(std::make_integer_sequence<int, kMaxRows>{});

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
using kvmesh::compiler_barrier;
using kvmesh::TileConfig;

// The tiles one pass uses. GCC's AMX intrinsics paste the tile number into
// their asm text, so these are macros of literal numbers, not constants.
#define KVMESH_TILE_B 0       // 16 pairs of features x 16 outputs: one 32-feature block
#define KVMESH_TILE_A 1       // 16 rows x 32 features of the activations
#define KVMESH_TILE_A_LAST 2  // the pass's last row tile (maybe fewer rows)
// Accumulators: tiles 3..6, one per 16 rows of the pass.
// On the 2-core AMX Xeon VM this was measured on, one tdpbf16ps costs ~16-22 ns
// and one tileloadd of 16 rows ~10-13 ns (a standalone loop of each), so a
// row tile is ~30 ns per block: giving each row tile its own A tile and
// alternating two B tiles (3 row tiles per pass) measured no faster, and
// 64 rows in two passes of 32 (rebuilding twice) slower, than this layout.
constexpr int64_t kTileRows = 16;
constexpr int64_t kRowTilesPerPass = 4;
constexpr int64_t kPassRows = kTileRows * kRowTilesPerPass;
constexpr int64_t kTileBytesPerRow = 64;

// The tile shapes of a pass over `rows` (1..kPassRows) activation rows.
TileConfig pass_config(int64_t rows) {
  TileConfig config{};
  config.palette_id = 1;
  const int64_t row_tiles = (rows + kTileRows - 1) / kTileRows;
  const auto last_rows = static_cast<uint8_t>(rows - (row_tiles - 1) * kTileRows);
  const auto set = [&](int tile, uint8_t tile_rows) {
    config.rows[tile] = tile_rows;
    config.colsb[tile] = kTileBytesPerRow;
  };
  set(KVMESH_TILE_B, kTileRows);
  set(KVMESH_TILE_A, kTileRows);
  set(KVMESH_TILE_A_LAST, last_rows);
  for (int64_t t = 0; t < row_tiles; ++t) {
    set(3 + static_cast<int>(t), t + 1 == row_tiles ? last_rows : kTileRows);
  }
  return config;
}

// Accumulator `row_tile` += (its 16 rows of x, 32 features) x tile B.
inline void multiply_row_tile(int64_t row_tile, bool last, const uint16_t* x, int64_t x_stride) {
#define KVMESH_MULTIPLY(C)                                 \
  if (last) {                                              \
    _tile_loadd(KVMESH_TILE_A_LAST, x, x_stride);          \
    _tile_dpbf16ps(C, KVMESH_TILE_A_LAST, KVMESH_TILE_B);  \
  } else {                                                 \
    _tile_loadd(KVMESH_TILE_A, x, x_stride);               \
    _tile_dpbf16ps(C, KVMESH_TILE_A, KVMESH_TILE_B);       \
  }                                                        \
  break;
  switch (row_tile) {
    case 0: KVMESH_MULTIPLY(3)
    case 1: KVMESH_MULTIPLY(4)
    case 2: KVMESH_MULTIPLY(5)
    default: KVMESH_MULTIPLY(6)
  }
#undef KVMESH_MULTIPLY
}

inline void store_row_tile(int64_t row_tile, float* out) {
  kvmesh::store_tile(3 + static_cast<int>(row_tile), out, kLanes * sizeof(float));
}

// One panel (16 outputs) for all M bfloat16 rows on AMX tiles: each 32-feature
// block's weights are rebuilt from the codes exactly as panel_tile_bf16
// rebuilds them (weight_pairs: one B-tile row per pair of features) into a
// 1 KB buffer, then multiplied against up to four 16-row tiles of x with
// tdpbf16ps (float32 accumulators, each rebuilt block reused by every row
// tile of the pass; more than 64 rows take further passes, rebuilding again).
// The tile configuration is this thread's, set per panel and released after,
// since oneDNN's matmuls configure tiles of their own on the same threads.
void panel_amx_bf16(const uint16_t* x, int64_t M, int64_t K, const uint8_t* codes,
                    const uint8_t* next_codes, const float* scales, const float* offsets,
                    uint16_t* y, int64_t ldy, int64_t valid_lanes) {
  // Two buffers, alternating by block, so that rebuilding block kb + 1 need
  // not wait for the tile load of block kb.
  alignas(64) uint16_t b_tiles[2][kCodeBlock * kLanes];
  alignas(64) float out[kPassRows * kLanes];
  const int64_t x_stride = K * static_cast<int64_t>(sizeof(uint16_t));
  for (int64_t m0 = 0; m0 < M; m0 += kPassRows) {
    const int64_t rows = std::min(kPassRows, M - m0);
    const int64_t row_tiles = (rows + kTileRows - 1) / kTileRows;
    const TileConfig config = pass_config(rows);
    compiler_barrier();
    _tile_loadconfig(&config);  // also zeroes every tile: the accumulators start at 0
    for (int64_t kb = 0; kb < K / kCodeBlock; ++kb) {
      const PairScales s = pair_scales(scales + kb * kLanes, offsets + kb * kLanes);
      if (m0 == 0) prefetch_codes(codes, next_codes, K, kb);
      uint16_t* b = b_tiles[kb & 1];
      for (int64_t pair = 0; pair < kCodeBlock / 2; ++pair) {
        const uint8_t* codes_k = codes + (kb * kCodeBlock + 2 * pair) * kLanes;
        _mm512_store_si512(b + pair * 2 * kLanes, (__m512i)weight_pairs(codes_k, s));
      }
      compiler_barrier();
      _tile_loadd(KVMESH_TILE_B, b, kTileBytesPerRow);
      for (int64_t t = 0; t < row_tiles; ++t) {
        multiply_row_tile(t, t + 1 == row_tiles, x + (m0 + t * kTileRows) * K + kb * kCodeBlock,
                          x_stride);
      }
    }
    for (int64_t t = 0; t < row_tiles; ++t) store_row_tile(t, out + t * kTileRows * kLanes);
    _tile_release();
    for (int64_t m = 0; m < rows; ++m) {
      store_bf16_row(y + (m0 + m) * ldy, _mm512_load_ps(out + m * kLanes), valid_lanes);
    }
  }
}
#endif  // AMX
#else
constexpr bool kBf16Activations = false;
#endif

at::Tensor block_code_linear(const at::Tensor& x, const at::Tensor& codes,
                             const at::Tensor& scales, const at::Tensor& offsets,
                             int64_t out_features) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.scalar_type() == at::kFloat || (bf16 && kBf16Activations),
              "block_code_linear: x must be float32",
              kBf16Activations ? " or bfloat16" : " (bfloat16 needs the avx512_bf16 level)",
              ", not ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(),
              "block_code_linear: x must be a contiguous [M, K] tensor");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 3 && codes.is_contiguous() &&
                  codes.size(2) == kLanes,
              "block_code_linear: codes must be contiguous uint8 [panels, K, 16]");
  const int64_t M = x.size(0), K = x.size(1), panels = codes.size(0);
  TORCH_CHECK(codes.size(1) == K, "block_code_linear: x has ", K, " features, codes ",
              codes.size(1));
  TORCH_CHECK(K % kCodeBlock == 0, "block_code_linear: K must be a multiple of 32");
  for (const at::Tensor* t : {&scales, &offsets}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 &&
                    t->size(0) == panels && t->size(1) == K / kCodeBlock && t->size(2) == kLanes,
                "block_code_linear: scales and offsets must be contiguous float32 "
                "[panels, K / 32, 16]");
  }
  TORCH_CHECK(out_features > (panels - 1) * kLanes && out_features <= panels * kLanes,
              "block_code_linear: out_features ", out_features, " does not match ", panels,
              " panels");

  at::Tensor y = at::empty({M, out_features}, x.options());
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* op = offsets.data_ptr<float>();
  const int64_t blocks = K / kCodeBlock;
  const void* x_data = x.data_ptr();  // float or bfloat16, as y
  void* y_data = y.data_ptr();

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (bf16) kvmesh::require_amx_permission("block_code_linear");
#endif
  kvmesh::parallel_items(panels, [&](int64_t p, bool forward) {
    const int64_t n0 = p * kLanes;
    const int64_t valid = std::min(kLanes, out_features - n0);
    // The panel this thread most likely takes next, for the prefetcher.
    const int64_t next = forward ? p + 1 : p - 1;
    const uint8_t* next_codes = next >= 0 && next < panels ? cp + next * K * kLanes : nullptr;
    const uint8_t* panel_codes = cp + p * K * kLanes;
    const float* panel_scales = sp + p * blocks * kLanes;
    const float* panel_offsets = op + p * blocks * kLanes;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (bf16) {
      panel_amx_bf16(static_cast<const uint16_t*>(x_data), M, K, panel_codes, next_codes,
                     panel_scales, panel_offsets, static_cast<uint16_t*>(y_data) + n0,
                     out_features, valid);
      return;
    }
#endif
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
      const int64_t rows = std::min(kMaxRows, M - m0);
#if defined(__AVX512BF16__)
      if (bf16) {
        const auto* xp = static_cast<const uint16_t*>(x_data);
        auto* yp = static_cast<uint16_t*>(y_data);
        kTilesBf16[rows - 1](xp + m0 * K, K, panel_codes, next_codes, panel_scales,
                             panel_offsets, yp + m0 * out_features + n0, out_features, valid);
        continue;
      }
#endif
      kTiles[rows - 1](static_cast<const float*>(x_data) + m0 * K, K, panel_codes, next_codes,
                       panel_scales, panel_offsets,
                       static_cast<float*>(y_data) + m0 * out_features + n0, out_features, valid);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def(
      "block_code_linear(Tensor x, Tensor codes, Tensor scales, Tensor offsets, "
      "int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("block_code_linear", &block_code_linear); }
