// Rows times one panel of 16 output features, the panel a [K][16] block of
// words (bfloat16 words widened exactly, or float32): the small-batch loop of
// bf16_weight_linear.cpp (dense projections) and fused_moe_cpu.cpp (experts).
//
// Each output is one chain of fused multiply-adds over k in order, from zero,
// with one accumulator per (row, feature) whatever the other rows: a row's
// result does not depend on the batch, and it is bitwise what the blocked GEMM
// of float_gemm_avx2.h gives (the same chains, sliced over k). The AVX-512 and
// AVX2 loops run the same operations in the same order (one 16-lane register,
// or two 8-lane halves), the portable loop too (std::fma), so every level
// gives the same bits.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace kvmesh::panel {

constexpr int64_t kLanes = 16;
#if defined(__AVX512F__) || !defined(__AVX2__)
constexpr int64_t kMaxRows = 12;  // rows per register tile: 12 accumulators (of 32 zmm)
#else
constexpr int64_t kMaxRows = 6;  // 2 accumulators per row in 16 ymm registers
#endif
// Features ahead to prefetch (32 bytes each): 2 KB. The panels stream from DRAM
// once per step; the next panel is laid out right after this one.
constexpr int64_t kPrefetchAhead = 64;

// One 64-byte line per 64 / (16 * sizeof(Word)) features: every feature of
// float32 panels, every second one of bfloat16 words.
template <class Word>
inline void prefetch_words(const Word* panel, int64_t k) {
#if defined(__AVX512F__) || defined(__AVX2__)
  // Past this panel's end is the next one's start (or past the tensor for the
  // last panel: prefetches never fault).
  constexpr int64_t kEvery = 64 / (kLanes * static_cast<int64_t>(sizeof(Word)));
  if (k % kEvery == 0) {
    _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kPrefetchAhead) * kLanes),
                 _MM_HINT_T0);
  }
#endif
}

// y[m * ldy + l] = sum over k of rows[m][k] * panel[k][l], for l < valid_lanes.
#if defined(__AVX512F__)
// The 16 weights of a feature as float32 (bfloat16 words widened: exact).
inline __m512 load_lanes(const uint16_t* p) {
  const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(words), 16));
}
inline __m512 load_lanes(const float* p) { return _mm512_loadu_ps(p); }

template <class Word, int ROWS>
void panel_tile(const float* const* rows, int64_t K, const Word* panel, float* y, int64_t ldy,
                int64_t valid_lanes) {
  __m512 acc[ROWS];
  for (int m = 0; m < ROWS; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    prefetch_words(panel, k);
    const __m512 w = load_lanes(panel + k * kLanes);
    for (int m = 0; m < ROWS; ++m) acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(rows[m][k]), w, acc[m]);
  }
  const __mmask16 mask = valid_lanes >= kLanes ? 0xFFFF : (__mmask16)((1u << valid_lanes) - 1);
  for (int m = 0; m < ROWS; ++m) _mm512_mask_storeu_ps(y + m * ldy, mask, acc[m]);
}
#elif defined(__AVX2__) && defined(__FMA__)
// The 16 weights of a feature as two halves of float32 (words widened: exact).
inline void load_lanes(const uint16_t* p, __m256& lo, __m256& hi) {
  const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(words)), 16));
  hi = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(words, 1)), 16));
}
inline void load_lanes(const float* p, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(p);
  hi = _mm256_loadu_ps(p + 8);
}

template <class Word, int ROWS>
void panel_tile(const float* const* rows, int64_t K, const Word* panel, float* y, int64_t ldy,
                int64_t valid_lanes) {
  __m256 acc_lo[ROWS], acc_hi[ROWS];
  for (int m = 0; m < ROWS; ++m) acc_lo[m] = acc_hi[m] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    prefetch_words(panel, k);
    __m256 w_lo, w_hi;
    load_lanes(panel + k * kLanes, w_lo, w_hi);
    for (int m = 0; m < ROWS; ++m) {
      const __m256 xv = _mm256_set1_ps(rows[m][k]);
      acc_lo[m] = _mm256_fmadd_ps(xv, w_lo, acc_lo[m]);
      acc_hi[m] = _mm256_fmadd_ps(xv, w_hi, acc_hi[m]);
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
inline float widen(uint16_t word) {
  const uint32_t bits = static_cast<uint32_t>(word) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

inline float widen(float value) { return value; }

template <class Word, int ROWS>
void panel_tile(const float* const* rows, int64_t K, const Word* panel, float* y, int64_t ldy,
                int64_t valid_lanes) {
  float acc[ROWS][kLanes] = {};
  float w[kLanes];
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t l = 0; l < kLanes; ++l) w[l] = widen(panel[k * kLanes + l]);
    for (int m = 0; m < ROWS; ++m) {
      const float xv = rows[m][k];
#pragma omp simd
      for (int64_t l = 0; l < kLanes; ++l) acc[m][l] = std::fma(xv, w[l], acc[m][l]);
    }
  }
  for (int m = 0; m < ROWS; ++m) {
    for (int64_t l = 0; l < valid_lanes; ++l) y[m * ldy + l] = acc[m][l];
  }
}
#endif

template <class Word>
using TileFn = void (*)(const float* const*, int64_t, const Word*, float*, int64_t, int64_t);

template <class Word, int... R>
constexpr auto make_tiles(std::integer_sequence<int, R...>) {
  return std::array<TileFn<Word>, sizeof...(R)>{&panel_tile<Word, R + 1>...};
}
template <class Word>
inline constexpr auto kTiles = make_tiles<Word>(std::make_integer_sequence<int, kMaxRows>{});

// `count` rows (pointers) times one panel, kMaxRows rows per register tile:
// the panel stays in L1/L2 after the first tile.
template <class Word>
inline void rows_times_panel(const float* const* rows, int64_t count, int64_t K,
                             const Word* panel, float* y, int64_t ldy, int64_t valid_lanes) {
  for (int64_t m0 = 0; m0 < count; m0 += kMaxRows) {
    const int64_t tile = std::min(kMaxRows, count - m0);
    kTiles<Word>[tile - 1](rows + m0, K, panel, y + m0 * ldy, ldy, valid_lanes);
  }
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// Widens the k slice [k0, k0 + kc) of `count` bfloat16-word panels (panel j at
// first + j * stride words) into [count][kc][16] floats: the blocked GEMM's
// view of a slice (float_gemm_avx2.h).
inline void widen_slice(const uint16_t* first, int64_t stride, int64_t count, int64_t k0,
                        int64_t kc, float* out) {
  for (int64_t j = 0; j < count; ++j) {
    const uint16_t* src = first + j * stride + k0 * kLanes;
    float* dst = out + j * kc * kLanes;
    for (int64_t i = 0; i < kc * kLanes; i += 8) {
      const __m128i words = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      _mm256_store_ps(dst + i,
                      _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(words), 16)));
    }
  }
}
#endif

}  // namespace kvmesh::panel
