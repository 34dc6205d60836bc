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
#include "work_stealing.h"

namespace {

using namespace kvmesh::ggml;

// Sub-block of 32 weights: out[l] = a * q[l] - b (two roundings).
inline void affine32(const uint8_t* q, float a, float b, float* out) {
  for (int l = 0; l < 32; ++l) out[l] = a * static_cast<float>(q[l]) - b;
}

void dequant_block(int64_t kind, const uint8_t* blk, float* out) {
  uint8_t q[256];
  switch (kind) {
    case kQ4_0:
    case kQ4_1: {
      const float d = half_at(blk);
      const uint8_t* qs = blk + legacy_layout(kind).qs;
      for (int l = 0; l < 16; ++l) {
        q[l] = qs[l] & 0xF;
        q[l + 16] = qs[l] >> 4;
      }
      if (kind == kQ4_0) {
        for (int l = 0; l < 32; ++l) out[l] = d * static_cast<float>(static_cast<int>(q[l]) - 8);
      } else {
        const float m = half_at(blk + 2);
        for (int l = 0; l < 32; ++l) out[l] = d * static_cast<float>(q[l]) + m;
      }
      return;
    }
    case kQ5_0:
    case kQ5_1: {
      const float d = half_at(blk);
#if defined(__AVX2__) && defined(__FMA__)
      {
        const LegacyLayout at = legacy_layout(kind);
        uint32_t qh;
        std::memcpy(&qh, blk + at.qh, sizeof(qh));
        const uint8_t* qs = blk + at.qs;
        // Eight weights at a time: nibble of qs, fifth bit (qh >> l) & 1.
        const __m256i qh_v = _mm256_set1_epi32(static_cast<int>(qh));
        const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i low4 = _mm256_set1_epi32(0xF), one = _mm256_set1_epi32(1);
        const __m256 dv = _mm256_set1_ps(d);
        for (int c = 0; c < 4; ++c) {
          __m256i n = _mm256_cvtepu8_epi32(
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * (c & 1))));
          n = c < 2 ? _mm256_and_si256(n, low4) : _mm256_srli_epi32(n, 4);
          const __m256i bit = _mm256_and_si256(
              _mm256_srlv_epi32(qh_v, _mm256_add_epi32(lanes, _mm256_set1_epi32(8 * c))), one);
          const __m256i qi = _mm256_or_si256(n, _mm256_slli_epi32(bit, 4));
          __m256 w;
          if (kind == kQ5_0) {
            w = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_sub_epi32(qi, _mm256_set1_epi32(16))));
          } else {
            w = _mm256_add_ps(_mm256_mul_ps(dv, _mm256_cvtepi32_ps(qi)),
                              _mm256_set1_ps(half_at(blk + 2)));
          }
          _mm256_storeu_ps(out + 8 * c, w);
        }
        return;
      }
