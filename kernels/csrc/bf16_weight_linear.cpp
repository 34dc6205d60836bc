// y = x Wᵀ in float32 for small batches, with W kept as bfloat16 words.
//
// Why: most checkpoints ship their weights in bfloat16. Served in float32 (on a
// CPU without bfloat16 dot products, where float32 is the fast dtype), each such
// weight is exactly a bfloat16 value widened: its low 16 bits are zero. A decode
// step multiplies a handful of rows by every weight, so it is bound by reading
// the weights; reading the 2 bytes that carry information instead of 4 halves
// that traffic, and widening a bfloat16 word to float32 is exact (a 16-bit
// shift). The arithmetic stays float32: the products and sums are those of the
// float32 weight, only their order differs from oneDNN's. worker/models/linear.py
// keeps such a weight only in this layout (half a float32 copy's memory) and
// widens it into a scratch buffer for prefill-sized batches.
//
// Layout, 16 output features per panel (one AVX-512 register of float32):
//   panels: [num_panels, K, 16] bfloat16 words: word l of feature k of panel p
//           is W[16 p + l, k]; panels past out_features are zeros.
// (kernels/bf16_weights.py packs it.)
//
// Paths by instruction-set level (kernels/cpu_isa.py):
//   AVX-512:      a panel's 16 words widened into one register per feature.
//   AVX2 + FMA:   two 8-lane halves per panel, same operations in the same order,
//                 so the float32 results are bitwise those of AVX-512.
//   otherwise:    portable C++ (the compiler vectorizes what the level allows).
// Each row's sum runs over k in order, one accumulator per output, whatever the
// other rows of the call: a row's result does not depend on the batch
// (batch-invariant mode relies on this).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include "work_stealing.h"

namespace {

constexpr int64_t kLanes = 16;
#if defined(__AVX512F__) || !defined(__AVX2__)
constexpr int64_t kMaxRows = 12;  // rows per register tile: 12 accumulators (of 32 zmm)
#else
constexpr int64_t kMaxRows = 6;  // 2 accumulators per row in 16 ymm registers
#endif
// Features ahead to prefetch (32 bytes each): 2 KB. The panels stream from DRAM
// once per step; the next panel is laid out right after this one.
constexpr int64_t kPrefetchAhead = 64;

inline void prefetch_words(const uint16_t* panel, int64_t k, int64_t K) {
#if defined(__AVX512F__) || defined(__AVX2__)
  // One 64-byte line per two features; past this panel's end is the next one's
  // start (or past the tensor for the last panel: prefetches never fault).
  if ((k & 1) == 0) {
    _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kPrefetchAhead) * kLanes),
                 _MM_HINT_T0);
  }
#endif
  (void)K;
}

#if defined(__AVX512F__)
template <int ROWS>
void panel_tile(const float* x, int64_t ldx, int64_t K, const uint16_t* panel, float* y,
                int64_t ldy, int64_t valid_lanes) {
  __m512 acc[ROWS];
  for (int m = 0; m < ROWS; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    prefetch_words(panel, k, K);
    const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + k * kLanes));
    const __m512 w = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(words), 16));
    for (int m = 0; m < ROWS; ++m) {
      acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * ldx + k]), w, acc[m]);
    }
  }
  const __mmask16 mask = valid_lanes >= kLanes ? 0xFFFF : (__mmask16)((1u << valid_lanes) - 1);
  for (int m = 0; m < ROWS; ++m) _mm512_mask_storeu_ps(y + m * ldy, mask, acc[m]);
}
#elif defined(__AVX2__) && defined(__FMA__)
template <int ROWS>
void panel_tile(const float* x, int64_t ldx, int64_t K, const uint16_t* panel, float* y,
                int64_t ldy, int64_t valid_lanes) {
  __m256 acc_lo[ROWS], acc_hi[ROWS];
  for (int m = 0; m < ROWS; ++m) acc_lo[m] = acc_hi[m] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    prefetch_words(panel, k, K);
    const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + k * kLanes));
    const __m256 w_lo = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(words)), 16));
    const __m256 w_hi = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(words, 1)), 16));
    for (int m = 0; m < ROWS; ++m) {
      const __m256 xv = _mm256_set1_ps(x[m * ldx + k]);
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

template <int ROWS>
void panel_tile(const float* x, int64_t ldx, int64_t K, const uint16_t* panel, float* y,
                int64_t ldy, int64_t valid_lanes) {
  float acc[ROWS][kLanes] = {};
  float w[kLanes];
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t l = 0; l < kLanes; ++l) w[l] = widen(panel[k * kLanes + l]);
    for (int m = 0; m < ROWS; ++m) {
      const float xv = x[m * ldx + k];
#pragma omp simd
      for (int64_t l = 0; l < kLanes; ++l) acc[m][l] = std::fma(xv, w[l], acc[m][l]);
    }
  }
  for (int m = 0; m < ROWS; ++m) {
    for (int64_t l = 0; l < valid_lanes; ++l) y[m * ldy + l] = acc[m][l];
  }
}
#endif

using TileFn = void (*)(const float*, int64_t, int64_t, const uint16_t*, float*, int64_t,
                        int64_t);

template <int... R>
constexpr auto make_tiles(std::integer_sequence<int, R...>) {
  return std::array<TileFn, sizeof...(R)>{&panel_tile<R + 1>...};
}
constexpr auto kTiles = make_tiles(std::make_integer_sequence<int, kMaxRows>{});

at::Tensor bf16_weight_linear(const at::Tensor& x, const at::Tensor& panels,
                              const std::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(x.device().is_cpu() && panels.device().is_cpu(),
              "bf16_weight_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "bf16_weight_linear: x must be float32 [M, K] with unit feature stride");
  TORCH_CHECK(panels.scalar_type() == at::kBFloat16 && panels.is_contiguous() &&
                  panels.dim() == 3 && panels.size(2) == kLanes,
              "bf16_weight_linear: panels must be contiguous bfloat16 [panels, K, 16]");
  const int64_t M = x.size(0), K = x.size(1), num_panels = panels.size(0);
  TORCH_CHECK(panels.size(1) == K, "bf16_weight_linear: x has ", K, " features, panels ",
              panels.size(1));
  TORCH_CHECK(out_features > (num_panels - 1) * kLanes && out_features <= num_panels * kLanes,
              "bf16_weight_linear: out_features ", out_features, " does not match ", num_panels,
              " panels");
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == out_features,
                "bf16_weight_linear: bias must be contiguous float32 [out_features]");
  }
  at::Tensor y = at::empty({M, out_features}, x.options());
  if (M == 0) return y;
  const auto* wp = reinterpret_cast<const uint16_t*>(panels.data_ptr());
  const float* xp = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  float* yp = y.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;

  kvmesh::parallel_items(num_panels, [&](int64_t p, bool /*forward*/) {
    const int64_t n0 = p * kLanes;
    const int64_t valid = std::min(kLanes, out_features - n0);
    const uint16_t* panel = wp + p * K * kLanes;
    // Row tiles after the first find the panel in L1/L2 (K x 32 bytes).
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
      const int64_t rows = std::min(kMaxRows, M - m0);
      kTiles[rows - 1](xp + m0 * ldx, ldx, K, panel, yp + m0 * out_features + n0, out_features,
                       valid);
    }
    if (bp != nullptr) {
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t l = 0; l < valid; ++l) yp[m * out_features + n0 + l] += bp[n0 + l];
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("bf16_weight_linear(Tensor x, Tensor panels, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("bf16_weight_linear", &bf16_weight_linear); }
