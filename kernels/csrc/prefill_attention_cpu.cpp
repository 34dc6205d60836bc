// Paged prefill (chunk) attention for bfloat16 and float32, as a torch custom
// op. bfloat16: the matrix products on AMX tiles at the amx level, on
// AVX512-BF16 dot products (vdpbf16ps) at the avx512_bf16 level, the same
// packed operands for both. float32: fused multiply-adds on 16-lane vectors
// (vec16.h: one AVX-512 or two AVX2 registers), at every level from avx2 up
// (K^T packed as 16 keys per vector, V as its rows).
//
// Every prefill chunk of a step in one call. A chunk's query rows attend to
// its context (cached prefix + the chunk itself), causally: query row i of a
// chunk whose prefix holds P tokens sees keys 0..P+i. K/V are read from the
// paged cache through the chunk's block table, never gathered by torch.
//
// Two passes over torch's threads (work_stealing.h):
//  1. Pack: each (chunk, KV head, 64-key block) copies its K and V rows out of
//     the cache once into the operand layouts the products want. bfloat16:
//     what tdpbf16ps wants (B tiles), which is also what vdpbf16ps wants (a
//     tile row is one 512-bit register of 16 lanes, each a bfloat16 pair):
//       K^T: per 16 keys x 32 head dims, tile row r = dims (2r, 2r+1) of the
//            16 keys, interleaved: a 16x16 transpose of 32-bit dim pairs;
//       V:   per 32 keys x 16 head dims, tile row r = keys (2r, 2r+1)
//            interleaved dim by dim (the VNNI pair layout).
//     float32: K^T per 16 keys as head_dim vectors of the 16 keys' values of
//     one dim; V as its rows.
//     Keys past the context are zeros (finite, so masked 0 x V stays 0).
//  2. Attend, flash-attention style: each (chunk, KV head, 16 query rows)
//     runs the GQA group's query heads over the same packed K/V, the heads
//     one after the other within each step of keys (so a step's K/V is hot
//     in L1/L2 for all of them), key blocks of 64 up to the causal limit
//     (blocks past it skipped, only blocks crossing it masked; float32 stops
//     at the 16-key tile of the last key):
//       S = Q K^T (AMX: Q rows are A tiles as they are, 32 dims each;
//           vdpbf16ps: each query row's dim pair broadcast against a K^T tile
//           row; float32: each query value against a 16-key vector),
//       online softmax in float32 (running max and sum per row),
//       P (bfloat16: rounded) V, the same ways with P in place of Q,
//       O = O * alpha + P V in float32,
//     and the output rounded once to its dtype at the end.
//
// A sliding window W (Mistral, Gemma 2/3): query row at position p sees keys
// p - W < j <= p. A chunk packs keys from its first row's window start only
// (rounded down to 64 keys, the keys before the start zeros, never read: the
// block table may hold a freed block's null id there), and a row tile starts
// at its first row's window start; steps crossing a row's start are masked
// like the causal limit. A soft-cap c (Gemma 2): each step's scaled scores
// become c * tanh(s / c) before the softmax.
//
// Numerics versus the float32 reference (kernels/reference.py): q, K and V are
// bfloat16 already; products are exact and summed in float32; P is rounded to
// bfloat16 before P V (as torch's bfloat16 SDPA does), the sums of P stay
// float32. Errors are of the order of bfloat16 rounding of the output. In
// float32 only the order of the sums and the exp polynomial differ from the
// reference: errors of a few float32 ulps of the output.

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "amx_tiles.h"
#include "work_stealing.h"

// Built from the avx2 level up (kernels/native.py skips generic); bfloat16
// only where the level has AVX512-BF16.
#if defined(__AVX2__) && defined(__FMA__)

#include <immintrin.h>

#include "kv_codes.h"
#include "vec16.h"

#include <type_traits>

namespace {

constexpr int64_t kTileRows = 16;    // query rows per item (one A tile's rows)
constexpr int64_t kKeyBlock = 64;    // keys per Q K^T pass (4 S tiles of 16) and per pack item
// Keys per softmax step: up to 4 Q K^T passes, each stored to the score rows,
// then one online-softmax update and one P V (accumulated in tiles over all
// the step's keys) per row. On the 2-core AMX Xeon VM, 1,024-token causal
// chunk (9 heads, head_dim 64), one thread, interleaved runs: 64-key steps
// 9.65-9.71 ms per call, 256-key steps 8.33-8.76 ms (fewer P V stores, float32
// output updates and horizontal reductions per key).
constexpr int64_t kStepKeys = 256;
constexpr int64_t kKeyTile = 16;     // keys per S tile (its float32 columns)
constexpr int64_t kPairKeys = 32;    // keys per P V step (bfloat16 pairs of an A row)
constexpr int64_t kDimChunk = 32;    // head dims per Q K^T step
constexpr int64_t kDimTile = 16;     // head dims per output tile
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kTileBytes = 64;
constexpr float kNoScore = -1e30f;  // finite "minus infinity": the float maths stays finite

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// Tiles: 0..3 accumulators (S columns, then P V columns), 4 the A operand
// (Q, then P), 5 the B operand (K^T, then V). GCC pastes tile numbers into
// its asm, so they are literals.
kvmesh::TileConfig tile_config() { return kvmesh::full_tiles_config(6); }

// Accumulator `c` += tile 4 x tile 5.
inline void multiply_into(int64_t c) {
  switch (c) {
    case 0: _tile_dpbf16ps(0, 4, 5); break;
    case 1: _tile_dpbf16ps(1, 4, 5); break;
    case 2: _tile_dpbf16ps(2, 4, 5); break;
    default: _tile_dpbf16ps(3, 4, 5); break;
  }
}

inline void store_accumulator(int64_t c, float* dst, int64_t stride_bytes) {
  switch (c) {
    case 0: _tile_stored(0, dst, stride_bytes); break;
    case 1: _tile_stored(1, dst, stride_bytes); break;
    case 2: _tile_stored(2, dst, stride_bytes); break;
    default: _tile_stored(3, dst, stride_bytes); break;
  }
}

inline void zero_accumulators() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}
#endif

using kvmesh::exp16;
using kvmesh::Vec16;

