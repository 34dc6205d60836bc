// The quantized KV cache's codes (--kv-cache-dtype, kernels/kv_quant.py): their
// types, how a row is quantized, where a block's scales sit, and how codes
// widen to float32, scalar and on 16 lanes.
//
// A cache tensor of codes is the codes' view of a page buffer: block b's page
// starts b * page_bytes (the tensor's stride(0)) from the first block's and
// holds block_size x num_kv_heads x head_dim one-byte codes, then (at the end
// of the page) block_size x num_kv_heads float32 scales, one per token and KV
// head. Value = code * scale; for e4m3 and e5m2 "code" means the fp8 number.
//
// Quantization is kv_quant.quantize's, step for step, so the codes are equal:
// scale = amax(|x|) / max_code (float32 division), code = x / scale (float32
// division; a zero row has scale 0 and divides by 1), int8 rounded to nearest,
// ties to even (nearbyint under the default rounding mode), fp8 by c10's
// conversion, the one torch's .to() uses. Sources that include this header
// must not be built with -ffast-math (x / scale must stay a division).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "vec16.h"
#endif

namespace kvmesh {

using E4m3 = c10::Float8_e4m3fn;
using E5m2 = c10::Float8_e5m2;

template <typename C>
inline constexpr bool kIsCode =
    std::is_same_v<C, int8_t> || std::is_same_v<C, E4m3> || std::is_same_v<C, E5m2>;

// The largest code: the format's largest finite value (int8: symmetric +-127).
template <typename C>
inline constexpr float kMaxCode = std::is_same_v<C, int8_t> ? 127.f
                                  : std::is_same_v<C, E4m3> ? 448.f
                                                            : 57344.f;

inline float to_float(int8_t c) { return static_cast<float>(c); }
inline float to_float(E4m3 c) { return static_cast<float>(c); }
inline float to_float(E5m2 c) { return static_cast<float>(c); }

template <typename C>
inline C to_code(float x) {
  if constexpr (std::is_same_v<C, int8_t>) {
    return static_cast<int8_t>(std::clamp(std::nearbyint(x), -127.f, 127.f));
  } else {
    return C(x);
  }
}

// One row of n values (already float) quantized into `codes`; returns its scale.
template <typename C>
inline float quantize_row(const float* x, int64_t n, C* codes) {
  float amax = 0.f;
  for (int64_t d = 0; d < n; ++d) amax = std::max(amax, std::fabs(x[d]));
  const float scale = amax / kMaxCode<C>;
  const float divisor = scale == 0.f ? 1.f : scale;
  for (int64_t d = 0; d < n; ++d) codes[d] = to_code<C>(x[d] / divisor);
  return scale;
}

// A block's scales: [block_size][num_kv_heads] float32 at the end of its page.
template <typename C>
inline const float* page_scales(const C* cache, int64_t block, int64_t page_bytes,
                                int64_t block_size, int64_t num_kv_heads) {
  const char* page = reinterpret_cast<const char*>(cache) + block * page_bytes;
  return reinterpret_cast<const float*>(page + page_bytes -
                                        block_size * num_kv_heads * int64_t(sizeof(float)));
}

inline bool is_code_type(at::ScalarType t) {
  return t == at::kChar || t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2;
}

// A quantized cache as kv_quant.allocate_pages lays it out: the codes' view
// [num_blocks, block_size, num_kv_heads, head_dim] of whole pages (rows dense,
// blocks a page apart, room for the scales at each page's end), the key and
// value caches alike.
inline void check_code_pages(const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const char* op) {
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.scalar_type() == k_cache.scalar_type() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.strides() == k_cache.strides(),
              op, ": key and value caches differ");
  const int64_t block_size = k_cache.size(1), heads = k_cache.size(2), head_dim = k_cache.size(3);
  TORCH_CHECK(k_cache.stride(3) == 1 && k_cache.stride(2) == head_dim &&
                  k_cache.stride(1) == heads * head_dim &&
                  k_cache.stride(0) >= block_size * heads * (head_dim + 4) &&
                  k_cache.stride(0) % 4 == 0 && k_cache.storage_offset() == 0 &&
                  v_cache.storage_offset() == 0,
              op, ": a quantized cache must be the codes' view of its pages (kernels/kv_quant.py)");
}

// f(C{}) with C the element type of a cache read by T queries: T itself (a
// model-dtype cache) or a quantized cache's code type.
template <typename T, typename F>
void dispatch_cache(at::ScalarType cache, const char* op, F&& f) {
  constexpr at::ScalarType own = std::is_same_v<T, float> ? at::kFloat : at::kBFloat16;
  if (cache == own) {
    f(T{});
  } else if (cache == at::kChar) {
    f(int8_t{});
  } else if (cache == at::kFloat8_e4m3fn) {
    f(E4m3{});
  } else if (cache == at::kFloat8_e5m2) {
    f(E5m2{});
  } else {
    TORCH_CHECK(false, op, ": a ", own, " query reads a ", own,
                " cache or a quantized one (int8, float8_e4m3fn, float8_e5m2), not ", cache);
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// Sixteen codes widened to float32 exactly. fp8 goes through float16 (F16C,
// part of the avx2 level's x86-64-v3): e5m2 is float16's top byte; e4m3's
// sign, exponent and mantissa bits land in float16's (its exponent in the low
// four of float16's five), which is the value times 2^-8, subnormals included.
inline Vec16 load_codes(const int8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
#if defined(__AVX512F__)
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes))};
#else
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)),
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)))};
#endif
}

inline Vec16 halves_to_vec16(__m256i halves) {
#if defined(__AVX512F__)
  return {_mm512_cvtph_ps(halves)};
#else
  return {_mm256_cvtph_ps(_mm256_castsi256_si128(halves)),
          _mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1))};
#endif
}

inline Vec16 load_codes(const E5m2* p) {
  const __m256i words =
      _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return halves_to_vec16(_mm256_slli_epi16(words, 8));
}

inline Vec16 load_codes(const E4m3* p) {
  const __m256i words =
      _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i magnitude = _mm256_slli_epi16(_mm256_and_si256(words, _mm256_set1_epi16(0x7F)), 7);
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(words, _mm256_set1_epi16(0x80)), 8);
  return halves_to_vec16(_mm256_or_si256(magnitude, sign)) * Vec16::splat(256.f);
}
#endif

}  // namespace kvmesh
