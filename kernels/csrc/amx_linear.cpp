// y = x Wᵀ (+ bias) in bfloat16 on AMX tiles, reading W [N, K] as it is
// stored: no packed copy of the weight.
//
// Why: below ~1,000 rows a projection is bound by reading W (a decode step)
// or by tile traffic, not by the multiplies. oneDNN's bfloat16 matmul wants
// its own prepacked copy of W to be fast at these sizes (and reorders a plain
// weight inside every call otherwise), which doubles a dense checkpoint's
// weight memory when the plain weight is also kept. Here the plain weight is
// enough: on the 2-core AMX Xeon VM this was written on (one thread, box
// loaded ~3 by a neighbour), ms per decode step of the 135M model's 121
// projections, this kernel vs oneDNN prepacked vs oneDNN plain: 16 rows
// 41.9 / 52.2 / 70.5, 64 rows 97.9 / 66.3 / 115.9, 256 rows 316.9 / 374.2 /
// 452.8, 512 rows 587.5 / 665.1 / 686.1; at 1,024 rows 1,886 vs ~1,100 for
// both oneDNN forms (compute-bound: oneDNN's blocking wins there).
//
// Roles are swapped so that W needs no packing: W is the A operand (a tile is
// 16 output rows x 32 features, loaded straight from W with its row stride,
// the next blocks' lines prefetched since 32 rows stream at once) and x the B
// operand, packed per call into the pair layout tdpbf16ps wants (tile row p
// holds features 2p, 2p + 1 of 16 tokens as 32-bit words: a transpose;
// tokens past M are zeros). Each C tile is 16 outputs x 16 tokens, written
// back transposed into y's rows. One item = 32 outputs (2 A tiles); each
// 32-token block (2 B tiles) runs the whole K loop into 4 accumulators, a
// last block of 16 or fewer tokens into 2.
// Numerics: bfloat16 products exact, float32 sums (tile order), the bias
// added in float32, the output rounded once to bfloat16.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

#include "amx_tiles.h"
#include "work_stealing.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)

