// y = x Wᵀ in float32 with W kept as a GGUF file's blocks (every type of
// ggml_blocks.h: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; a fused
// projection's segments of mixed types in one call), for batches of rows:
// each k slice of a chunk of 16-output panels is dequantized ONCE per call
// into float32 panels in a thread-local buffer (L2), and the blocked GEMM's
// 6 x 16 micro-kernel (float_gemm_avx2.h) runs every row of x over them.
//
// Why: a decode batch of 8-64 rows on int8 activations (ggml_q8_panel.cpp)
// pays two integer multiplies per 32 weights per row on AVX2 without VNNI
// (~4.4 cycles per 32 weights and row); float32 FMAs over panels in L2 run at
// ~2.4 cycles per 32 weight-row products, so once the dequantization (paid
// once per weight, whatever the batch) is spread over a few rows, the float
// GEMM wins. It also replaces the prefill path that rebuilt row tiles into
// scratch and called oneDNN on them (worker/models/ggml_linear.py).
//
// Numerics: the weights are exactly the gguf package's dequantization
// (ggml_dequant.h; this file compiles with -ffp-contract=off for it), and
// each output is one chain of fused multiply-adds over k in order from zero
// (float_gemm_avx2.h): a row's result does not depend on the other rows of the
// call, and equals float_panel_linear over the same dequantized weights.
//
// Work items are chunks of panels of one segment (columns of y); a slice of
// 16 weight rows becomes the panel layout [k][16] a run of 32 weights at a
// time: the rows' codes unpacked to bytes (ggml_codes_avx2.h), transposed as
// bytes, then widened and scaled 16 rows per k with the same float32
// operations as ggml_dequant.h (which the portable path uses directly).

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "float_gemm_avx2.h"
#include "ggml_codes_avx2.h"
#include "ggml_blocks.h"
#include "ggml_dequant.h"
#include "work_stealing.h"