#endif
      int16_t c[32];
      if (kind == kQ5_0) {
        run_codes<kQ5_0>(blk, 0, c);
        for (int l = 0; l < 32; ++l) out[l] = d * static_cast<float>(c[l] - 16);
      } else {
        run_codes<kQ5_1>(blk, 0, c);
        const float m = half_at(blk + 2);
        for (int l = 0; l < 32; ++l) out[l] = d * static_cast<float>(c[l]) + m;
      }
      return;
    }
    case kQ8_0: {
      const float d = half_at(blk);
      const auto* qs = reinterpret_cast<const int8_t*>(blk + 2);
      for (int l = 0; l < 32; ++l) out[l] = d * static_cast<float>(qs[l]);
      return;
    }
    case kQ4_K:
    case kQ5_K: {
      const float d = half_at(blk), dmin = half_at(blk + 2);
      const uint8_t* scales = blk + 4;
      const uint8_t* qh = blk + 16;                          // Q5_K only
      const uint8_t* qs = blk + kquant_nibbles_at(kind);  // 128 bytes of nibbles
      // Byte l of 64-weight chunk c: sub-block 2c's weight l (low nibble) and
      // sub-block 2c + 1's (high nibble); Q5_K's fifth bit of sub-block s is
      // bit s of qh[l].
      for (int c = 0; c < 4; ++c) {
        for (int l = 0; l < 32; ++l) {
          q[64 * c + l] = qs[32 * c + l] & 0xF;
          q[64 * c + 32 + l] = qs[32 * c + l] >> 4;
        }
      }
      if (kind == kQ5_K) {
        for (int s = 0; s < 8; ++s) {
          for (int l = 0; l < 32; ++l) q[32 * s + l] |= ((qh[l] >> s) & 1) << 4;
        }
      }
      for (int s = 0; s < 8; ++s) {
        uint8_t sc, m;
        scale_min_k4(s, scales, sc, m);
        affine32(q + 32 * s, d * static_cast<float>(sc), dmin * static_cast<float>(m),
                 out + 32 * s);
      }
      return;
    }
    case kQ6_K: {
      const float d = half_at(blk + 208);
      // Weight r of half h (128 weights): low 4 bits in ql[64 h + r % 64]
      // (nibble r / 64), high 2 bits in qh[32 h + r % 32] (bits 2 (r / 32));
      // minus 32; scale 8 h + r / 16. Byte l feeds r = l, l + 32, l + 64, l + 96.
      for (int h = 0; h < 2; ++h) {
        const auto* sc = reinterpret_cast<const int8_t*>(blk + 192 + 8 * h);
        float ds[8];
        for (int i = 0; i < 8; ++i) ds[i] = d * static_cast<float>(sc[i]);
        float* y = out + 128 * h;
#if defined(__AVX2__) && defined(__FMA__)
        const uint8_t* ql = blk + 64 * h;
        const uint8_t* qh = blk + 128 + 32 * h;
        const __m256i low4 = _mm256_set1_epi32(0xF), two = _mm256_set1_epi32(3);
        const __m256i bias = _mm256_set1_epi32(32);
        const auto load8 = [](const uint8_t* p) {
          return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
        };
        const auto put = [&](float* dst, float scale, __m256i low, __m256i high) {
          const __m256i qi =
              _mm256_sub_epi32(_mm256_or_si256(low, _mm256_slli_epi32(high, 4)), bias);
          _mm256_storeu_ps(dst, _mm256_mul_ps(_mm256_set1_ps(scale), _mm256_cvtepi32_ps(qi)));
        };
        for (int l = 0; l < 32; l += 8) {
          const int is = l / 16;
          const __m256i a = load8(ql + l), b = load8(ql + l + 32), hh = load8(qh + l);
          put(y + l, ds[is], _mm256_and_si256(a, low4), _mm256_and_si256(hh, two));
          put(y + l + 32, ds[is + 2], _mm256_and_si256(b, low4),
              _mm256_and_si256(_mm256_srli_epi32(hh, 2), two));
          put(y + l + 64, ds[is + 4], _mm256_srli_epi32(a, 4),
              _mm256_and_si256(_mm256_srli_epi32(hh, 4), two));
          put(y + l + 96, ds[is + 6], _mm256_srli_epi32(b, 4), _mm256_srli_epi32(hh, 6));
        }
        continue;
#endif
        // Run g of this half: weights 32 g .. 32 g + 31, scales 2 g and 2 g + 1.
        int16_t c[32];
        for (int g = 0; g < 4; ++g) {
          run_codes<kQ6_K>(blk, 4 * h + g, c);
          for (int l = 0; l < 32; ++l) {
            y[32 * g + l] = ds[2 * g + l / 16] * static_cast<float>(c[l] - 32);
          }
        }
      }
      return;
    }
    default: TORCH_CHECK(false, "ggml blocks: unsupported ggml type ", kind);
  }
}

void dequant_row(int64_t kind, const Format& f, const uint8_t* row, int64_t K, float* out) {
  for (int64_t b = 0; b < K / f.weights; ++b) {
    dequant_block(kind, row + b * f.bytes, out + b * f.weights);
  }
}

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
