// The cache-blocked float32 GEMM of the AVX2 level, shared by the ops that
// feed it weights in 16-output panels: bf16_weight_linear.cpp (float32 panels
// used in place, bfloat16 words widened a k slice at a time) and
// ggml_float_gemm.cpp (GGUF blocks dequantized a k slice at a time).
//
// The manner of BLIS / GotoBLAS: per chunk of panels and kKc-deep slice of k,
// the caller provides the slice of each panel as [kc][16] float32 (in place,
// or filled into a buffer that stays in L2); x is in 6-row strips (kMr floats
// per k, contiguous), packed once per call (pack_x; gemm_chunk_rows, for rows
// scattered by pointer, copies each kMc-row block's slice instead); per kMc
// rows, the strips' slice stays in L2 while a 6 x 16 register tile (12 ymm
// accumulators) runs over each strip and panel. Measured on the 2-core Zen 2
// (one thread, 2,048 x 1,024 x 4,096 and the other projection shapes of a
// Qwen3 layer): ~92 GFLOP/s, 86% of the FMA peak (107 GFLOP/s per core
// measured by a register-only FMA loop), on one host; 73-79 on another
// (2026-12-06: ~105 peak), where packing x once and prefetching the partial
// sums gained 1.045x on 2 threads (alternating A/B, 3 rounds).
//
// Each output is one chain of fused multiply-adds over k in order, from zero:
// the first k slice starts from zero, each later slice reloads the partial
// sums from y (a store and a load of a float change nothing) and continues.
// So a row's result never depends on the other rows of the call, and it is
// bitwise what a plain per-row loop of fused multiply-adds over k gives.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <utility>

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