namespace {

using namespace kvmesh::ggml;

constexpr int64_t kPanel = 16;       // outputs per panel

// Where rows [row0, row0 + rows) of one segment sit: blocks and their format.
struct RowRange {
  const uint8_t* base;  // the segment's first row
  int64_t kind;
  Format format;
  int64_t row_bytes;
};

// fn(std::integral_constant<int64_t, KIND>{}) for a segment's ggml type: one
// switch for every per-type template below.
template <typename Fn>
void with_kind(int64_t kind, Fn&& fn) {
  switch (kind) {
    case kQ4_0: return fn(std::integral_constant<int64_t, kQ4_0>{});
    case kQ4_1: return fn(std::integral_constant<int64_t, kQ4_1>{});
    case kQ5_0: return fn(std::integral_constant<int64_t, kQ5_0>{});
    case kQ5_1: return fn(std::integral_constant<int64_t, kQ5_1>{});
    case kQ8_0: return fn(std::integral_constant<int64_t, kQ8_0>{});
    case kQ4_K: return fn(std::integral_constant<int64_t, kQ4_K>{});
    case kQ5_K: return fn(std::integral_constant<int64_t, kQ5_K>{});
    case kQ6_K: return fn(std::integral_constant<int64_t, kQ6_K>{});
    default: TORCH_CHECK(false, "ggml_float_gemm: unsupported ggml type ", kind);
  }
}

#if !(defined(__AVX2__) && defined(__FMA__))
// Rows [r0, r0 + n) (n <= 16; rows past n are zeros) x k [k0, k0 + len) into
// rowbuf [16][len] floats. KIND a constant: dequant_block's switch folds away
// and the block's code inlines into the loop (a call per 32 weights cost
// ~10% of the GEMM at 8 rows of x).
template <int64_t KIND>
void dequant_rows_of(const RowRange& seg, int64_t r0, int64_t n, int64_t k0, int64_t len,
                     float* rowbuf) {
  constexpr Format f = block_format(KIND);
  const int64_t first_block = k0 / f.weights, blocks = len / f.weights;
  for (int64_t r = 0; r < kPanel; ++r) {
    float* out = rowbuf + r * len;
    if (r >= n) {
      std::memset(out, 0, len * sizeof(float));
      continue;
    }
    const uint8_t* row = seg.base + (r0 + r) * seg.row_bytes + first_block * f.bytes;
    for (int64_t b = 0; b < blocks; ++b) dequant_block(KIND, row + b * f.bytes, out + b * f.weights);
  }
}

void dequant_rows(const RowRange& seg, int64_t r0, int64_t n, int64_t k0, int64_t len,
                  float* rowbuf) {
  with_kind(seg.kind, [&](auto kind) {
    dequant_rows_of<decltype(kind)::value>(seg, r0, n, k0, len, rowbuf);
  });
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
namespace fg = kvmesh::float_gemm;

// Both 16 x 16 byte transposes of rows[0..15] (32 bytes each: columns 0-15
// in the low lane, 16-31 in the high one) at once: out[j] holds column j in
// its low lane and column 16 + j in its high lane (the byte of row i at i).
inline void transpose16x32(const __m256i* rows, __m256i* out) {
  __m256i t[16], u[16];
  for (int p = 0; p < 8; ++p) {
    t[p] = _mm256_unpacklo_epi8(rows[2 * p], rows[2 * p + 1]);      // columns 0-7
    t[p + 8] = _mm256_unpackhi_epi8(rows[2 * p], rows[2 * p + 1]);  // columns 8-15
  }
  for (int h = 0; h < 2; ++h) {
    for (int q = 0; q < 4; ++q) {
      u[8 * h + q] = _mm256_unpacklo_epi16(t[8 * h + 2 * q], t[8 * h + 2 * q + 1]);
      u[8 * h + q + 4] = _mm256_unpackhi_epi16(t[8 * h + 2 * q], t[8 * h + 2 * q + 1]);
    }
  }
  // u[4 g + q]: rows 4q .. 4q + 3 of columns 4g .. 4g + 3.
  for (int g = 0; g < 4; ++g) {
    const __m256i* v = u + 4 * g;
    const __m256i v0 = _mm256_unpacklo_epi32(v[0], v[1]), v1 = _mm256_unpackhi_epi32(v[0], v[1]);
    const __m256i v2 = _mm256_unpacklo_epi32(v[2], v[3]), v3 = _mm256_unpackhi_epi32(v[2], v[3]);
    out[4 * g + 0] = _mm256_unpacklo_epi64(v0, v2);
    out[4 * g + 1] = _mm256_unpackhi_epi64(v0, v2);
    out[4 * g + 2] = _mm256_unpacklo_epi64(v1, v3);
    out[4 * g + 3] = _mm256_unpackhi_epi64(v1, v3);
  }
}

// How a type's code becomes its weight, as gguf's dequantization rounds it
// (ggml_dequant.h): w = a * float(code - kOffset), then + b (Q4_1, Q5_1: the
// block minimum), - b (Q4_K, Q5_K: dmin * m), or nothing.
template <int64_t KIND>
struct CodeMath {
  static constexpr int kOffset = KIND == kQ4_0 ? 8 : KIND == kQ5_0 ? 16 : KIND == kQ6_K ? 32 : 0;
  static constexpr bool kAddB = KIND == kQ4_1 || KIND == kQ5_1;
  static constexpr bool kSubB = KIND == kQ4_K || KIND == kQ5_K;
  static constexpr bool kSigned = KIND == kQ8_0;
};

// Run r of a block: its factors a (weights 0-15 and 16-31: Q6_K has a scale per
// 16 weights) and b, computed as ggml_dequant.h computes them.
template <int64_t KIND>
inline void run_factors(const uint8_t* blk, int r, float& a0, float& a1, float& b) {
  b = 0.0f;
  if constexpr (KIND == kQ4_K || KIND == kQ5_K) {
    uint8_t sc, m;
    scale_min_k4(r, blk + 4, sc, m);
    a0 = a1 = half_at(blk) * static_cast<float>(sc);
    b = half_at(blk + 2) * static_cast<float>(m);
  } else if constexpr (KIND == kQ6_K) {
    const float d = half_at(blk + 208);
    const auto* sc = reinterpret_cast<const int8_t*>(blk + 192);
    a0 = d * static_cast<float>(sc[2 * r]);
    a1 = d * static_cast<float>(sc[2 * r + 1]);
  } else {
    a0 = a1 = half_at(blk);
    if constexpr (CodeMath<KIND>::kAddB) b = half_at(blk + 2);
  }
}

// 16 codes (one k, rows 0-15) as weights: rows 0-7 to dst, 8-15 to dst + 8.
template <int64_t KIND>
inline void put_weights(__m128i codes, __m256 a_lo, __m256 a_hi, __m256 b_lo, __m256 b_hi,
                        float* dst) {
  using M = CodeMath<KIND>;
  const __m128i upper = _mm_unpackhi_epi64(codes, codes);
  __m256i lo = M::kSigned ? _mm256_cvtepi8_epi32(codes) : _mm256_cvtepu8_epi32(codes);
  __m256i hi = M::kSigned ? _mm256_cvtepi8_epi32(upper) : _mm256_cvtepu8_epi32(upper);
  if constexpr (M::kOffset != 0) {
    lo = _mm256_sub_epi32(lo, _mm256_set1_epi32(M::kOffset));
    hi = _mm256_sub_epi32(hi, _mm256_set1_epi32(M::kOffset));
  }
  __m256 w_lo = _mm256_mul_ps(a_lo, _mm256_cvtepi32_ps(lo));
  __m256 w_hi = _mm256_mul_ps(a_hi, _mm256_cvtepi32_ps(hi));
  if constexpr (M::kAddB) {
    w_lo = _mm256_add_ps(w_lo, b_lo);
    w_hi = _mm256_add_ps(w_hi, b_hi);
  } else if constexpr (M::kSubB) {
    w_lo = _mm256_sub_ps(w_lo, b_lo);
    w_hi = _mm256_sub_ps(w_hi, b_hi);
  }
  _mm256_store_ps(dst, w_lo);
  _mm256_store_ps(dst + 8, w_hi);
}

// Panel layout [count][kc][16] of rows [r0, r0 + rows) x k [k0, k0 + kc), a run
// of 32 weights at a time: the 16 rows' codes of the run unpacked to bytes
// (ggml_codes_avx2.h), transposed as bytes (16 rows -> 16 lanes per k), then
// widened, offset and scaled per row. Against dequantizing rows in float32
// and transposing those 8 x 8 (the first version), one Q4_K_M layer at 4 rows
// of x went from 1.31-1.52 to 1.08-1.17 ms (docs/performance.md).
template <int64_t KIND>
void fill_slice_of(const RowRange& seg, int64_t r0, int64_t rows, int64_t k0, int64_t kc,
                   float* panels) {
  constexpr Format f = block_format(KIND);
  constexpr int64_t kRunsPerBlock = f.weights / 32;
  const int64_t count = (rows + kPanel - 1) / kPanel;
  alignas(32) __m256i codes[kPanel], columns[kPanel];
  alignas(32) float a[2][kPanel], b[kPanel];
  for (int64_t j = 0; j < count; ++j) {
    float* panel = panels + j * kc * kPanel;
    const int64_t n = std::min(kPanel, rows - j * kPanel);
    for (int64_t r = n; r < kPanel; ++r) {
      codes[r] = _mm256_setzero_si256();
      a[0][r] = a[1][r] = b[r] = 0.0f;
    }
    for (int64_t k = 0; k < kc; k += 32) {
      const int64_t run = (k0 + k) / 32;
      const int64_t block = run / kRunsPerBlock;
      const int in_block = static_cast<int>(run % kRunsPerBlock);
      for (int64_t r = 0; r < n; ++r) {
        const uint8_t* blk = seg.base + (r0 + j * kPanel + r) * seg.row_bytes + block * f.bytes;
        codes[r] = run_codes_avx2<KIND>(blk, in_block);
        run_factors<KIND>(blk, in_block, a[0][r], a[1][r], b[r]);
      }
      transpose16x32(codes, columns);
      const __m256 b_lo = _mm256_load_ps(b), b_hi = _mm256_load_ps(b + 8);
      float* dst = panel + k * kPanel;
      for (int h = 0; h < 2; ++h) {  // weights 0-15 of the run, then 16-31
        const __m256 a_lo = _mm256_load_ps(a[h]), a_hi = _mm256_load_ps(a[h] + 8);
        for (int c = 0; c < 16; ++c) {
          const __m128i col = h == 0 ? _mm256_castsi256_si128(columns[c])
                                     : _mm256_extracti128_si256(columns[c], 1);
          put_weights<KIND>(col, a_lo, a_hi, b_lo, b_hi, dst + (16 * h + c) * kPanel);
        }
      }
    }
  }
}

void fill_slice(const RowRange& seg, int64_t r0, int64_t rows, int64_t k0, int64_t kc,
                float* panels) {
  with_kind(seg.kind, [&](auto kind) {
    fill_slice_of<decltype(kind)::value>(seg, r0, rows, k0, kc, panels);
  });
}
#endif

at::Tensor ggml_float_gemm(const at::Tensor& x, at::TensorList blocks, at::IntArrayRef kinds) {
  constexpr const char* kOp = "ggml_float_gemm";
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.stride(1) == 1,
              kOp, ": x must be float32 [M, K] with unit feature stride");
  TORCH_CHECK(blocks.size() == kinds.size() && !blocks.empty(),
              kOp, ": one ggml type per block tensor");
  const int64_t M = x.size(0), K = x.size(1), ldx = x.stride(0);
  for (size_t s = 0; s < blocks.size(); ++s) check_segment(blocks[s], kinds[s], K, kOp);
  int64_t total_panels = 0;
  for (const at::Tensor& b : blocks) total_panels += (b.size(0) + kPanel - 1) / kPanel;
  std::vector<RowRange> segments;
  for (size_t s = 0; s < blocks.size(); ++s) {
    const Format f = block_format(kinds[s]);
    segments.push_back({blocks[s].data_ptr<uint8_t>(), kinds[s], f, K / f.weights * f.bytes});
  }
#if defined(__AVX2__) && defined(__FMA__)
  const int64_t per_item = fg::panels_per_item(total_panels, at::get_num_threads());
#else
  const int64_t per_item = 1;
#endif
  const SegmentItems items(blocks, per_item * kPanel);
  const int64_t N = items.rows();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
#if defined(__AVX2__) && defined(__FMA__)
  // x into strips once, read by every item.
  const float* packed = fg::pack_x(xp, ldx, M, K);
#endif
  kvmesh::parallel_items(items.items(), [&](int64_t i, bool /*forward*/) {
    const SegmentItems::Item item = items.item(i);
    const RowRange& seg = segments[item.segment];
    float* out = yp + items.first_row(item.segment) + item.row0;
#if defined(__AVX2__) && defined(__FMA__)
    thread_local fg::Scratch scratch;
    const int64_t count = (item.rows + kPanel - 1) / kPanel;
    fg::gemm_chunk_packed(packed, M, K, count, item.rows, out, N, /*granule=*/256,
                          [&](int64_t k0, int64_t kc) -> fg::SliceView {
                            float* panels = fg::aligned_floats(
                                scratch.widened, fg::kMaxChunkPanels * fg::kMaxKc * kPanel);
                            fill_slice(seg, item.row0, item.rows, k0, kc, panels);
                            return {panels, kc * kPanel};
                          });
#else
    // Portable: the same chains (one fused multiply-add per k, in order, from
    // zero) over whole rows of dequantized weights.
    thread_local std::vector<float> w;
    if (static_cast<int64_t>(w.size()) < kPanel * K) w.resize(kPanel * K);
    for (int64_t r0 = 0; r0 < item.rows; r0 += kPanel) {
      const int64_t n = std::min(kPanel, item.rows - r0);
      dequant_rows(seg, item.row0 + r0, n, 0, K, w.data());
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t r = 0; r < n; ++r) {
          float acc = 0.0f;
          for (int64_t k = 0; k < K; ++k) acc = std::fma(xp[m * ldx + k], w[r * K + k], acc);
          out[m * N + r0 + r] = acc;
        }
      }
    }
#endif
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("ggml_float_gemm(Tensor x, Tensor[] blocks, int[] kinds) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("ggml_float_gemm", &ggml_float_gemm); }
