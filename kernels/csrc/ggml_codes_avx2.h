// A GGUF block's codes unpacked into AVX2 registers: 32 unsigned bytes per
// run of 32 weights (Q8_0: its int8 codes), what maddubs multiplies with int8
// activations, and the integer dot products of such a run. Shared by the
// int8-activation kernels: ggml_q8_linear.cpp (codes unpacked per weight row,
// dotted in registers), ggml_q8_panel.cpp (codes unpacked once into an L1
// panel for a batch of rows) and ggml_q8_row.cpp (one row of x).
#pragma once

#if defined(__AVX2__)
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "ggml_blocks.h"

namespace kvmesh::ggml {

// 16 bytes of nibbles as 32 codes: the low nibbles, then the high ones (a
// legacy block's weights 0-15, then 16-31).
inline __m256i nibbles32(const uint8_t* qs) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes),
                          _mm256_set1_epi8(0x0F));
}

// 0x10 in byte l where bit l of the 32 bits at qh is set (a Q5_0 / Q5_1
// block's fifth bits; llama.cpp's bytes_from_bits_32): byte l takes qh's byte
// l / 8, keeps bit l % 8, and becomes 0x10 where it is set.
inline __m256i fifth_bits32(const uint8_t* qh) {
  uint32_t bits;
  std::memcpy(&bits, qh, sizeof(bits));
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202,
                         0x0303030303030303));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

// Eight int32 lane sums of c[l] * q[l] over 32 bytes (c unsigned codes, q the
// int8 codes of x): one maddubs (pairs into int16; |c| <= 63 with |q| <= 127
// cannot saturate) and one madd against ones.
inline __m256i dot_lanes(__m256i c, const int8_t* q) {
  const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  return _mm256_madd_epi16(_mm256_maddubs_epi16(c, xq), _mm256_set1_epi16(1));
}

// The same for a Q8_0 run, whose codes are signed: maddubs takes an unsigned
// left operand, so the weights lend x their sign (|c| <= 127 then, and
// 2 * 127 * 127 still fits an int16).
inline __m256i dot_lanes_signed(__m256i c, const int8_t* q) {
  const __m256i xq =
      _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)), c);
  return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(c, c), xq),
                           _mm256_set1_epi16(1));
}

// Run r's 32 codes in one register: unsigned bytes (Q8_0: its int8 codes).
template <int64_t kind>
inline __m256i run_codes_avx2(const uint8_t* blk, int r) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  switch (kind) {
    case kQ4_0:
    case kQ4_1:
    case kQ5_0:
    case kQ5_1: {
      constexpr LegacyLayout at = legacy_layout(kind);
      const __m256i c = nibbles32(blk + at.qs);
      if constexpr (at.five) return _mm256_or_si256(c, fifth_bits32(blk + at.qh));
      return c;
    }
    case kQ8_0: return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
    case kQ4_K:
    case kQ5_K: {
      const uint8_t* qs = blk + kquant_nibbles_at(kind) + 32 * (r / 2);
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
      __m256i c = _mm256_and_si256(r % 2 ? _mm256_srli_epi16(bytes, 4) : bytes, low4);
      if (kind == kQ5_K) {
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16));
        const __m256i bit =
            _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(r)), _mm256_set1_epi8(1));
        c = _mm256_or_si256(c, _mm256_slli_epi16(bit, 4));
      }
      return c;
    }
    case kQ6_K: {
      const int h = r / 4, g = r % 4;
      const __m256i ql =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32 * (g % 2)));
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
      const __m256i low = _mm256_and_si256(g < 2 ? ql : _mm256_srli_epi16(ql, 4), low4);
      const __m256i high = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * g)),
                                            _mm256_set1_epi8(3));
      return _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
    }
    default: break;  // every kind dispatches to its own instance
  }
  return _mm256_setzero_si256();
}

// The sum and the maximum of a register's eight floats.
inline float hsum(__m256 v) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

inline float hmax(__m256 v) {
  const __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  return _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
}

}  // namespace kvmesh::ggml

#endif  // __AVX2__
