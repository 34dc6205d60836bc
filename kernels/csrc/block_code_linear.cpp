// y = x Wᵀ for small batches, with W kept as 8-bit codes and per-32-block
// float32 scale and offset: W[n, k] = fma(code[n, k], scale[n, k/32], offset[n, k/32]).
//
// Why: a decode step multiplies a handful of rows by every weight, so its
// matmuls are bound by reading the weights. Checkpoints that were quantized
// once (GGUF Q4_1, Q8_0, ...) have float32 weights that are exactly such codes;
// reading 1 byte instead of 4 per weight and rebuilding the float32 value in
// registers gives the very same weights (the fma is exact: code * scale needs
// at most 19 significant bits) at a quarter of the memory traffic. The
// arithmetic stays float32 (activations are never quantized).
// kernels/block_codes.py finds the codes and proves them exact at load time.
//
// Layout, 16 output features per panel (one AVX-512 register of float32):
//   codes:   [num_panels, K, 16]       uint8
//   scales:  [num_panels, K / 32, 16]  float32
//   offsets: [num_panels, K / 32, 16]  float32
// Panels past out_features are zero padding.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <array>
#include <cstdint>
#include <utility>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "work_stealing.h"

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kCodeBlock = 32;
constexpr int64_t kMaxRows = 16;  // rows per register tile: 16 accumulators
constexpr int64_t kPrefetchAhead = 256;  // k steps (16 bytes each) of codes

#ifdef __AVX512F__
template <int ROWS>
void panel_tile(const float* x, int64_t K, const uint8_t* codes, const uint8_t* next_codes,
                const float* scales, const float* offsets, float* y, int64_t ldy,
                int64_t valid_lanes) {
  __m512 acc[ROWS];
  for (int m = 0; m < ROWS; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < K / kCodeBlock; ++kb) {
    const __m512 scale = _mm512_loadu_ps(scales + kb * kLanes);
    const __m512 offset = _mm512_loadu_ps(offsets + kb * kLanes);
    // The codes stream from DRAM once per step; ask for them a few KB ahead
    // (past the end of this panel that is the next panel, laid out after it).
    const int64_t ahead_k = kb * kCodeBlock + kPrefetchAhead;
    const uint8_t* ahead = ahead_k < K ? codes + ahead_k * kLanes
                                       : next_codes + (ahead_k - K) * kLanes;
    if (ahead_k < K || next_codes != nullptr) {
      for (int64_t line = 0; line < kCodeBlock * kLanes; line += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T0);
      }
    }
    for (int64_t kk = 0; kk < kCodeBlock; ++kk) {
      const int64_t k = kb * kCodeBlock + kk;
      const __m128i c8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k * kLanes));
      const __m512 w = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(c8)), scale, offset);
      for (int m = 0; m < ROWS; ++m) {
        acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * K + k]), w, acc[m]);
      }
    }
  }
  const __mmask16 mask = valid_lanes >= kLanes ? 0xFFFF : (__mmask16)((1u << valid_lanes) - 1);
  for (int m = 0; m < ROWS; ++m) _mm512_mask_storeu_ps(y + m * ldy, mask, acc[m]);
}
#else
template <int ROWS>
void panel_tile(const float* x, int64_t K, const uint8_t* codes, const uint8_t* /*next_codes*/,
                const float* scales, const float* offsets, float* y, int64_t ldy,
                int64_t valid_lanes) {
  float acc[ROWS][kLanes] = {};
  float w[kLanes];
  for (int64_t k = 0; k < K; ++k) {
    const float* scale = scales + (k / kCodeBlock) * kLanes;
    const float* offset = offsets + (k / kCodeBlock) * kLanes;
    for (int64_t l = 0; l < kLanes; ++l) {
      w[l] = std::fma(static_cast<float>(codes[k * kLanes + l]), scale[l], offset[l]);
    }
    for (int m = 0; m < ROWS; ++m) {
      const float xv = x[m * K + k];
#pragma omp simd
      for (int64_t l = 0; l < kLanes; ++l) acc[m][l] += xv * w[l];
    }
  }
  for (int m = 0; m < ROWS; ++m) {
    for (int64_t l = 0; l < valid_lanes; ++l) y[m * ldy + l] = acc[m][l];
  }
}
#endif

using TileFn = void (*)(const float*, int64_t, const uint8_t*, const uint8_t*, const float*,
                        const float*, float*, int64_t, int64_t);

template <int... R>
constexpr auto make_tiles(std::integer_sequence<int, R...>) {
  return std::array<TileFn, sizeof...(R)>{&panel_tile<R + 1>...};
}
constexpr auto kTiles = make_tiles(std::make_integer_sequence<int, kMaxRows>{});

at::Tensor block_code_linear(const at::Tensor& x, const at::Tensor& codes,
                             const at::Tensor& scales, const at::Tensor& offsets,
                             int64_t out_features) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "block_code_linear: x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 3 && codes.is_contiguous() &&
                  codes.size(2) == kLanes,
              "block_code_linear: codes must be contiguous uint8 [panels, K, 16]");
  const int64_t M = x.size(0), K = x.size(1), panels = codes.size(0);
  TORCH_CHECK(codes.size(1) == K, "block_code_linear: x has ", K, " features, codes ",
              codes.size(1));
  TORCH_CHECK(K % kCodeBlock == 0, "block_code_linear: K must be a multiple of 32");
  for (const at::Tensor* t : {&scales, &offsets}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 &&
                    t->size(0) == panels && t->size(1) == K / kCodeBlock && t->size(2) == kLanes,
                "block_code_linear: scales and offsets must be contiguous float32 "
                "[panels, K / 32, 16]");
  }
  TORCH_CHECK(out_features > (panels - 1) * kLanes && out_features <= panels * kLanes,
              "block_code_linear: out_features ", out_features, " does not match ", panels,
              " panels");

  at::Tensor y = at::empty({M, out_features}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* op = offsets.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t blocks = K / kCodeBlock;

  kvmesh::parallel_items(panels, [&](int64_t p, bool forward) {
    const int64_t n0 = p * kLanes;
    const int64_t valid = std::min(kLanes, out_features - n0);
    // The panel this thread most likely takes next, for the prefetcher.
    const int64_t next = forward ? p + 1 : p - 1;
    const uint8_t* next_codes = next >= 0 && next < panels ? cp + next * K * kLanes : nullptr;
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
      const int64_t rows = std::min(kMaxRows, M - m0);
      kTiles[rows - 1](xp + m0 * K, K, cp + p * K * kLanes, next_codes, sp + p * blocks * kLanes,
                       op + p * blocks * kLanes, yp + m0 * out_features + n0, out_features, valid);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def(
      "block_code_linear(Tensor x, Tensor codes, Tensor scales, Tensor offsets, "
      "int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("block_code_linear", &block_code_linear); }