namespace kvmesh::float_gemm {

constexpr int64_t kLanes = 16;   // outputs per panel (two ymm of float32)
// Sizes set on the 2-core Zen 2 (32 KB L1d, 512 KB L2 per core), one thread,
// best of 5: kKc 192 / 256 / 384 / 512 / 640 gave ~86 / 89 / 91 / 92 / 92
// GFLOP/s over the Qwen3 shapes; kMc 24 to 72 within 1%.
constexpr int64_t kMr = 6;       // rows per register tile: 12 ymm accumulators
constexpr int64_t kKc = 512;     // depth of a k slice (a multiple of 256: whole GGUF blocks)
// ... but a K up to kMaxKc runs as one slice: a 640-deep K (Gemma 3 bench
// checkpoint) cut 512 + 128 ran its shapes at ~126-128 GFLOP/s on 2 threads,
// in one slice at ~135-141 (the 128-deep slice pays a whole reload of the
// partial sums for a quarter of the work).
constexpr int64_t kMaxKc = 768;
constexpr int64_t kMc = 48;      // rows of x whose strips' k slice stays in L2 at a time
constexpr int64_t kMaxChunkPanels = 16;  // panels (of 16 outputs) per work item

// The depth of K's slices: one slice for K <= kMaxKc, else equal slices of at
// most kKc, each a multiple of `granule` (the last may be shorter).
inline int64_t slice_depth(int64_t K, int64_t granule) {
  if (K <= kMaxKc) return std::max<int64_t>(K, 1);
  const int64_t slices = (K + kKc - 1) / kKc;
  const int64_t even = (K + slices - 1) / slices;
  return std::min(kKc, (even + granule - 1) / granule * granule);
}

using FloatBuffer = std::unique_ptr<float[], decltype(&std::free)>;

// One thread's buffers, kept between calls (a prefill step calls the GEMM
// ~100 times): the filled k slice of a chunk of panels and the strips of x.
struct Scratch {
  FloatBuffer widened{nullptr, &std::free};
  FloatBuffer strips{nullptr, &std::free};
};

// The 64-byte-aligned buffer, allocated on first use with `count` floats (a
// caller asks for the same count every time).
inline float* aligned_floats(FloatBuffer& buffer, int64_t count) {
  if (buffer == nullptr) {
    buffer.reset(static_cast<float*>(std::aligned_alloc(64, count * sizeof(float))));
    TORCH_CHECK(buffer != nullptr, "float GEMM: out of memory for scratch");
  }
  return buffer.get();
}

// acc[r] (+)= strip[k][r] * w[k][0:16] over k < kc, rows < ROWS; y rows at
// stride ldy. `resume`: start from the partial sums in y, else from zero.
template <int ROWS>
void gemm_tile(int64_t kc, const float* __restrict strip, const float* __restrict w, float* y,
               int64_t ldy, bool resume) {
  // Every loop over the rows unrolled by pragma: gcc keeps the accumulators in
  // registers only when the loops are gone before it splits the arrays (else
  // it stores all 12 to the stack every k: half the speed).
  __m256 lo[ROWS], hi[ROWS];
  if (resume) {
#pragma GCC unroll 16
    for (int r = 0; r < ROWS; ++r) {
      lo[r] = _mm256_loadu_ps(y + r * ldy);
      hi[r] = _mm256_loadu_ps(y + r * ldy + 8);
    }
  } else {
#pragma GCC unroll 16
    for (int r = 0; r < ROWS; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  }
#pragma GCC unroll 4
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 w_lo = _mm256_loadu_ps(w + k * kLanes);
    const __m256 w_hi = _mm256_loadu_ps(w + k * kLanes + 8);
#pragma GCC unroll 16
    for (int r = 0; r < ROWS; ++r) {
      const __m256 xv = _mm256_broadcast_ss(strip + k * kMr + r);
      lo[r] = _mm256_fmadd_ps(xv, w_lo, lo[r]);
      hi[r] = _mm256_fmadd_ps(xv, w_hi, hi[r]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < ROWS; ++r) {
    _mm256_storeu_ps(y + r * ldy, lo[r]);
    _mm256_storeu_ps(y + r * ldy + 8, hi[r]);
  }
}

using GemmTileFn = void (*)(int64_t, const float*, const float*, float*, int64_t, bool);
template <int... R>
constexpr auto make_gemm_tiles(std::integer_sequence<int, R...>) {
  return std::array<GemmTileFn, sizeof...(R)>{&gemm_tile<R + 1>...};
}
inline constexpr auto kGemmTiles = make_gemm_tiles(std::make_integer_sequence<int, kMr>{});

// Rows [m0, m0 + mc) x k [k0, k0 + kc) of x (row m at row_at(m)) into strips
// [mc / 6][kc][6] (rows past mc in the last strip are zero; their sums are
// never stored).
template <class RowAt>
inline void copy_strips(const RowAt& row_at, int64_t m0, int64_t mc, int64_t k0, int64_t kc,
                        float* out) {
  for (int64_t s = 0; s < mc; s += kMr) {
    const int64_t rows = std::min(kMr, mc - s);
    const float* src[kMr];
    for (int64_t r = 0; r < kMr; ++r) src[r] = r < rows ? row_at(m0 + s + r) + k0 : nullptr;
    float* dst = out + s * kc;
    for (int64_t k = 0; k < kc; ++k) {
      for (int64_t r = 0; r < kMr; ++r) dst[k * kMr + r] = r < rows ? src[r][k] : 0.0f;
    }
  }
}

// The weights of one k slice of a chunk's panels, as the GEMM reads them:
// panel j's [kc][16] floats start at first + j * stride.
struct SliceView {
  const float* first;
  int64_t stride;
};

// Prefetch the partial sums of the tile after (strip s, panel j): they were
// stored a whole k slice ago, and the other row blocks ran since, so they
// are in L3 or DRAM; a tile's reload stalling on them cost ~8% of the GEMM
// (2-core Zen 2, 2,048 rows, the Qwen3 projection shapes).
inline void prefetch_next_tile(const float* y, int64_t ldy, int64_t m0, int64_t mc, int64_t s,
                               int64_t j, int64_t count, int64_t n0) {
  const bool last_strip = s + kMr >= mc;
  if (last_strip && j + 1 == count) return;
  const int64_t next_s = last_strip ? 0 : s + kMr;
  const int64_t next_n0 = last_strip ? n0 + kLanes : n0;
  const int64_t rows = std::min(kMr, mc - next_s);
  for (int64_t r = 0; r < rows; ++r) {
    // 16 outputs of float32: one 64-byte line when y's rows are aligned.
    _mm_prefetch(reinterpret_cast<const char*>(y + (m0 + next_s + r) * ldy + next_n0),
                 _MM_HINT_T0);
  }
}

// The tiles of one k slice over rows [m0, m0 + mc) and a chunk's panels: the
// strip of rows [m0 + s, m0 + s + 6) starts at strip_at(s) ([kc][6] floats at
// stride 6). y has ldy columns and starts at the chunk's first output.
template <class StripAt>
inline void tiles_over_block(const StripAt& strip_at, int64_t m0, int64_t mc, int64_t kc,
                             bool resume, const SliceView& view, int64_t count, int64_t cols,
                             float* y, int64_t ldy) {
  alignas(32) float edge[kMr * kLanes];  // a ragged last panel's tile
  for (int64_t j = 0; j < count; ++j) {
    const int64_t n0 = j * kLanes;
    const int64_t valid = std::min(kLanes, cols - n0);
    const float* w = view.first + j * view.stride;
    for (int64_t s = 0; s < mc; s += kMr) {
      const int64_t rows = std::min(kMr, mc - s);
      float* out = y + (m0 + s) * ldy + n0;
      if (resume) prefetch_next_tile(y, ldy, m0, mc, s, j, count, n0);
      if (valid == kLanes) {
        kGemmTiles[rows - 1](kc, strip_at(s), w, out, ldy, resume);
        continue;
      }
      for (int64_t r = 0; r < rows && resume; ++r) {
        std::memcpy(edge + r * kLanes, out + r * ldy, valid * sizeof(float));
      }
      kGemmTiles[rows - 1](kc, strip_at(s), w, edge, kLanes, resume);
      for (int64_t r = 0; r < rows; ++r) {
        std::memcpy(out + r * ldy, edge + r * kLanes, valid * sizeof(float));
      }
    }
  }
}

// The loop both GEMM forms share: per k slice (slice_depth, in order of k;
// slice(k0, kc) called once each), per kMc-row block of x,
// block(m0, mc, k0, kc, view).
template <class SliceFn, class BlockFn>
inline void for_each_block(int64_t M, int64_t K, int64_t granule, SliceFn& slice,
                           const BlockFn& block) {
  const int64_t depth = slice_depth(K, granule);
  for (int64_t k0 = 0; k0 < K; k0 += depth) {
    const int64_t kc = std::min(depth, K - k0);
    const SliceView view = slice(k0, kc);
    for (int64_t m0 = 0; m0 < M; m0 += kMc) block(m0, std::min(kMc, M - m0), k0, kc, view);
  }
}

// y[:M, 0 .. cols) = x[:M] Wᵀ for one chunk of `count` panels (cols > 16 (count
// - 1) outputs: only the last panel may be ragged), row m of x at row_at(m);
// y has ldy columns and starts at the chunk's first output. slice(k0, kc)
// provides each k slice's panels (SliceView), called once per slice in order
// of k; a slice starts at a multiple of `granule` (slice_depth) and is at most
// kMaxKc deep. Copies each kMc-row block of x into strips for every chunk: for a
// call whose x is used by many chunks, pack_strips once and gemm_chunk_packed.
template <class RowAt, class SliceFn>
void gemm_chunk_rows(const RowAt& row_at, int64_t M, int64_t K, int64_t count, int64_t cols,
                     float* y, int64_t ldy, int64_t granule, Scratch& scratch, SliceFn&& slice) {
  float* strips = aligned_floats(scratch.strips, kMc * kMaxKc);
  for_each_block(M, K, granule, slice,
                 [&](int64_t m0, int64_t mc, int64_t k0, int64_t kc, const SliceView& view) {
                   copy_strips(row_at, m0, mc, k0, kc, strips);
                   tiles_over_block([strips, kc](int64_t s) { return strips + s * kc; }, m0, mc,
                                    kc, k0 > 0, view, count, cols, y, ldy);
                 });
}

// x packed whole: strip i holds rows [6 i, 6 i + 6) as [K][6] floats (rows past
// M are zero), strip i at 6 K i.
inline int64_t strip_count(int64_t M) { return (M + kMr - 1) / kMr; }

// Strips [first, last) of x (row m at row_at(m)) into `packed`.
template <class RowAt>
void pack_strips(const RowAt& row_at, int64_t M, int64_t K, int64_t first, int64_t last,
                 float* packed) {
  for (int64_t i = first; i < last; ++i) {
    const int64_t rows = std::min(kMr, M - i * kMr);
    const float* src[kMr];
    for (int64_t r = 0; r < kMr; ++r) src[r] = r < rows ? row_at(i * kMr + r) : nullptr;
    float* dst = packed + i * K * kMr;
    if (rows == kMr) {
      for (int64_t k = 0; k < K; ++k) {
#pragma GCC unroll 6
        for (int64_t r = 0; r < kMr; ++r) dst[k * kMr + r] = src[r][k];
      }
      continue;
    }
    for (int64_t k = 0; k < K; ++k) {
      for (int64_t r = 0; r < kMr; ++r) dst[k * kMr + r] = r < rows ? src[r][k] : 0.0f;
    }
  }
}

// gemm_chunk_rows over x already packed (pack_strips): x is copied once per
// call instead of once per chunk of panels (a chunk is 256 outputs, so a
// 4,096-output projection copied x 16 times: ~1/8 of the GEMM's time).
template <class SliceFn>
void gemm_chunk_packed(const float* packed, int64_t M, int64_t K, int64_t count, int64_t cols,
                       float* y, int64_t ldy, int64_t granule, SliceFn&& slice) {
  for_each_block(M, K, granule, slice,
                 [&](int64_t m0, int64_t mc, int64_t k0, int64_t kc, const SliceView& view) {
                   const float* block = packed + (m0 / kMr) * K * kMr + k0 * kMr;
                   tiles_over_block(
                       [block, K](int64_t s) { return block + (s / kMr) * K * kMr; }, m0, mc, kc,
                       k0 > 0, view, count, cols, y, ldy);
                 });
}

// x [M, K] at row stride ldx packed into strips (pack_strips), on torch's
// intra-op threads; for gemm_chunk_packed. The strips live in the calling
// thread's buffer, kept and grown to the largest call: a fresh allocation per
// call (25 MB at 2,048 x 3,072) was page-faulted in again on most calls, ~6,000
// faults each. Valid until the thread's next pack_x.
inline const float* pack_x(const float* x, int64_t ldx, int64_t M, int64_t K) {
  thread_local FloatBuffer buffer{nullptr, &std::free};
  thread_local int64_t capacity = 0;  // floats
  const int64_t strips = strip_count(M);
  const int64_t floats = std::max<int64_t>(1, strips * K * kMr);
  if (floats > capacity) {
    // aligned_alloc wants a multiple of the alignment.
    const int64_t bytes = (floats * 4 + 63) / 64 * 64;
    buffer.reset(static_cast<float*>(std::aligned_alloc(64, bytes)));
    TORCH_CHECK(buffer != nullptr, "float GEMM: out of memory for the packed rows");
    capacity = floats;
  }
  float* packed = buffer.get();
  const auto row_at = [x, ldx](int64_t m) { return x + m * ldx; };
  at::parallel_for(0, strips, 8, [&](int64_t begin, int64_t end) {
    pack_strips(row_at, M, K, begin, end, packed);
  });
  return packed;
}

// Panels per work item: at least two items per thread (a box shared with
// other processes steals from the slow one), at most kMaxChunkPanels.
inline int64_t panels_per_item(int64_t num_panels, int64_t threads) {
  threads = std::max<int64_t>(1, threads);
  return std::clamp<int64_t>((num_panels + 2 * threads - 1) / (2 * threads), 1, kMaxChunkPanels);
}

}  // namespace kvmesh::float_gemm
#endif
