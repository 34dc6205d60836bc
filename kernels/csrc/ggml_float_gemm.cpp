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
// 16 weight rows is dequantized row-major 256 weights at a time (16 KB, L1)
// and transposed 8 x 8 into the panel layout [k][16].

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "float_gemm_avx2.h"
#include "ggml_blocks.h"
#include "ggml_dequant.h"
#include "work_stealing.h"

namespace {

using namespace kvmesh::ggml;

constexpr int64_t kPanel = 16;       // outputs per panel
constexpr int64_t kSubSlice = 256;   // weights per row dequantized before a transpose

// Where rows [row0, row0 + rows) of one segment sit: blocks and their format.
struct RowRange {
  const uint8_t* base;  // the segment's first row
  int64_t kind;
  Format format;
  int64_t row_bytes;
};

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
  switch (seg.kind) {
    case kQ4_0: return dequant_rows_of<kQ4_0>(seg, r0, n, k0, len, rowbuf);
    case kQ4_1: return dequant_rows_of<kQ4_1>(seg, r0, n, k0, len, rowbuf);
    case kQ5_0: return dequant_rows_of<kQ5_0>(seg, r0, n, k0, len, rowbuf);
    case kQ5_1: return dequant_rows_of<kQ5_1>(seg, r0, n, k0, len, rowbuf);
    case kQ8_0: return dequant_rows_of<kQ8_0>(seg, r0, n, k0, len, rowbuf);
    case kQ4_K: return dequant_rows_of<kQ4_K>(seg, r0, n, k0, len, rowbuf);
    case kQ5_K: return dequant_rows_of<kQ5_K>(seg, r0, n, k0, len, rowbuf);
    case kQ6_K: return dequant_rows_of<kQ6_K>(seg, r0, n, k0, len, rowbuf);
    default: TORCH_CHECK(false, "ggml_float_gemm: unsupported ggml type ", seg.kind);
  }
}

#if defined(__AVX2__) && defined(__FMA__)
namespace fg = kvmesh::float_gemm;

// 8 rows x 8 floats (rows of src at stride lds) -> 8 k of dst (rows at stride 16).
inline void transpose8(const float* src, int64_t lds, float* dst) {
  const __m256 r0 = _mm256_loadu_ps(src), r1 = _mm256_loadu_ps(src + lds),
               r2 = _mm256_loadu_ps(src + 2 * lds), r3 = _mm256_loadu_ps(src + 3 * lds),
               r4 = _mm256_loadu_ps(src + 4 * lds), r5 = _mm256_loadu_ps(src + 5 * lds),
               r6 = _mm256_loadu_ps(src + 6 * lds), r7 = _mm256_loadu_ps(src + 7 * lds);
  const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1),
               t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3),
               t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5),
               t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE),
               u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE),
               u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE),
               u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  _mm256_store_ps(dst + 0 * kPanel, _mm256_permute2f128_ps(u0, u4, 0x20));
  _mm256_store_ps(dst + 1 * kPanel, _mm256_permute2f128_ps(u1, u5, 0x20));
  _mm256_store_ps(dst + 2 * kPanel, _mm256_permute2f128_ps(u2, u6, 0x20));
  _mm256_store_ps(dst + 3 * kPanel, _mm256_permute2f128_ps(u3, u7, 0x20));
  _mm256_store_ps(dst + 4 * kPanel, _mm256_permute2f128_ps(u0, u4, 0x31));
  _mm256_store_ps(dst + 5 * kPanel, _mm256_permute2f128_ps(u1, u5, 0x31));
  _mm256_store_ps(dst + 6 * kPanel, _mm256_permute2f128_ps(u2, u6, 0x31));
  _mm256_store_ps(dst + 7 * kPanel, _mm256_permute2f128_ps(u3, u7, 0x31));
}

// Panel layout [count][kc][16] of rows [r0, r0 + rows) x k [k0, k0 + kc).
void fill_slice(const RowRange& seg, int64_t r0, int64_t rows, int64_t k0, int64_t kc,
                float* rowbuf, float* panels) {
  const int64_t count = (rows + kPanel - 1) / kPanel;
  for (int64_t j = 0; j < count; ++j) {
    float* panel = panels + j * kc * kPanel;
    const int64_t n = std::min(kPanel, rows - j * kPanel);
    // kc and kSubSlice are whole blocks (kc: kKc or the rest of K; K whole blocks).
    for (int64_t s = 0; s < kc; s += kSubSlice) {
      const int64_t len = std::min(kSubSlice, kc - s);
      dequant_rows(seg, r0 + j * kPanel, n, k0 + s, len, rowbuf);
      for (int64_t k = 0; k < len; k += 8) {
        transpose8(rowbuf + k, len, panel + (s + k) * kPanel);
        transpose8(rowbuf + 8 * len + k, len, panel + (s + k) * kPanel + 8);
      }
    }
  }
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
  kvmesh::parallel_items(items.items(), [&](int64_t i, bool /*forward*/) {
    const SegmentItems::Item item = items.item(i);
    const RowRange& seg = segments[item.segment];
    float* out = yp + items.first_row(item.segment) + item.row0;
#if defined(__AVX2__) && defined(__FMA__)
    thread_local fg::Scratch scratch;
    thread_local fg::FloatBuffer rowbuf{nullptr, &std::free};
    float* rows = fg::aligned_floats(rowbuf, kPanel * kSubSlice);
    const int64_t count = (item.rows + kPanel - 1) / kPanel;
    fg::gemm_chunk(xp, ldx, M, K, count, item.rows, out, N, scratch,
                   [&](int64_t k0, int64_t kc) -> fg::SliceView {
                     float* panels = fg::aligned_floats(
                         scratch.widened, fg::kMaxChunkPanels * fg::kKc * kPanel);
                     fill_slice(seg, item.row0, item.rows, k0, kc, rows, panels);
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
