// y = x Wᵀ with W kept as a GGUF file's own quantized blocks, row by row:
// the legacy 32-weight blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and the K-quants'
// 256-weight super-blocks (Q4_K, Q5_K: eight 32-weight sub-blocks with 6-bit
// scales and minimums under float16 super-scales; Q6_K: sixteen 16-weight
// sub-blocks with int8 scales), which is what Q4_K_M / Q5_K_M files mix.
//
// Why: a decode step reads every weight once, so its matmuls are bound by the
// bytes of the weights. Keeping the file's blocks (4.5 bits per weight for
// Q4_K, 6.56 for Q6_K) instead of a float32 copy (32 bits) is 5-7x fewer bytes
// to hold and to stream per step.
//
// Layout: one tensor per run of output rows of one type, uint8
// [rows, K / block_weights * block_bytes], the blocks of row n back to back
// as in the file. A fused projection (q, k, v of mixed types in a Q4_K_M file)
// is a list of such segments, multiplied in one pass over all their rows.
//
// Each block is rebuilt exactly as the gguf package's dequantization (and so
// llama.cpp's dequantize_row_*) computes it in float32: for the K-quants the
// sub-block scale d * sc and minimum dmin * m are rounded products, each weight
// is (d * sc) * q - (dmin * m) with both roundings (this file compiles with
// -ffp-contract=off so that no fused multiply-add merges them). The dot
// products then run in float32 with fused multiply-adds (AVX2 intrinsics from
// the avx2 level up, which the avx512/avx512_bf16/amx levels share; plain C++
// otherwise). Activations are float32 and never quantized.
//
// Decode (few rows of x): a group of output rows is rebuilt into a small
// float32 buffer (a few KB, in L1), then every row of x is dotted with it, so
// each block is decoded once per call whatever the batch. Prefill runs
// ggml_dequantize on a tile of rows into a scratch buffer and a GEMM
// (worker/models/ggml_linear.py).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#include "ggml_blocks.h"
#include "ggml_dequant.h"
#include "work_stealing.h"

namespace {

using namespace kvmesh::ggml;

constexpr int64_t kRowGroup = 4;  // output rows rebuilt together, dotted with each x row

// y[m, n0 + r] = x[m, :] . w[r, :] for r < rows (<= kRowGroup), every m < M.
void dot_group(const float* x, int64_t M, int64_t K, const float* w, int64_t rows, float* y,
               int64_t ldy) {
#if defined(__AVX2__) && defined(__FMA__)
  if (K % 8 == 0) {
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * K;
      __m256 acc[kRowGroup] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                               _mm256_setzero_ps()};
      if (rows == kRowGroup) {
        for (int64_t k = 0; k < K; k += 8) {
          const __m256 xv = _mm256_loadu_ps(xm + k);
          acc[0] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + k), acc[0]);
          acc[1] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + K + k), acc[1]);
          acc[2] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + 2 * K + k), acc[2]);
          acc[3] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + 3 * K + k), acc[3]);
        }
      } else {
        for (int64_t k = 0; k < K; k += 8) {
          const __m256 xv = _mm256_loadu_ps(xm + k);
          for (int64_t r = 0; r < rows; ++r) {
            acc[r] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + r * K + k), acc[r]);
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const __m128 s4 =
            _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
        const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        const __m128 s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
        y[m * ldy + r] = _mm_cvtss_f32(s1);
      }
    }
    return;
  }
#endif
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t r = 0; r < rows; ++r) {
      // Eight partial sums, as the vector path keeps: the compiler vectorizes it.
      float part[8] = {};
      const float* wr = w + r * K;
      const float* xm = x + m * K;
      int64_t k = 0;
      for (; k + 8 <= K; k += 8) {
        for (int j = 0; j < 8; ++j) part[j] += xm[k + j] * wr[k + j];
      }
      float sum = 0.0f;
      for (int j = 0; j < 8; ++j) sum += part[j];
      for (; k < K; ++k) sum += xm[k] * wr[k];
      y[m * ldy + r] = sum;
    }
  }
}

at::Tensor ggml_linear(const at::Tensor& x, at::TensorList blocks, at::IntArrayRef kinds) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "ggml_linear: x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(blocks.size() == kinds.size() && !blocks.empty(),
              "ggml_linear: one ggml type per block tensor");
  const int64_t M = x.size(0), K = x.size(1);
  for (size_t s = 0; s < blocks.size(); ++s) check_segment(blocks[s], kinds[s], K, "ggml_linear");
  const SegmentItems groups(blocks, kRowGroup);
  const int64_t N = groups.rows();
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  kvmesh::parallel_items(groups.items(), [&](int64_t g, bool /*forward*/) {
    const SegmentItems::Item group = groups.item(g);
    const size_t s = group.segment;
    const Format f = block_format(kinds[s]);
    const int64_t row_bytes = K / f.weights * f.bytes;
    const uint8_t* base = blocks[s].data_ptr<uint8_t>() + group.row0 * row_bytes;
    // thread_local: one allocation per thread and K, reused by every call.
    thread_local std::vector<float> w;
    if (static_cast<int64_t>(w.size()) < kRowGroup * K) w.resize(kRowGroup * K);
    for (int64_t r = 0; r < group.rows; ++r) {
      dequant_row(kinds[s], f, base + r * row_bytes, K, &w[r * K]);
    }
    dot_group(xp, M, K, w.data(), group.rows, yp + groups.first_row(s) + group.row0, N);
  });
  return y;
}

// The float32 weights [rows, K] of one segment into `out` (a scratch buffer
// for a prefill tile: no allocation per tile).
void ggml_dequantize_into(const at::Tensor& blocks, int64_t kind, const at::Tensor& out) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == blocks.size(0),
              "ggml_dequantize: out must be a contiguous float32 [rows, K] tensor");
  const int64_t K = out.size(1);
  check_segment(blocks, kind, K, "ggml_dequantize");
  const Format f = block_format(kind);
  const int64_t rows = blocks.size(0), row_bytes = K / f.weights * f.bytes;
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  constexpr int64_t kRowsPerItem = 16;
  kvmesh::parallel_items((rows + kRowsPerItem - 1) / kRowsPerItem, [&](int64_t item, bool) {
    const int64_t end = std::min(rows, (item + 1) * kRowsPerItem);
    for (int64_t r = item * kRowsPerItem; r < end; ++r) {
      dequant_row(kind, f, bp + r * row_bytes, K, op + r * K);
    }
  });
}

// The float32 weights [rows, K] of one segment (embedding rows, tests).
at::Tensor ggml_dequantize(const at::Tensor& blocks, int64_t kind, int64_t K) {
  at::Tensor out = at::empty({blocks.size(0), K}, blocks.options().dtype(at::kFloat));
  ggml_dequantize_into(blocks, kind, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("ggml_linear(Tensor x, Tensor[] blocks, int[] kinds) -> Tensor");
  m.def("ggml_dequantize(Tensor blocks, int kind, int in_features) -> Tensor");
  m.def("ggml_dequantize_into(Tensor blocks, int kind, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) {
  m.impl("ggml_linear", &ggml_linear);
  m.impl("ggml_dequantize", &ggml_dequantize);
  m.impl("ggml_dequantize_into", &ggml_dequantize_into);
}
