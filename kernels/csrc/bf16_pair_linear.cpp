// y = x Wᵀ (+ bias) for bfloat16 decode batches on AVX512-BF16 without AMX,
// over a copy of W packed once in vdpbf16ps's pair layout.
//
// Why: from ~8 bfloat16 rows on this level the block-code kernel
// (block_code_linear.cpp), which reads 1 byte per weight, spends more time
// rebuilding each 32 bfloat16 weights from their codes (~11 vector ops) than
// multiplying them (one vdpbf16ps per row), and oneDNN's bf16 matmul at these
// sizes runs below both. Here the weight is already in the register layout
// vdpbf16ps multiplies: per pair of input features and 16 outputs, one
// 64-byte load and one vdpbf16ps per row. Measured on the 2-core AVX512-BF16
// EPYC (Zen 4, no AMX), every projection of SmolLM2-135M once (121 calls,
// weights from DRAM; benchmarks/linear_bench.py), ms per pass, this kernel /
// block codes / oneDNN bf16 prepacked: 16 rows 13.1-13.2 / 16.2-16.4 /
// 20.0-20.7, 64 rows 45.3-46.0 / 58.4-63.2 / 54.4-57.4; at 1-4 rows the codes
// win (6.3 vs 9.5 at 1: half the bytes), from ~128 rows oneDNN
// (worker/models/linear.py has the rest).
//
// Layout, 32 output features per item (two AVX-512 registers of float32):
//   pairs: [num_items, K / 2, 64] bfloat16: word 2l + j of pair p is
//          W[32 item + l, 2p + j]; items past out_features are zeros.
// (kernels/bf16_pairs.py packs it; block_code_linear.cpp's weight_pairs
// builds the same words, 16 outputs at a time, in registers from the codes.)
// Two 16-output halves per item let one broadcast of a row's feature pair
// feed two vdpbf16ps: with one half per item the broadcasts held a weight in
// L2 to ~0.7x the speed (one 3072 x 576 weight, 16 rows: 148.6 vs 208.2 us).
// A row tile is up to 12 rows (24 accumulators); the first tile streams the
// item's weights from DRAM, later tiles of the same item find them in L1/L2.
//
// Numerics: bfloat16 products exact, float32 sums in feature order (one
// accumulator per row and output lane, as block_code_linear's bf16 tile), the
// bias added in float32, the output rounded once to bfloat16. For weights that
// are block codes the result is block_code_linear's, bit for bit.

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
constexpr int64_t kItemOutputs = 2 * kLanes;
constexpr int64_t kPairWords = 2 * kItemOutputs;  // bfloat16 words per feature pair of an item
constexpr int64_t kMaxRows = 12;                  // rows per register tile: 24 accumulators
// Pairs (128 bytes each) to prefetch ahead: 4 KB. The weights stream from DRAM
// once per step; 2-16 KB ahead measured the same within noise, none 0.7x.
constexpr int64_t kPrefetchPairs = 32;

inline __mmask16 lane_mask(int64_t valid_lanes) {
  if (valid_lanes >= kLanes) return 0xFFFF;
  return valid_lanes <= 0 ? 0 : (__mmask16)((1u << valid_lanes) - 1);
}