// The packed K^T and V of one (chunk, KV head): `padded_len` keys (a multiple
// of kKeyBlock), each half padded_len * head_dim words (bfloat16 or float32),
// so the 64-key block from key k starts k * head_dim words in, in both halves.
//   bfloat16 K^T [padded_len / 16][head_dim / 32][16 rows][32 words]
//            V   [padded_len / 32][head_dim / 16][16 rows][32 words]
//   float32  K^T [padded_len / 16][head_dim][16 keys]
//            V   [padded_len][head_dim] (the rows as they are)
template <typename Word>
struct PackedKv {
  const Word* kt;
  const Word* v;
};

// Where pass 1 reads one KV head's K and V rows, in the products' word type
// (float32, or bfloat16 bits): a model-dtype cache's rows as they are (C =
// Word), or a quantized cache's codes times their row's scale (kv_codes.h),
// widened in registers, a bfloat16 word rounded once from that float32 value.
template <typename Word, typename C>
struct KvRows {
  const C* k;  // the caches' first rows, not offset by head
  const C* v;
  const int64_t* table;
  int64_t block_size, block_stride, row_stride, num_kv_heads, head, head_dim;

  static constexpr bool kCodes = kvmesh::kIsCode<C>;

  const C* row(const C* base, int64_t key) const {
    return base + table[key / block_size] * block_stride + key % block_size * row_stride +
           head * head_dim;
  }
  float scale(const C* base, int64_t key) const {
    const float* scales = kvmesh::page_scales(base, table[key / block_size], block_stride,
                                              block_size, num_kv_heads);
    return scales[key % block_size * num_kv_heads + head];
  }
  void into(const C* base, int64_t key, Word* dst) const {
    if constexpr (!kCodes) {
      std::memcpy(dst, row(base, key), head_dim * sizeof(Word));
    } else {
      const C* codes = row(base, key);
      const Vec16 s = Vec16::splat(scale(base, key));
      for (int64_t d = 0; d < head_dim; d += 16) {
        const Vec16 x = kvmesh::load_codes(codes + d) * s;
        if constexpr (std::is_same_v<Word, float>) {
          x.store(dst + d);
        } else {
          x.store_bf16(dst + d);
        }
      }
    }
  }
  void k_into(int64_t key, Word* dst) const { into(k, key, dst); }
  void v_into(int64_t key, Word* dst) const { into(v, key, dst); }
  // Key `key`'s K row: in the cache itself, or dequantized into `scratch`.
  const Word* k_row(int64_t key, Word* scratch) const {
    if constexpr (!kCodes) {
      return row(k, key);
    } else {
      into(k, key, scratch);
      return scratch;
    }
  }
};

#if defined(__AVX512BF16__)
// Pass 1 for one 64-key block: keys [key0, key0 + 64) of one KV head, bfloat16.
template <typename Rows>
void pack_block_bf16(uint16_t* kt, uint16_t* v, const Rows& rows, int64_t first_key,
                     int64_t context_len, int64_t key0, int64_t head_dim) {
  alignas(64) uint16_t rows_k[kKeyBlock][kMaxHeadDim];
  alignas(64) uint16_t rows_v[kKeyBlock][kMaxHeadDim];
  for (int64_t j = 0; j < kKeyBlock; ++j) {
    const int64_t key = key0 + j;
    if (key >= first_key && key < context_len) {
      rows.k_into(key, rows_k[j]);
      rows.v_into(key, rows_v[j]);
    } else {
      std::memset(rows_k[j], 0, head_dim * sizeof(uint16_t));
      std::memset(rows_v[j], 0, head_dim * sizeof(uint16_t));
    }
  }
  const int64_t dim_chunks = head_dim / kDimChunk, dim_tiles = head_dim / kDimTile;
  // K^T tiles: [key tile][dim chunk][r][2n + i] = K[n][chunk * 32 + 2r + i].
  for (int64_t kt_i = 0; kt_i < kKeyBlock / kKeyTile; ++kt_i) {
    for (int64_t dc = 0; dc < dim_chunks; ++dc) {
      uint32_t* tile = reinterpret_cast<uint32_t*>(kt + (kt_i * dim_chunks + dc) * 512);
      for (int64_t n = 0; n < kKeyTile; ++n) {
        const uint32_t* pairs =
            reinterpret_cast<const uint32_t*>(rows_k[kt_i * kKeyTile + n] + dc * kDimChunk);
        for (int64_t r = 0; r < 16; ++r) tile[r * 16 + n] = pairs[r];
      }
    }
  }
  // V tiles: [key pair block][dim tile][r][2j + i] = V[32 * block + 2r + i][16 * tile + j].
  for (int64_t pb = 0; pb < kKeyBlock / kPairKeys; ++pb) {
    for (int64_t dt = 0; dt < dim_tiles; ++dt) {
      uint16_t* tile = v + (pb * dim_tiles + dt) * 512;
      for (int64_t r = 0; r < 16; ++r) {
        const uint16_t* even = rows_v[pb * kPairKeys + 2 * r] + dt * kDimTile;
        const uint16_t* odd = rows_v[pb * kPairKeys + 2 * r + 1] + dt * kDimTile;
        for (int64_t j = 0; j < kDimTile; ++j) {
          tile[r * 32 + 2 * j] = even[j];
          tile[r * 32 + 2 * j + 1] = odd[j];
        }
      }
    }
  }
}
#endif

// Pass 1 in float32: K^T as 16-key vectors per head dim, V rows copied.
template <typename Rows>
void pack_block_f32(float* kt, float* v, const Rows& rows, int64_t first_key,
                    int64_t context_len, int64_t key0, int64_t head_dim) {
  alignas(64) float scratch[kMaxHeadDim];
  for (int64_t j = 0; j < kKeyBlock; ++j) {
    const int64_t key = key0 + j;
    float* kt_lane = kt + (j / kKeyTile) * head_dim * kKeyTile + j % kKeyTile;
    if (key >= first_key && key < context_len) {
      const float* k_row = rows.k_row(key, scratch);
      for (int64_t d = 0; d < head_dim; ++d) kt_lane[d * kKeyTile] = k_row[d];
      rows.v_into(key, v + j * head_dim);
    } else {
      for (int64_t d = 0; d < head_dim; ++d) kt_lane[d * kKeyTile] = 0.f;
      std::memset(v + j * head_dim, 0, head_dim * sizeof(float));
    }
  }
}