namespace {

constexpr int64_t kTileRows = 16;      // outputs per A tile, tokens per B tile
constexpr int64_t kFeatureBlock = 32;  // features per tile row (16 bfloat16 pairs)
constexpr int64_t kTileBytes = 64;
constexpr int64_t kTileElems = kTileRows * kFeatureBlock;  // 512 bfloat16: 1 KB
constexpr int64_t kPairWords = kTileRows * kTileRows;      // one B tile in 32-bit words
constexpr int64_t kItemOutputs = 2 * kTileRows;            // 2 A tiles per item
// Feature blocks ahead whose W lines are prefetched (256 bytes per row):
// without it the 32 row streams of an item outran the hardware prefetcher
// (same measurement as above: 45-46 vs 39-40 ms per 1-row step).
constexpr int64_t kPrefetchBlocks = 4;

// Token block `block` (16 tokens) of x as one B tile per feature block.
void pack_tokens(const uint16_t* x, int64_t M, int64_t K, int64_t block, uint32_t* out) {
  const int64_t feature_blocks = K / kFeatureBlock;
  for (int64_t t = 0; t < kTileRows; ++t) {
    const int64_t m = block * kTileRows + t;
    for (int64_t kb = 0; kb < feature_blocks; ++kb) {
      uint32_t* tile = out + kb * kPairWords;
      uint32_t pairs[kTileRows] = {};
      if (m < M) std::memcpy(pairs, x + m * K + kb * kFeatureBlock, sizeof(pairs));
      for (int64_t p = 0; p < kTileRows; ++p) tile[p * kTileRows + t] = pairs[p];
    }
  }
}

// Accumulators 0..3 = (A tiles 4, 5: rows of w_lo, w_hi) x (B tiles 6, 7:
// tokens 0-15, 16-31 of the block); TWO_TOKEN_TILES false uses 0 and 1 only.
// `out` gets the C tiles one after the other, each c[output * 16 + token].
template <bool TWO_TOKEN_TILES>
inline void multiply(const uint16_t* w_lo, const uint16_t* w_hi, int64_t w_stride,
                     const uint32_t* b, int64_t feature_blocks, int64_t b_block_words,
                     float* out) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (TWO_TOKEN_TILES) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t w_stride_bytes = w_stride * static_cast<int64_t>(sizeof(uint16_t));
  for (int64_t kb = 0; kb < feature_blocks; ++kb) {
    if (kb + kPrefetchBlocks < feature_blocks) {
      const int64_t ahead = (kb + kPrefetchBlocks) * kFeatureBlock;
      for (int64_t r = 0; r < kTileRows; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(w_lo + r * w_stride + ahead), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(w_hi + r * w_stride + ahead), _MM_HINT_T0);
      }
    }
    const uint32_t* b_kb = b + kb * kPairWords;
    _tile_loadd(6, b_kb, kTileBytes);
    _tile_loadd(4, w_lo + kb * kFeatureBlock, w_stride_bytes);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(5, w_hi + kb * kFeatureBlock, w_stride_bytes);
    _tile_dpbf16ps(1, 5, 6);
    if constexpr (TWO_TOKEN_TILES) {
      _tile_loadd(7, b_kb + b_block_words, kTileBytes);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  constexpr long stride = kTileRows * sizeof(float);
  _tile_stored(0, out, stride);
  _tile_stored(1, out + kPairWords, stride);
  if constexpr (TWO_TOKEN_TILES) {
    _tile_stored(2, out + 2 * kPairWords, stride);
    _tile_stored(3, out + 3 * kPairWords, stride);
  }
}

// One C tile (c[output * 16 + token]) into the first `tokens` rows from `y`:
// y[t, o] = c[o, t] + bias[o], rounded to bfloat16.
inline void store_transposed(const float* c, const float* bias, uint16_t* y, int64_t ldy,
                             int64_t tokens) {
  const __m512i column = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
      _mm512_set1_epi32(kTileRows));
  const __m512 b = bias == nullptr ? _mm512_setzero_ps() : _mm512_loadu_ps(bias);
  for (int64_t t = 0; t < tokens; ++t) {
    const __m512 v = _mm512_add_ps(_mm512_i32gather_ps(column, c + t, sizeof(float)), b);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + t * ldy),
                        (__m256i)_mm512_cvtneps_pbh(v));
  }
}

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(),
              "amx_linear: x must be a contiguous bfloat16 [M, K] tensor");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 &&
                  weight.stride(1) == 1,
              "amx_linear: weight must be a bfloat16 [N, K] tensor with unit feature stride");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "amx_linear: x has ", K, " features, the weight ",
              weight.size(1));
  TORCH_CHECK(K % kFeatureBlock == 0, "amx_linear: K must be a multiple of 32, not ", K);
  TORCH_CHECK(N >= kTileRows, "amx_linear: at least 16 outputs, not ", N);
  const float* bias_data = nullptr;
  at::Tensor bias_float;
  if (bias.has_value()) {
    bias_float = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bias_float.dim() == 1 && bias_float.size(0) == N,
                "amx_linear: bias must be [out_features]");
    bias_data = bias_float.data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  kvmesh::require_amx_permission("amx_linear");

  // x as B tiles: [token blocks][K / 32][16 pairs][16 tokens] 32-bit words,
  // an even number of blocks (the last one zeros) so every step reads two.
  const int64_t feature_blocks = K / kFeatureBlock;
  const int64_t token_blocks = (M + kTileRows - 1) / kTileRows;
  const int64_t b_block_words = feature_blocks * kPairWords;
  at::Tensor x_packed = at::empty({(token_blocks + 1) / 2 * 2 * b_block_words},
                                  x.options().dtype(at::kInt));
  auto* bp = reinterpret_cast<uint32_t*>(x_packed.data_ptr());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  kvmesh::parallel_items(token_blocks, [&](int64_t block, bool) {
    pack_tokens(xp, M, K, block, bp + block * b_block_words);
  });
  if (token_blocks % 2) {
    std::memset(bp + token_blocks * b_block_words, 0, b_block_words * sizeof(uint32_t));
  }

  // Every A tile is 16 whole rows of W: an item whose outputs run past N
  // shifts its tile(s) back to end at row N (outputs computed twice are
  // written twice, with the same values).
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  const int64_t w_stride = weight.stride(0);
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t items = (N + kItemOutputs - 1) / kItemOutputs;
  kvmesh::parallel_items(items, [&](int64_t item, bool) {
    alignas(64) float c[4 * kPairWords];
    const kvmesh::TileConfig config = kvmesh::full_tiles_config(8);
    kvmesh::compiler_barrier();
    _tile_loadconfig(&config);  // this thread's; oneDNN configures its own
    const int64_t n_lo = std::min(item * kItemOutputs, N - kTileRows);
    const int64_t n_hi = std::min(item * kItemOutputs + kTileRows, N - kTileRows);
    const uint16_t* w_lo = wp + n_lo * w_stride;
    const uint16_t* w_hi = wp + n_hi * w_stride;
    for (int64_t block = 0; block < token_blocks; block += 2) {
      const int64_t tokens = std::min(2 * kTileRows, M - block * kTileRows);
      const uint32_t* b = bp + block * b_block_words;
      if (tokens > kTileRows) {
        multiply<true>(w_lo, w_hi, w_stride, b, feature_blocks, b_block_words, c);
      } else {
        multiply<false>(w_lo, w_hi, w_stride, b, feature_blocks, b_block_words, c);
      }
      for (int64_t half = 0; half < 2; ++half) {
        const int64_t n0 = half == 0 ? n_lo : n_hi;
        const float* bias_n0 = bias_data == nullptr ? nullptr : bias_data + n0;
        uint16_t* y0 = yp + block * kTileRows * N + n0;
        store_transposed(c + half * kPairWords, bias_n0, y0, N, std::min(tokens, kTileRows));
        if (tokens > kTileRows) {
          store_transposed(c + (2 + half) * kPairWords, bias_n0, y0 + kTileRows * N, N,
                           tokens - kTileRows);
        }
      }
    }
    _tile_release();
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("amx_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("amx_linear", &amx_linear); }

#endif  // AMX
