// y = x Wᵀ (+ bias) for bfloat16 decode batches on AVX512-BF16 without AMX,
// over a copy of W packed once in vdpbf16ps's pair layout.
//
// Why: a decode batch of 8-32 rows on this level is bound neither by reading
// the weights nor by the multiplies alone. The block-code kernel
// (block_code_linear.cpp) reads 1 byte per weight but spends ~11 vector ops
// rebuilding each 32 bfloat16 weights from their codes, which at 16 rows
// costs more than its 16 vdpbf16ps; oneDNN's bf16 matmul at these sizes runs
// below both. Here the weight is already in the register layout vdpbf16ps
// multiplies, so a pair of input features costs one 64-byte load and one
// vdpbf16ps per row. Measured on the 2-core AVX512-BF16 EPYC (Zen 4, no AMX),
// every projection of SmolLM2-135M once (121 calls, weights from DRAM;
// benchmarks/linear_bench.py), ms per pass, this kernel / block codes /
// oneDNN bf16 prepacked: 16 rows 14.3-15.4 / 15.7-16.4 / 18.5-20.2, 32 rows
// 25.9-26.6 / 30.3-30.4 / 29.1-29.7; at 1 row the codes win (6.6 vs 9.6:
// half the bytes), from 64 rows oneDNN (worker/models/linear.py has the rest).
//
// Layout, 16 output features per panel (one AVX-512 register of float32):
//   pairs: [num_panels, K / 2, 32] bfloat16: word 2l + j of pair p is
//          W[16 panel + l, 2p + j]; panels past out_features are zeros.
// (kernels/bf16_pairs.py packs it; block_code_linear.cpp's weight_pairs
// builds the same words in registers from the codes.)
//
// Numerics: bfloat16 products exact, float32 sums in feature order (one
// accumulator per row and panel, as block_code_linear's bf16 tile), the bias
// added in float32, the output rounded once to bfloat16. For weights that are
// block codes the result is block_code_linear's, bit for bit.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>

#include "work_stealing.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kPairWords = 2 * kLanes;  // bfloat16 words per feature pair of a panel
constexpr int64_t kMaxRows = 16;            // rows per register tile: 16 accumulators
// Pairs (64 bytes each) to prefetch ahead: 2 KB. The weights stream from DRAM
// once per step; 2-16 KB ahead measured the same within noise, none 0.7x.
constexpr int64_t kPrefetchPairs = 32;

template <int ROWS>
void panel_tile(const uint16_t* x, int64_t K, const uint16_t* pairs, const uint16_t* next_pairs,
                const float* bias, uint16_t* y, int64_t ldy, int64_t valid_lanes) {
  __m512 acc[ROWS];
  for (int m = 0; m < ROWS; ++m) acc[m] = _mm512_setzero_ps();
  const int64_t num_pairs = K / 2;
  for (int64_t p = 0; p < num_pairs; ++p) {
    if ((p & 1) == 0) {  // two pairs per 128 bytes: both lines of the pair p + ahead
      const int64_t ahead = p + kPrefetchPairs;
      const uint16_t* line = ahead < num_pairs ? pairs + ahead * kPairWords
                             : next_pairs != nullptr
                                 ? next_pairs + (ahead - num_pairs) * kPairWords
                                 : nullptr;
      if (line != nullptr) {
        _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(line) + 64, _MM_HINT_T0);
      }
    }
    const __m512bh w = (__m512bh)_mm512_loadu_si512(pairs + p * kPairWords);
    for (int m = 0; m < ROWS; ++m) {
      int32_t x_pair;
      std::memcpy(&x_pair, x + m * K + 2 * p, sizeof(x_pair));
      acc[m] = _mm512_dpbf16_ps(acc[m], w, (__m512bh)_mm512_set1_epi32(x_pair));
    }
  }
  const __mmask16 mask =
      valid_lanes >= kLanes ? (__mmask16)0xFFFF : (__mmask16)((1u << valid_lanes) - 1);
  const __m512 b = bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, bias);
  for (int m = 0; m < ROWS; ++m) {
    const __m512 out = bias == nullptr ? acc[m] : _mm512_add_ps(acc[m], b);
    _mm256_mask_storeu_epi16(y + m * ldy, mask, (__m256i)_mm512_cvtneps_pbh(out));
  }
}

using TileFn = void (*)(const uint16_t*, int64_t, const uint16_t*, const uint16_t*, const float*,
                        uint16_t*, int64_t, int64_t);

template <int... R>
constexpr auto make_tiles(std::integer_sequence<int, R...>) {
  return std::array<TileFn, sizeof...(R)>{&panel_tile<R + 1>...};
}
constexpr auto kTiles = make_tiles(std::make_integer_sequence<int, kMaxRows>{});

at::Tensor bf16_pair_linear(const at::Tensor& x, const at::Tensor& pairs,
                            const std::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(),
              "bf16_pair_linear: x must be a contiguous bfloat16 [M, K] tensor");
  TORCH_CHECK(pairs.scalar_type() == at::kBFloat16 && pairs.dim() == 3 &&
                  pairs.is_contiguous() && pairs.size(2) == kPairWords,
              "bf16_pair_linear: pairs must be contiguous bfloat16 [panels, K / 2, 32]");
  const int64_t M = x.size(0), K = x.size(1), panels = pairs.size(0);
  TORCH_CHECK(K % 2 == 0 && pairs.size(1) == K / 2, "bf16_pair_linear: x has ", K,
              " features, pairs hold ", 2 * pairs.size(1));
  TORCH_CHECK(out_features > (panels - 1) * kLanes && out_features <= panels * kLanes,
              "bf16_pair_linear: out_features ", out_features, " does not match ", panels,
              " panels");
  at::Tensor bias_float;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features,
                "bf16_pair_linear: bias must be [out_features]");
    bias_float = bias->to(at::kFloat).contiguous();
  }
  at::Tensor y = at::empty({M, out_features}, x.options());
  if (M == 0) return y;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(pairs.data_ptr());
  const float* bp = bias_float.defined() ? bias_float.data_ptr<float>() : nullptr;
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t panel_words = (K / 2) * kPairWords;
  kvmesh::parallel_items(panels, [&](int64_t p, bool forward) {
    // The panel this thread most likely takes next, for the prefetcher.
    const int64_t next = forward ? p + 1 : p - 1;
    const uint16_t* next_pairs = next >= 0 && next < panels ? wp + next * panel_words : nullptr;
    const int64_t n0 = p * kLanes;
    const int64_t valid = std::min(kLanes, out_features - n0);
    // Every row tile after the first reads the panel from L1/L2.
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
      const int64_t rows = std::min(kMaxRows, M - m0);
      kTiles[rows - 1](xp + m0 * K, K, wp + p * panel_words, next_pairs,
                       bp == nullptr ? nullptr : bp + n0, yp + m0 * out_features + n0,
                       out_features, valid);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("bf16_pair_linear(Tensor x, Tensor pairs, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("bf16_pair_linear", &bf16_pair_linear); }

#endif  // __AVX512BF16__