// A probability as P V will multiply it: bfloat16 P rounded (and its rounded
// value returned, for the row sums), float32 P as it is.
inline Vec16 store_probabilities(float* p, Vec16 e) {
  e.store(p);
  return e;
}

// One output row chunk of 16 dims, rounded to the output's type.
inline void store_output(float* out, Vec16 y) { y.store(out); }

#if defined(__AVX512BF16__)
inline Vec16 store_probabilities(uint16_t* p, Vec16 e) { return e.store_bf16_rounded(p); }

inline void store_output(uint16_t* out, Vec16 y) { y.store_bf16(out); }
#endif

// 2^x for the probabilities of the bfloat16 path, x a scaled score minus its
// row's max in base-2 units (the scale folded into the multiply-add that
// subtracts the max), so at most a rounding above 0, and finite. A degree-4
// polynomial in r = x - round(x), |r| <= 1/2 (Taylor in r ln 2): relative
// error ~4e-5, far below the bfloat16 rounding of P that follows, as
// exp16<false>; four fewer instructions a vector (no range reduction by
// ln 2, no clamps: vscalefps underflows to 0 for very negative n). A
// 1,024-token chunk (9 heads, head_dim 64) on the Zen 4 EPYC: 4.07 vs 4.22 ms.
inline Vec16 exp2_probabilities(Vec16 x) {
#if !defined(__AVX512F__)
  x = Vec16::max(x, Vec16::splat(-126.f));  // the AVX2 times_pow2 needs a normal 2^n
#endif
  const Vec16 n = x.round_nearest();
  const Vec16 r = x - n;
  Vec16 p = Vec16::fma(Vec16::splat(9.6181291e-3f), r, Vec16::splat(5.5504109e-2f));
  p = Vec16::fma(p, r, Vec16::splat(2.4022651e-1f));
  p = Vec16::fma(p, r, Vec16::splat(6.9314718e-1f));
  p = Vec16::fma(p, r, Vec16::splat(1.f));
  return p.times_pow2(n);
}

// The online softmax of one step of `width` keys (a multiple of 16, at most
// kStepKeys) for 16 rows, one row at a time: new running max of the scaled
// scores, alpha = exp(old max - new max) per row, p = exp(scaled scores - new
// max) as P V takes it (store_probabilities; 0 past the row's causal limit
// unless WHOLE: no key of the step is past any row's limit), row sums rescaled
// by alpha plus the stored p. Rows of s and p are kStepKeys apart.
//   first_limit: the last key row 0 may see (prefix + its index in the chunk)
//   window: > 0, row r sees no key before first_limit + r - window + 1 either
template <bool WHOLE, typename Word>
void softmax_step(const float* s, Word* p, int64_t width, float* row_max, float* row_sum,
                  float* alpha, int64_t key0, int64_t first_limit, int64_t context_len,
                  int64_t window, float scale) {
  constexpr bool kPrecise = std::is_same_v<Word, float>;
  const Vec16 scale_v = Vec16::splat(scale), no_score = Vec16::splat(kNoScore);
  constexpr float kLog2e = 1.44269504088896341f;
  const Vec16 scale_log2e = Vec16::splat(scale * kLog2e);
  alignas(64) float old_max[kTileRows], step_sum[kTileRows];
  for (int64_t r = 0; r < kTileRows; ++r) {
    const float* s_row = s + r * kStepKeys;
    Word* p_row = p + r * kStepKeys;
    const int64_t visible = std::min(first_limit + r, context_len - 1) - key0 + 1;
    // Keys of the step before the row's window start (none without a window).
    const int64_t before = window > 0 ? first_limit + r - window + 1 - key0 : 0;
    Vec16 step_max = no_score;
    for (int64_t k = 0; k < width; k += kKeyTile) {
      Vec16 x = Vec16::load(s_row + k);
      if constexpr (!WHOLE) {
        x = Vec16::first_lanes(visible - k, x, no_score);
        x = Vec16::first_lanes(before - k, no_score, x);
      }
      step_max = Vec16::max(step_max, x);
    }
    // scale > 0, so the max of the scaled scores is the scaled max.
    const float new_max = std::max(row_max[r], step_max.reduce_max() * scale);
    old_max[r] = row_max[r];
    row_max[r] = new_max;
    Vec16 sum = Vec16::zero();
    for (int64_t k = 0; k < width; k += kKeyTile) {
      const Vec16 scores = Vec16::load(s_row + k);
      Vec16 e;
      if constexpr (kPrecise) {
        e = exp16<true>(Vec16::fma(scores, scale_v, Vec16::splat(-new_max)));
      } else {
        e = exp2_probabilities(Vec16::fma(scores, scale_log2e, Vec16::splat(-new_max * kLog2e)));
      }
      if constexpr (!WHOLE) {
        e = Vec16::first_lanes(visible - k, e, Vec16::zero());
        e = Vec16::first_lanes(before - k, Vec16::zero(), e);
      }
      // Sum what P V will multiply: the stored (for bfloat16, rounded) probabilities.
      sum = sum + store_probabilities(p_row + k, e);
    }
    step_sum[r] = sum.reduce_add();
  }
  // All 16 rows' alpha in one vector (one exp16 instead of 16 calls).
  static_assert(kTileRows == 16, "one vector per 16 rows");
  const Vec16 a = exp16<kPrecise>(Vec16::load(old_max) - Vec16::load(row_max));
  a.store(alpha);
  Vec16::fma(Vec16::load(row_sum), a, Vec16::load(step_sum)).store(row_sum);
}

// The two matrix products of pass 2, one struct per instruction set:
//   scores: S[16 rows][64 keys] = Q K^T for one 64-key block, rows of `s`
//           kStepKeys floats apart; `kt` is the block's first K^T tile.
//   values: PV[16 rows][head_dim] = P V over `width` keys (a multiple of 64),
//           rows of `pv` head_dim floats apart; `v` is the first key's V tile.
//   Scope: what a thread holds while it runs items (AMX: the tile config).
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
struct AmxProducts {
  using Word = uint16_t;
  static constexpr int64_t kWidthKeys = kKeyBlock;  // whole 64-key blocks of tiles
  template <typename Rows>
  static void pack(uint16_t* kt, uint16_t* v, const Rows& rows, int64_t first_key,
                   int64_t context_len, int64_t key0, int64_t head_dim) {
    pack_block_bf16(kt, v, rows, first_key, context_len, key0, head_dim);
  }

