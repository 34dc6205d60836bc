// A GGUF block rebuilt as float32 weights exactly as the gguf package's
// dequantization (and llama.cpp's dequantize_row_*) computes them: for the
// K-quants the sub-block scale d * sc and minimum dmin * m are rounded
// products and each weight is (d * sc) * q - (dmin * m) with both roundings.
//
// Every source that includes this header compiles with -ffp-contract=off
// (kernels/native.py): a fused multiply-add would merge the two roundings.
// Its users: ggml_block_linear.cpp (decode rows, prefill tiles, embedding
// rows) and ggml_float_gemm.cpp (k slices of panels for the float32 GEMM).
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#include "ggml_blocks.h"

namespace kvmesh::ggml {

// Sub-block of 32 weights: out[l] = a * q[l] - b (two roundings).
inline void affine32(const uint8_t* q, float a, float b, float* out) {
  for (int l = 0; l < 32; ++l) out[l] = a * static_cast<float>(q[l]) - b;
}

// always_inline: with a constant kind (ggml_float_gemm.cpp) the switch folds away.
[[gnu::always_inline]] inline void dequant_block(int64_t kind, const uint8_t* blk, float* out) {
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

inline void dequant_row(int64_t kind, const Format& f, const uint8_t* row, int64_t K, float* out) {
  for (int64_t b = 0; b < K / f.weights; ++b) {
    dequant_block(kind, row + b * f.bytes, out + b * f.weights);
  }
}

}  // namespace kvmesh::ggml
