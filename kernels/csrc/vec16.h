// Sixteen float32 lanes: one AVX-512 register, or two AVX2 registers.
//
// What the prefill attention kernel's float32 parts (online softmax, output
// updates, the float32 products) and silu_and_mul need, written once for both
// instruction sets: on AVX-512 every operation is the one instruction it names, so code
// written against Vec16 compiles to what it would with __m512 directly. The
// two differ only in exp16's last step (times_pow2) and how low it clamps.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace kvmesh {

#if defined(__AVX512F__)
// bfloat16 <-> float32 on 16 lanes, bfloat16 as its raw 16-bit patterns:
// widened exactly; rounded to the nearest, ties to even, as torch rounds
// (float_or_bf16.h's from_float, with no NaN test either). Shared by Vec16,
// decode attention and the LoRA kernels.
inline __m512 bf16_bits_to_float(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

inline __m256i float_to_bf16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16));
}

struct Vec16 {
  __m512 v;

  static Vec16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec16 zero() { return {_mm512_setzero_ps()}; }
  static Vec16 splat(float x) { return {_mm512_set1_ps(x)}; }
  void store(float* p) const { _mm512_storeu_ps(p, v); }

  friend Vec16 operator+(Vec16 a, Vec16 b) { return {_mm512_add_ps(a.v, b.v)}; }
  friend Vec16 operator-(Vec16 a, Vec16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
  friend Vec16 operator*(Vec16 a, Vec16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
  // a * b + c, one rounding.
  static Vec16 fma(Vec16 a, Vec16 b, Vec16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  static Vec16 max(Vec16 a, Vec16 b) { return {_mm512_max_ps(a.v, b.v)}; }
  static Vec16 min(Vec16 a, Vec16 b) { return {_mm512_min_ps(a.v, b.v)}; }
  // Lanes below n (0..16) from a, the others from b.
  static Vec16 first_lanes(int64_t n, Vec16 a, Vec16 b) {
    const __mmask16 keep = n >= 16 ? 0xFFFF : (__mmask16)((1u << (n < 0 ? 0 : n)) - 1);
    return {_mm512_mask_mov_ps(b.v, keep, a.v)};
  }
  friend Vec16 operator/(Vec16 a, Vec16 b) { return {_mm512_div_ps(a.v, b.v)}; }
  float reduce_max() const { return _mm512_reduce_max_ps(v); }
  float reduce_add() const { return _mm512_reduce_add_ps(v); }

  // bfloat16 in memory, converted as bf16_bits_to_float / float_to_bf16_bits.
  // With AVX512-BF16 the rounding is one vcvtneps2bf16 instead of that integer
  // sequence: the same bits except float32 subnormals, which it flushes to
  // zero (silu_and_mul at [1,024, 2 x 1,536] bf16 on the Zen 4 EPYC: 0.60 vs
  // 0.72 ms, 2 threads).
  static Vec16 load_bf16(const uint16_t* p) {
    return {bf16_bits_to_float(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }
#if defined(__AVX512BF16__)
  __m256i bf16_bits() const { return (__m256i)_mm512_cvtneps_pbh(v); }
#else
  __m256i bf16_bits() const { return float_to_bf16_bits(v); }
#endif
  Vec16 round_bf16() const { return {bf16_bits_to_float(bf16_bits())}; }
  void store_bf16(uint16_t* p) const {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_bits());
  }
  // store_bf16, returning what was stored (as round_bf16 would, one rounding).
  Vec16 store_bf16_rounded(uint16_t* p) const {
    const __m256i bits = bf16_bits();
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bits);
    return {bf16_bits_to_float(bits)};
  }

  // For exp16: lanes rounded to the nearest integer, and this x 2^n for
  // integral n (vscalefps underflows to 0 for very negative n instead of
  // wrapping, so exp16 may clamp as low as kExpFloor).
  static constexpr float kExpFloor = -104.f;
  Vec16 round_nearest() const {
    return {_mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
  }
  Vec16 times_pow2(Vec16 n) const { return {_mm512_scalef_ps(v, n.v)}; }
};

#elif defined(__AVX2__) && defined(__FMA__)
struct Vec16 {
  __m256 lo, hi;

  static Vec16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static Vec16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static Vec16 splat(float x) {
    const __m256 v = _mm256_set1_ps(x);
    return {v, v};
  }
  void store(float* p) const {
    _mm256_storeu_ps(p, lo);
    _mm256_storeu_ps(p + 8, hi);
  }

  friend Vec16 operator+(Vec16 a, Vec16 b) {
    return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)};
  }
  friend Vec16 operator-(Vec16 a, Vec16 b) {
    return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)};
  }
  friend Vec16 operator*(Vec16 a, Vec16 b) {
    return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)};
  }
  static Vec16 fma(Vec16 a, Vec16 b, Vec16 c) {
    return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
  }
  static Vec16 max(Vec16 a, Vec16 b) {
    return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)};
  }
  static Vec16 min(Vec16 a, Vec16 b) {
    return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)};
  }
  static Vec16 first_lanes(int64_t n, Vec16 a, Vec16 b) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i limit = _mm256_set1_epi32(static_cast<int>(n < 0 ? 0 : n > 16 ? 16 : n));
    const __m256 keep_lo = _mm256_castsi256_ps(_mm256_cmpgt_epi32(limit, lane));
    const __m256 keep_hi = _mm256_castsi256_ps(
        _mm256_cmpgt_epi32(limit, _mm256_add_epi32(lane, _mm256_set1_epi32(8))));
    return {_mm256_blendv_ps(b.lo, a.lo, keep_lo), _mm256_blendv_ps(b.hi, a.hi, keep_hi)};
  }
  friend Vec16 operator/(Vec16 a, Vec16 b) {
    return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)};
  }
  float reduce_max() const { return reduce(_mm256_max_ps(lo, hi), _mm_max_ps); }
  float reduce_add() const { return reduce(_mm256_add_ps(lo, hi), _mm_add_ps); }

  // The AVX-512 form's conversions, on two 8-lane halves.
  static Vec16 load_bf16(const uint16_t* p) {
    auto widen = [](const uint16_t* q) {
      const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
    };
    return {widen(p), widen(p + 8)};
  }
  Vec16 round_bf16() const {
    return {_mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(lo), 16)),
            _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(hi), 16))};
  }
  void store_bf16(uint16_t* p) const {
    // packus interleaves the two halves' 128-bit lanes; the permute puts them back.
    const __m256i packed = _mm256_packus_epi32(bf16_bits(lo), bf16_bits(hi));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(packed, 0xD8));
  }
  Vec16 store_bf16_rounded(uint16_t* p) const {
    store_bf16(p);
    return round_bf16();
  }

  // 2^n is built in the exponent bits, so n must stay a normal float's
  // exponent: exp16 clamps at kExpFloor (exp(-87) ~ 1.6e-38 stands in for 0:
  // every use multiplies it into sums of O(1) terms).
  static constexpr float kExpFloor = -87.f;
  Vec16 round_nearest() const {
    constexpr int kMode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return {_mm256_round_ps(lo, kMode), _mm256_round_ps(hi, kMode)};
  }
  Vec16 times_pow2(Vec16 n) const {
    auto pow2 = [](__m256 e) {
      const __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(e), _mm256_set1_epi32(127));
      return _mm256_castsi256_ps(_mm256_slli_epi32(biased, 23));
    };
    return {_mm256_mul_ps(lo, pow2(n.lo)), _mm256_mul_ps(hi, pow2(n.hi))};
  }

 private:
  static __m256i bf16_bits(__m256 x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    return _mm256_srli_epi32(
        _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  }

  template <class Op>
  static float reduce(__m256 x, Op op) {
    __m128 v = op(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    v = op(v, _mm_movehl_ps(v, v));
    v = op(v, _mm_movehdup_ps(v));
    return _mm_cvtss_f32(v);
  }
};
#endif

// exp(x) for x <= 0 (scores minus their running max) as x = n ln2 + r, |r| <=
// ln2 / 2: exp(r) by its Taylor polynomial, times 2^n. x is clamped to
// [kExpFloor, 88]: r stays exact for a -1e30 "no score yet", and 2^n finite
// for the positive garbage of masked lanes (zeroed after). PRECISE: degree 6
// (relative error < 2e-7, about a float32 ulp); else degree 4 (< 5e-5, below
// the 2^-9 of a bfloat16 rounding that follows). OVERFLOW_TO_INF (for x of
// either sign, as silu's exp(-gate)): clamped at 89 instead, where n = 128 and
// 2^n is +inf on both ISAs (the exponent bits all ones), so exp(x) overflows
// to +inf past float's largest as std::exp does.
template <bool PRECISE, bool OVERFLOW_TO_INF = false>
inline Vec16 exp16(Vec16 x) {
  constexpr float kCeiling = OVERFLOW_TO_INF ? 89.f : 88.f;
  x = Vec16::min(Vec16::max(x, Vec16::splat(Vec16::kExpFloor)), Vec16::splat(kCeiling));
  const Vec16 n = (x * Vec16::splat(1.44269504088896341f)).round_nearest();
  Vec16 r = Vec16::fma(n, Vec16::splat(-0.693359375f), x);
  r = Vec16::fma(n, Vec16::splat(2.12194440e-4f), r);
  Vec16 p = Vec16::splat(1.f / 24);
  if constexpr (PRECISE) {
    p = Vec16::fma(Vec16::splat(1.f / 720), r, Vec16::splat(1.f / 120));
    p = Vec16::fma(p, r, Vec16::splat(1.f / 24));
  }
  p = Vec16::fma(p, r, Vec16::splat(1.f / 6));
  p = Vec16::fma(p, r, Vec16::splat(0.5f));
  p = Vec16::fma(p, r, Vec16::splat(1.f));
  p = Vec16::fma(p, r, Vec16::splat(1.f));
  return p.times_pow2(n);
}

// cap * tanh(x / cap), attention's logit soft-cap (Gemma 2), as cap - 2 cap /
// (exp(2 x / cap) + 1): exp16's clamps make it exactly +-cap far out, and its
// absolute error is a few ulps of cap (what a softmax of the result sees).
inline Vec16 softcap16(Vec16 x, float cap) {
  const Vec16 e = exp16<true>(x * Vec16::splat(2.f / cap));
  return Vec16::splat(cap) - Vec16::splat(2.f * cap) / (e + Vec16::splat(1.f));
}

}  // namespace kvmesh