  static void scores(float* s, const uint16_t* q_tile, const uint16_t* kt, int64_t head_dim,
                     int64_t /*tiles: always the block's 4*/) {
    const int64_t dim_chunks = head_dim / kDimChunk;
    zero_accumulators();
    kvmesh::compiler_barrier();
    for (int64_t dc = 0; dc < dim_chunks; ++dc) {
      _tile_loadd(4, q_tile + dc * kDimChunk, head_dim * sizeof(uint16_t));
      for (int64_t t = 0; t < kKeyBlock / kKeyTile; ++t) {
        _tile_loadd(5, kt + (t * dim_chunks + dc) * 512, kTileBytes);
        multiply_into(t);
      }
    }
    for (int64_t t = 0; t < kKeyBlock / kKeyTile; ++t) {
      store_accumulator(t, s + t * kKeyTile, kStepKeys * sizeof(float));
    }
    kvmesh::compiler_barrier();
  }

  static void values(float* pv, const uint16_t* p, const uint16_t* v, int64_t width,
                     int64_t head_dim) {
    const int64_t dim_tiles = head_dim / kDimTile;
    // Up to 4 output tiles of 16 dims at a time.
    for (int64_t dt0 = 0; dt0 < dim_tiles; dt0 += 4) {
      const int64_t tiles = std::min<int64_t>(4, dim_tiles - dt0);
      zero_accumulators();
      for (int64_t k = 0; k < width; k += kPairKeys) {
        kvmesh::compiler_barrier();
        _tile_loadd(4, p + k, kStepKeys * sizeof(uint16_t));
        for (int64_t t = 0; t < tiles; ++t) {
          _tile_loadd(5, v + ((k / kPairKeys) * dim_tiles + dt0 + t) * 512, kTileBytes);
          multiply_into(t);
        }
      }
      for (int64_t t = 0; t < tiles; ++t) {
        store_accumulator(t, pv + (dt0 + t) * kDimTile, head_dim * sizeof(float));
      }
    }
    kvmesh::compiler_barrier();
  }

  struct Scope {
    Scope() {
      const kvmesh::TileConfig config = tile_config();
      _tile_loadconfig(&config);  // this thread's; oneDNN configures its own between ops
    }
    ~Scope() { _tile_release(); }
  };
};
using Bf16Products = AmxProducts;
#elif defined(__AVX512BF16__)
// vdpbf16ps: lane n += a[2n] * b[2n] + a[2n + 1] * b[2n + 1] in float32. A
// packed tile row is one register of 16 lanes of pairs (K^T: 16 keys' dims
// 2r, 2r + 1; V: 16 dims of keys 2r, 2r + 1), so each query (or P) row's
// pair, broadcast to all lanes, multiplies it: 4 rows x 4 tile columns of
// accumulators per pass, 16 of the 32 registers.
struct VectorProducts {
  using Word = uint16_t;
  static constexpr int64_t kWidthKeys = kKeyBlock;  // P V takes whole 32-key pairs blocks
  template <typename Rows>
  static void pack(uint16_t* kt, uint16_t* v, const Rows& rows, int64_t first_key,
                   int64_t context_len, int64_t key0, int64_t head_dim) {
    pack_block_bf16(kt, v, rows, first_key, context_len, key0, head_dim);
  }
  static constexpr int64_t kRows = 4;

  static __m512bh pair_of(const uint16_t* words) {
    int32_t pair;
    std::memcpy(&pair, words, sizeof(pair));
    return (__m512bh)_mm512_set1_epi32(pair);
  }

  static __m512bh row_of(const uint16_t* tile_row) {
    return (__m512bh)_mm512_loadu_si512(tile_row);  // std::vector: 16-byte aligned
  }

  static void scores(float* s, const uint16_t* q_tile, const uint16_t* kt, int64_t head_dim,
                     int64_t /*tiles: always the block's 4*/) {
    constexpr int64_t kTiles = kKeyBlock / kKeyTile;
    const int64_t dim_chunks = head_dim / kDimChunk;
    for (int64_t r0 = 0; r0 < kTileRows; r0 += kRows) {
      __m512 acc[kRows][kTiles];
      for (auto& row : acc) {
        for (auto& a : row) a = _mm512_setzero_ps();
      }
      for (int64_t dc = 0; dc < dim_chunks; ++dc) {
        for (int64_t r = 0; r < 16; ++r) {
          __m512bh k[kTiles];
          for (int64_t t = 0; t < kTiles; ++t) {
            k[t] = row_of(kt + (t * dim_chunks + dc) * 512 + r * 32);
          }
          for (int64_t i = 0; i < kRows; ++i) {
            const __m512bh q = pair_of(q_tile + (r0 + i) * head_dim + dc * kDimChunk + 2 * r);
            for (int64_t t = 0; t < kTiles; ++t) acc[i][t] = _mm512_dpbf16_ps(acc[i][t], q, k[t]);
          }
        }
      }
      for (int64_t i = 0; i < kRows; ++i) {
        for (int64_t t = 0; t < kTiles; ++t) {
          _mm512_store_ps(s + (r0 + i) * kStepKeys + t * kKeyTile, acc[i][t]);
        }
      }
    }
  }