template <int ROWS>
void item_tile(const uint16_t* x, int64_t K, const uint16_t* pairs, const uint16_t* next_pairs,
               const float* bias, uint16_t* y, int64_t ldy, int64_t valid_outputs) {
  __m512 acc_lo[ROWS], acc_hi[ROWS];
  for (int m = 0; m < ROWS; ++m) acc_lo[m] = acc_hi[m] = _mm512_setzero_ps();
  const int64_t num_pairs = K / 2;
  for (int64_t p = 0; p < num_pairs; ++p) {
    const int64_t ahead = p + kPrefetchPairs;
    const uint16_t* line = ahead < num_pairs ? pairs + ahead * kPairWords
                           : next_pairs != nullptr
                               ? next_pairs + (ahead - num_pairs) * kPairWords
                               : nullptr;
    if (line != nullptr) {
      _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(line) + 64, _MM_HINT_T0);
    }
    const __m512bh w_lo = (__m512bh)_mm512_loadu_si512(pairs + p * kPairWords);
    const __m512bh w_hi = (__m512bh)_mm512_loadu_si512(pairs + p * kPairWords + kLanes * 2);
    for (int m = 0; m < ROWS; ++m) {
      int32_t x_pair;
      std::memcpy(&x_pair, x + m * K + 2 * p, sizeof(x_pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(x_pair);
      acc_lo[m] = _mm512_dpbf16_ps(acc_lo[m], w_lo, xv);
      acc_hi[m] = _mm512_dpbf16_ps(acc_hi[m], w_hi, xv);
    }
  }
  const __mmask16 mask_lo = lane_mask(valid_outputs), mask_hi = lane_mask(valid_outputs - kLanes);
  __m512 bias_lo = _mm512_setzero_ps(), bias_hi = _mm512_setzero_ps();
  if (bias != nullptr) {
    bias_lo = _mm512_maskz_loadu_ps(mask_lo, bias);
    bias_hi = _mm512_maskz_loadu_ps(mask_hi, bias + kLanes);
  }
  for (int m = 0; m < ROWS; ++m) {
    const __m512 lo = bias == nullptr ? acc_lo[m] : _mm512_add_ps(acc_lo[m], bias_lo);
    const __m512 hi = bias == nullptr ? acc_hi[m] : _mm512_add_ps(acc_hi[m], bias_hi);
    _mm256_mask_storeu_epi16(y + m * ldy, mask_lo, (__m256i)_mm512_cvtneps_pbh(lo));
    _mm256_mask_storeu_epi16(y + m * ldy + kLanes, mask_hi, (__m256i)_mm512_cvtneps_pbh(hi));
  }
}

using TileFn = void (*)(const uint16_t*, int64_t, const uint16_t*, const uint16_t*, const float*,
                        uint16_t*, int64_t, int64_t);

template <int... R>
constexpr auto make_tiles(std::integer_sequence<int, R...>) {
  return std::array<TileFn, sizeof...(R)>{&item_tile<R + 1>...};
}
constexpr auto kTiles = make_tiles(std::make_integer_sequence<int, kMaxRows>{});

at::Tensor bf16_pair_linear(const at::Tensor& x, const at::Tensor& pairs,
                            const std::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(),
              "bf16_pair_linear: x must be a contiguous bfloat16 [M, K] tensor");
  TORCH_CHECK(pairs.scalar_type() == at::kBFloat16 && pairs.dim() == 3 &&
                  pairs.is_contiguous() && pairs.size(2) == kPairWords,
              "bf16_pair_linear: pairs must be contiguous bfloat16 [items, K / 2, 64]");
  const int64_t M = x.size(0), K = x.size(1), items = pairs.size(0);
  TORCH_CHECK(K % 2 == 0 && pairs.size(1) == K / 2, "bf16_pair_linear: x has ", K,
              " features, pairs hold ", 2 * pairs.size(1));
  TORCH_CHECK(out_features > (items - 1) * kItemOutputs && out_features <= items * kItemOutputs,
              "bf16_pair_linear: out_features ", out_features, " does not match ", items,
              " items of 32 outputs");
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
  const int64_t item_words = (K / 2) * kPairWords;
  kvmesh::parallel_items(items, [&](int64_t item, bool forward) {
    // The item this thread most likely takes next, for the prefetcher.
    const int64_t next = forward ? item + 1 : item - 1;
    const uint16_t* next_pairs = next >= 0 && next < items ? wp + next * item_words : nullptr;
    const int64_t n0 = item * kItemOutputs;
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
      const int64_t rows = std::min(kMaxRows, M - m0);
      kTiles[rows - 1](xp + m0 * K, K, wp + item * item_words, m0 == 0 ? next_pairs : nullptr,
                       bp == nullptr ? nullptr : bp + n0, yp + m0 * out_features + n0,
                       out_features, out_features - n0);
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