  template <int64_t kTiles>
  static void values_tiles(float* pv, const uint16_t* p, const uint16_t* v, int64_t width,
                           int64_t head_dim, int64_t dt0) {
    const int64_t dim_tiles = head_dim / kDimTile;
    for (int64_t r0 = 0; r0 < kTileRows; r0 += kRows) {
      __m512 acc[kRows][kTiles];
      for (auto& row : acc) {
        for (auto& a : row) a = _mm512_setzero_ps();
      }
      for (int64_t k = 0; k < width; k += kPairKeys) {
        const uint16_t* v_block = v + ((k / kPairKeys) * dim_tiles + dt0) * 512;
        for (int64_t r = 0; r < 16; ++r) {
          __m512bh vr[kTiles];
          for (int64_t t = 0; t < kTiles; ++t) vr[t] = row_of(v_block + t * 512 + r * 32);
          for (int64_t i = 0; i < kRows; ++i) {
            const __m512bh pr = pair_of(p + (r0 + i) * kStepKeys + k + 2 * r);
            for (int64_t t = 0; t < kTiles; ++t) acc[i][t] = _mm512_dpbf16_ps(acc[i][t], pr, vr[t]);
          }
        }
      }
      for (int64_t i = 0; i < kRows; ++i) {
        for (int64_t t = 0; t < kTiles; ++t) {
          _mm512_store_ps(pv + (r0 + i) * head_dim + (dt0 + t) * kDimTile, acc[i][t]);
        }
      }
    }
  }

  static void values(float* pv, const uint16_t* p, const uint16_t* v, int64_t width,
                     int64_t head_dim) {
    // head_dim is a multiple of 32: whole groups of 4 dim tiles, then maybe 2.
    const int64_t dim_tiles = head_dim / kDimTile;
    int64_t dt0 = 0;
    for (; dt0 + 4 <= dim_tiles; dt0 += 4) values_tiles<4>(pv, p, v, width, head_dim, dt0);
    if (dt0 < dim_tiles) values_tiles<2>(pv, p, v, width, head_dim, dt0);
  }

  struct Scope {};
};
using Bf16Products = VectorProducts;
#endif

// float32: a query (or P) row's value broadcast against 16 keys' (or dims')
// values, a group of rows x kTiles vectors of accumulators per pass.
struct Float32Products {
  using Word = float;
  // A step's last Q K^T pass stops at the 16-key tile holding the last key
  // (not the 64-key block): the causal diagonal's masked keys cost a quarter
  // of what they did. The skipped keys' p would be exact zeros, whose P V
  // terms add nothing: the same sums in the same order, bit-identical output.
  static constexpr int64_t kWidthKeys = kKeyTile;
  template <typename Rows>
  static void pack(float* kt, float* v, const Rows& rows, int64_t first_key, int64_t context_len,
                   int64_t key0, int64_t head_dim) {
    pack_block_f32(kt, v, rows, first_key, context_len, key0, head_dim);
  }
#if defined(__AVX512F__)
  // 4 rows x 4 vectors: 16 of the 32 zmm registers.
  static constexpr int64_t kTiles = 4;
  template <class F>
  static void for_row_groups(const F& f) {
    for (int64_t r0 = 0; r0 < kTileRows; r0 += 4) f.template operator()<4>(r0);
  }
#else
  // One Vec16 (two ymm) per row: 6 + 5 + 5 rows, so 12 or 10 of the 16 ymm
  // registers accumulate, beside the K^T (or V) vector and the broadcast.
  // Fewer starve the FMA pipes: two pipes of 5-cycle latency (Zen 2) want
  // 10 FMAs in flight, and 4 rows hold 8: the earlier 6 + 6 + 4 split's last
  // group could not keep them busy. (6 + 6 + 4 itself, on the 2-core
  // Zen 4 EPYC at the avx2 level, builds alternating: one thread 78 vs 75
  // GFLOP/s, medians of 8 runs; two threads 8.6 vs 9.4 ms per 1,024-token
  // chunk, 9 heads of 64, medians of 9 and 6 on a noisy host.) The same FMAs
  // in the same order per output whatever the split: bit-identical results.
  static constexpr int64_t kTiles = 1;
  template <class F>
  static void for_row_groups(const F& f) {
    f.template operator()<6>(0);
    f.template operator()<5>(6);
    f.template operator()<5>(11);
  }
#endif
  static_assert(kTileRows == 16, "the row groups cover 16 rows");

  // `tiles` (1..4) of the block's 16-key tiles; kTiles divides 4, and a
  // group's tiles past `tiles` are computed anyway (the AVX-512 group of 4).
  static void scores(float* s, const float* q_tile, const float* kt, int64_t head_dim,
                     int64_t tiles) {
    for_row_groups([&]<int64_t kRows>(int64_t r0) {
      for (int64_t t0 = 0; t0 < tiles; t0 += kTiles) {
        Vec16 acc[kRows][kTiles];
        for (auto& row : acc) {
          for (auto& a : row) a = Vec16::zero();
        }
        for (int64_t d = 0; d < head_dim; ++d) {
          Vec16 k[kTiles];
          for (int64_t t = 0; t < kTiles; ++t) {
            k[t] = Vec16::load(kt + ((t0 + t) * head_dim + d) * kKeyTile);
          }
          for (int64_t i = 0; i < kRows; ++i) {
            const Vec16 q = Vec16::splat(q_tile[(r0 + i) * head_dim + d]);
            for (int64_t t = 0; t < kTiles; ++t) acc[i][t] = Vec16::fma(q, k[t], acc[i][t]);
          }
        }
        for (int64_t i = 0; i < kRows; ++i) {
          for (int64_t t = 0; t < kTiles; ++t) {
            acc[i][t].store(s + (r0 + i) * kStepKeys + (t0 + t) * kKeyTile);
          }
        }
      }
    });
  }

  template <int64_t kGroup>
  static void values_tiles(float* pv, const float* p, const float* v, int64_t width,
                           int64_t head_dim, int64_t dt0) {
    for_row_groups([&]<int64_t kRows>(int64_t r0) {
      Vec16 acc[kRows][kGroup];
      for (auto& row : acc) {
        for (auto& a : row) a = Vec16::zero();
      }
      for (int64_t j = 0; j < width; ++j) {
        Vec16 vr[kGroup];
        for (int64_t t = 0; t < kGroup; ++t) {
          vr[t] = Vec16::load(v + j * head_dim + (dt0 + t) * kDimTile);
        }
        for (int64_t i = 0; i < kRows; ++i) {
          const Vec16 pj = Vec16::splat(p[(r0 + i) * kStepKeys + j]);
          for (int64_t t = 0; t < kGroup; ++t) acc[i][t] = Vec16::fma(pj, vr[t], acc[i][t]);
        }
      }
      for (int64_t i = 0; i < kRows; ++i) {
        for (int64_t t = 0; t < kGroup; ++t) {
          acc[i][t].store(pv + (r0 + i) * head_dim + (dt0 + t) * kDimTile);
        }
      }
    });
  }

  static void values(float* pv, const float* p, const float* v, int64_t width, int64_t head_dim) {
    // head_dim is a multiple of 32: whole groups of kTiles dim tiles, then maybe 2.
    const int64_t dim_tiles = head_dim / kDimTile;
    int64_t dt0 = 0;
    for (; dt0 + kTiles <= dim_tiles; dt0 += kTiles) {
      values_tiles<kTiles>(pv, p, v, width, head_dim, dt0);
    }
    if (dt0 < dim_tiles) values_tiles<2>(pv, p, v, width, head_dim, dt0);
  }

  struct Scope {};
};

// One query head's rows of a pass-2 item: its query tile and what the
// online softmax carries from step to step.
template <typename Word>
struct HeadRows {
  alignas(64) Word q_tile[kTileRows * kMaxHeadDim];
  alignas(64) float o[kTileRows * kMaxHeadDim];
  float row_max[kTileRows], row_sum[kTileRows];
};

// Pass 2 for the `heads` query heads of one KV head (its GQA group) and up
// to 16 query rows of one chunk. The key steps are the outer loop and the
// heads the inner one, so each step's packed K/V (256 keys: 128 KB at
// head_dim 64 in float32) is read from L3 once for the group and then from
// L2 by the other heads, instead of a whole context's K/V per head (a
// 1,024-key context is 512 KB, Zen 2's whole L2). Each head's operations and
// their order are what they were one head at a time: bit-identical output.
//   out, q: head 0's first row; rows `*_stride`, heads `*_head_stride` words apart
//   first_limit: the last key query row 0 may see (prefix + its chunk index)
//   kv: packed from key `key_base` on (a multiple of kKeyBlock)
//   window, softcap: the layer's (0: none)
template <class Products, typename Word = typename Products::Word>
void attend_rows(Word* out, int64_t out_stride, int64_t out_head_stride, const Word* q,
                 int64_t q_stride, int64_t q_head_stride, int64_t heads, int64_t rows,
                 const PackedKv<Word>& kv, int64_t key_base, int64_t head_dim,
                 int64_t first_limit, int64_t context_len, int64_t window, float softcap,
                 float scale) {
  // This thread's per-head state, kept across items and calls (as `packed` is).
  thread_local std::vector<HeadRows<Word>> states;
  if (static_cast<int64_t>(states.size()) < heads) states.resize(static_cast<size_t>(heads));
  alignas(64) float s[kTileRows * kStepKeys];
  alignas(64) Word p[kTileRows * kStepKeys];
  alignas(64) float pv[kTileRows * kMaxHeadDim];
  float alpha[kTileRows];

  for (int64_t h = 0; h < heads; ++h) {
    HeadRows<Word>& head = states[h];
    // Padding rows are zeros: their scores are 0, their outputs discarded.
    for (int64_t r = 0; r < kTileRows; ++r) {
      if (r < rows) {
        std::memcpy(head.q_tile + r * head_dim, q + h * q_head_stride + r * q_stride,
                    head_dim * sizeof(Word));
      } else {
        std::memset(head.q_tile + r * head_dim, 0, head_dim * sizeof(Word));
      }
      head.row_max[r] = kNoScore;
      head.row_sum[r] = 0.f;
    }
    std::fill(head.o, head.o + kTileRows * head_dim, 0.f);
  }
  const int64_t last_key = std::min(first_limit + rows - 1, context_len - 1);
  // Row 0's window start, in whole 64-key blocks (earlier keys are no row's).
  const int64_t first_key = window > 0 ? std::max<int64_t>(0, first_limit - window + 1) : 0;
  // The scores as softmax_step takes them: scaled there, or here with the cap.
  const float step_scale = softcap > 0.f ? 1.f : scale;

  for (int64_t key0 = first_key / kKeyBlock * kKeyBlock; key0 <= last_key; key0 += kStepKeys) {
    // Q K^T passes of 64 keys, the last cut to Products::kWidthKeys past the last key.
    constexpr int64_t kQuantum = Products::kWidthKeys;
    const int64_t width = std::min(kStepKeys, (last_key - key0) / kQuantum * kQuantum + kQuantum);
    // No key past any row's causal limit, none before any row's window start.
    const bool whole = key0 + width - 1 <= first_limit &&
                       (window == 0 || key0 >= first_limit + kTileRows - window);
    for (int64_t h = 0; h < heads; ++h) {
      HeadRows<Word>& head = states[h];
      for (int64_t k = 0; k < width; k += kKeyBlock) {
        const int64_t tiles = std::min(kKeyBlock, width - k) / kKeyTile;
        Products::scores(s + k, head.q_tile, kv.kt + (key0 - key_base + k) * head_dim, head_dim,
                         tiles);
      }
      if (softcap > 0.f) {
        const Vec16 scale_v = Vec16::splat(scale);
        for (int64_t r = 0; r < kTileRows; ++r) {
          for (int64_t k = 0; k < width; k += kKeyTile) {
            float* x = s + r * kStepKeys + k;
            kvmesh::softcap16(Vec16::load(x) * scale_v, softcap).store(x);
          }
        }
      }
      if (whole) {
        softmax_step<true>(s, p, width, head.row_max, head.row_sum, alpha, key0, first_limit,
                           context_len, window, step_scale);
      } else {
        softmax_step<false>(s, p, width, head.row_max, head.row_sum, alpha, key0, first_limit,
                            context_len, window, step_scale);
      }
      Products::values(pv, p, kv.v + (key0 - key_base) * head_dim, width, head_dim);
      for (int64_t r = 0; r < kTileRows; ++r) {
        const Vec16 a = Vec16::splat(alpha[r]);
        for (int64_t d = 0; d < head_dim; d += 16) {
          float* od = head.o + r * head_dim + d;
          Vec16::fma(Vec16::load(od), a, Vec16::load(pv + r * head_dim + d)).store(od);
        }
      }
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    const HeadRows<Word>& head = states[h];
    for (int64_t r = 0; r < rows; ++r) {
      const Vec16 inv = Vec16::splat(1.f / head.row_sum[r]);
      for (int64_t d = 0; d < head_dim; d += 16) {
        store_output(out + h * out_head_stride + r * out_stride + d,
                     Vec16::load(head.o + r * head_dim + d) * inv);
      }
    }
  }
}

// What paged_prefill_attention validated and laid out, for the passes.
struct ChunkPlan {
  const int64_t* tables;
  const int64_t* starts;
  const int64_t* lens;
  const int64_t* contexts;
  int64_t max_blocks, block_size, num_kv_heads, head_dim, group;
  // Words per KV head before each chunk's packed K (prefix sums), and the
  // first pack and attend item of each chunk.
  const std::vector<int64_t>& packed_offset;
  const std::vector<int64_t>& pack_items;
  const std::vector<int64_t>& attend_items;
  // Each chunk's first key (its first row's window start; 0 without a window)
  // and the first packed key (that, rounded down to kKeyBlock).
  const std::vector<int64_t>& first_keys;
  int64_t window;
  float softcap;
  float scale;
};

inline int64_t packed_from(int64_t first_key) { return first_key / kKeyBlock * kKeyBlock; }

// Pass 1 then pass 2 over torch's threads, in the Products' word type; C: the
// cache's element type (the word type, or a quantized cache's codes).
template <class Products, typename C = typename Products::Word>
void attend_chunks(const ChunkPlan& plan, at::Tensor& out, const at::Tensor& query,
                   const at::Tensor& key_cache, const at::Tensor& value_cache) {
  using Word = typename Products::Word;
  const auto& [tables, starts, lens, contexts, max_blocks, block_size, num_kv_heads, head_dim,
               group, packed_offset, pack_items, attend_items, first_keys, window, softcap,
               scale] = plan;
  const int64_t num_chunks = static_cast<int64_t>(packed_offset.size()) - 1;

  // K^T then V of every (chunk, KV head); reused across calls of this thread
  // (every layer of a step needs the same size) instead of a fresh mmap each.
  thread_local std::vector<Word> packed;
  const int64_t head_words = packed_offset[num_chunks];  // per KV head, K or V
  packed.resize(static_cast<size_t>(2 * num_kv_heads * head_words));
  Word* packed_base = packed.data();
  auto packed_kv = [&](int64_t c, int64_t h) -> std::pair<Word*, Word*> {
    const int64_t words = packed_offset[c + 1] - packed_offset[c];
    Word* kt = packed_base + 2 * num_kv_heads * packed_offset[c] + 2 * h * words;
    return {kt, kt + words};
  };
  const auto* k_cache = static_cast<const C*>(key_cache.data_ptr());
  const auto* v_cache = static_cast<const C*>(value_cache.data_ptr());
  const int64_t block_stride = key_cache.stride(0);  // a quantized cache's: its pages
  const int64_t row_stride = num_kv_heads * head_dim;
  auto chunk_of = [&](const std::vector<int64_t>& firsts, int64_t item) {
    return static_cast<int64_t>(std::upper_bound(firsts.begin(), firsts.end(), item) -
                                firsts.begin()) -
           1;
  };

  kvmesh::parallel_items(pack_items[num_chunks], [&](int64_t item, bool) {
    const int64_t c = chunk_of(pack_items, item);
    const int64_t local = item - pack_items[c];
    const int64_t base = packed_from(first_keys[c]);
    const int64_t key_blocks = (contexts[c] - base + kKeyBlock - 1) / kKeyBlock;
    const int64_t h = local / key_blocks, kb = local % key_blocks;
    auto [kt, v] = packed_kv(c, h);
    const KvRows<Word, C> rows{k_cache,    v_cache,      tables + c * max_blocks,
                               block_size, block_stride, row_stride,
                               num_kv_heads, h,          head_dim};
    Products::pack(kt + kb * kKeyBlock * head_dim, v + kb * kKeyBlock * head_dim, rows,
                   first_keys[c], contexts[c], base + kb * kKeyBlock, head_dim);
  });

  auto* out_base = static_cast<Word*>(out.data_ptr());
  const auto* q_base = static_cast<const Word*>(query.data_ptr());
  kvmesh::parallel_items(attend_items[num_chunks], [&](int64_t item, bool) {
    const int64_t c = chunk_of(attend_items, item);
    const int64_t local = item - attend_items[c];
    const int64_t row_tiles = (lens[c] + kTileRows - 1) / kTileRows;
    const int64_t h = local / row_tiles, row0 = (local % row_tiles) * kTileRows;
    const int64_t rows = std::min(kTileRows, lens[c] - row0);
    auto [kt, v] = packed_kv(c, h);
    const PackedKv<Word> kv{kt, v};
    const typename Products::Scope scope;
    const int64_t prefix = contexts[c] - lens[c];
    const int64_t head0 = h * group;  // the GQA group's first query head
    const int64_t q_row = (starts[c] + row0) * query.stride(0) + head0 * query.stride(1);
    attend_rows<Products>(out_base + (starts[c] + row0) * out.stride(0) + head0 * out.stride(1),
                          out.stride(0), out.stride(1), q_base + q_row, query.stride(0),
                          query.stride(1), group, rows, kv, packed_from(first_keys[c]), head_dim,
                          prefix + row0, contexts[c], window, softcap, scale);
  });
}

// attend_chunks over a cache of the query's dtype or of codes.
template <class Products>
void attend_with_cache(at::ScalarType cache_type, const ChunkPlan& plan, at::Tensor& out,
                       const at::Tensor& query, const at::Tensor& key_cache,
                       const at::Tensor& value_cache) {
  switch (cache_type) {
    case at::kChar:
      attend_chunks<Products, int8_t>(plan, out, query, key_cache, value_cache);
      break;
    case at::kFloat8_e4m3fn:
      attend_chunks<Products, kvmesh::E4m3>(plan, out, query, key_cache, value_cache);
      break;
    case at::kFloat8_e5m2:
      attend_chunks<Products, kvmesh::E5m2>(plan, out, query, key_cache, value_cache);
      break;
    default: attend_chunks<Products>(plan, out, query, key_cache, value_cache);
  }
}

// out[query_starts[c] + i] = causal attention of chunk c's query row i over its
// context, for every chunk c. key_cache/value_cache may instead be a quantized
// cache's codes (kv_codes.h): pass 1 then packs their dequantized values.
//   out, query:   [num_tokens, num_heads, head_dim] bfloat16 or float32 (all
//                 four tensors alike), head_dim contiguous
//   key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim]
//                 contiguous
//   block_tables: [num_chunks, max_blocks_per_seq] int64
//   query_starts, query_lens, context_lens: [num_chunks] int64
//                 (context = cached prefix + chunk, so context_len >= query_len)
//   head_dim a multiple of 32, at most 256.
//   sliding_window: > 0, row at position p sees keys p - window < j <= p, and
//                 no block before its chunk's first row's window is read; 0: all.
//   softcap:      > 0, scores become softcap * tanh(score / softcap); 0: off.
void paged_prefill_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& block_tables,
                             const at::Tensor& query_starts, const at::Tensor& query_lens,
                             const at::Tensor& context_lens, double scale,
                             int64_t sliding_window, double softcap) {
  const char* op = "paged_prefill_attention";
  const at::ScalarType dtype = query.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, op,
              ": tensors must be bfloat16 or float32, not ", dtype);
  // A quantized cache (kv_codes.h) holds codes and scales; any other has the query's dtype.
  const at::ScalarType cache_type = key_cache.scalar_type();
  const bool codes = kvmesh::is_code_type(cache_type);
  for (const at::Tensor* t : {&std::as_const(out), &key_cache, &value_cache}) {
    if (codes && t != &std::as_const(out)) continue;
    TORCH_CHECK(t->scalar_type() == dtype, op, ": tensors must all be ", dtype, ", not ",
                t->scalar_type());
  }
#if !defined(__AVX512BF16__)
  TORCH_CHECK(dtype == at::kFloat, op, ": bfloat16 needs the avx512_bf16 or amx level");
#endif
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3 && key_cache.dim() == 4, op, ": bad ranks");
  if (codes) {
    kvmesh::check_code_pages(key_cache, value_cache, op);
  } else {
    TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), op,
                ": caches must be contiguous");
  }
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), op,
              ": key and value caches differ in shape");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, op, ": head_dim must be contiguous");
  for (const at::Tensor* t : {&block_tables, &query_starts, &query_lens, &context_lens}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), op,
                ": index tensors must be contiguous int64");
  }
  const int64_t num_chunks = query_starts.size(0);
  const int64_t num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_blocks = key_cache.size(0), block_size = key_cache.size(1);
  const int64_t num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim && out.size(1) == num_heads &&
                  out.size(2) == head_dim && out.size(0) == query.size(0),
              op, ": head shape mismatch");
  TORCH_CHECK(head_dim % kDimChunk == 0 && head_dim <= kMaxHeadDim, op,
              ": head_dim must be a multiple of 32 up to 256, not ", head_dim);
  TORCH_CHECK(num_heads % num_kv_heads == 0, op, ": heads do not group");
  TORCH_CHECK(query_lens.size(0) == num_chunks && context_lens.size(0) == num_chunks &&
                  block_tables.size(0) == num_chunks,
              op, ": one start, length, context length and block table per chunk");
  TORCH_CHECK(sliding_window >= 0 && softcap >= 0.0, op,
              ": sliding_window and softcap must be >= 0");
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* starts = query_starts.data_ptr<int64_t>();
  const int64_t* lens = query_lens.data_ptr<int64_t>();
  const int64_t* contexts = context_lens.data_ptr<int64_t>();

  // Validate every index once, outside the parallel region; lay out the
  // packed K/V (per chunk and KV head) and the work items.
  std::vector<int64_t> packed_offset(num_chunks + 1, 0);  // words per KV head, prefix sums
  std::vector<int64_t> pack_items(num_chunks + 1, 0), attend_items(num_chunks + 1, 0);
  std::vector<int64_t> first_keys(num_chunks, 0);
  for (int64_t c = 0; c < num_chunks; ++c) {
    TORCH_CHECK(lens[c] >= 1 && lens[c] <= contexts[c] && contexts[c] <= max_blocks * block_size,
                op, ": chunk ", c, " has query length ", lens[c], " and context length ",
                contexts[c]);
    TORCH_CHECK(starts[c] >= 0 && starts[c] + lens[c] <= query.size(0), op,
                ": chunk rows out of range");
    if (sliding_window > 0) {
      first_keys[c] = std::max<int64_t>(0, contexts[c] - lens[c] - sliding_window + 1);
    }
    for (int64_t b = first_keys[c] / block_size; b < (contexts[c] + block_size - 1) / block_size;
         ++b) {
      const int64_t block = tables[c * max_blocks + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, op, ": block id ", block, " out of range");
    }
    const int64_t key_blocks =
        (contexts[c] - packed_from(first_keys[c]) + kKeyBlock - 1) / kKeyBlock;
    packed_offset[c + 1] = packed_offset[c] + key_blocks * kKeyBlock * head_dim;
    pack_items[c + 1] = pack_items[c] + num_kv_heads * key_blocks;
    attend_items[c + 1] = attend_items[c] + num_kv_heads * ((lens[c] + kTileRows - 1) / kTileRows);
  }
  if (num_chunks == 0) return;
  const ChunkPlan plan{tables, starts, lens, contexts, max_blocks, block_size, num_kv_heads,
                       head_dim, group, packed_offset, pack_items, attend_items,
                       first_keys, sliding_window, static_cast<float>(softcap),
                       static_cast<float>(scale)};
#if defined(__AVX512BF16__)
  if (dtype == at::kBFloat16) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    kvmesh::require_amx_permission(op);
#endif
    attend_with_cache<Bf16Products>(cache_type, plan, out, query, key_cache, value_cache);
    return;
  }
#endif
  attend_with_cache<Float32Products>(cache_type, plan, out, query, key_cache, value_cache);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def(
      "paged_prefill_attention(Tensor(a!) out, Tensor query, Tensor key_cache, "
      "Tensor value_cache, Tensor block_tables, Tensor query_starts, Tensor query_lens, "
      "Tensor context_lens, float scale, int sliding_window=0, float softcap=0.0) -> ()");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("paged_prefill_attention", &paged_prefill_attention); }

#endif  // __AVX2__ && __FMA__
