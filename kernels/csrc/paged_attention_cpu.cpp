// Paged decode attention for CPU, float32 or bfloat16, as a torch custom op.
//
// One query token per sequence attends to its whole context, read in place
// from the paged KV cache through the sequence's block table: no gather into
// a padded tensor, no mask, no padding work. Work is split on torch's own
// intra-op thread pool (work_stealing.h), so it shares threads with the
// matmuls instead of competing with them. The query heads of a GQA group are
// done together so every K/V row is read from memory once per group, not once
// per query head.
//
// From the avx2 level up, both dtypes (group sizes <= 8, head_dim 64, 128
// or 256) take attend_all_runs: items are runs of a sequence's
// context over all heads (whole cache rows, read front to back), an online
// softmax per block, long contexts split into runs and merged; bfloat16 dot
// products by vdpbf16ps where the level has AVX512-BF16. Everything else
// takes the float path, one item per (sequence, KV head).
//
// A sliding window (Mistral, Gemma 2/3) starts a decode's context at
// len - window instead of 0: the kernels read and validate only blocks from
// there (earlier entries of the block table may be a freed block's null id).
// A soft-cap (Gemma 2) maps each scaled score s to cap * tanh(s / cap) before
// the softmax.
//
// Numerics: scores and the softmax are float32 with the max subtracted; the
// value sum accumulates in float32. Only the order of additions (and, in the
// run path, exp16's last ulp) differs from the PyTorch reference
// (kernels/reference.py). bfloat16 query and K/V are read as float; the
// output is rounded to bfloat16 once. One exception: at AVX512-BF16 the run
// path rounds the probabilities to bfloat16 for P V (vdpbf16ps on pairs of
// value rows), as the prefill kernel and torch's bfloat16 SDPA do, and sums
// the rounded values, so the weights still sum to one.

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "vec16.h"
#endif

#include "float_or_bf16.h"
#include "kv_codes.h"
#include "work_stealing.h"

namespace {

using kvmesh::from_float;
using kvmesh::kIsCode;
using kvmesh::to_float;

// Where a cache's rows are. A model-dtype cache is contiguous (block_stride =
// block_size * row_stride elements); a quantized one (kv_codes.h) strides its
// blocks by their pages and keeps per-(token, KV head) scales at each page's
// end. C is the element type of the cache (T for a model-dtype cache).
struct CacheGeometry {
  int64_t block_size;
  int64_t block_stride;  // elements between two blocks' first rows
  int64_t row_stride;    // elements between two tokens' rows (num_kv_heads * head_dim)
  int64_t num_kv_heads;
};

template <typename C>
inline const C* cache_row(const C* base, const CacheGeometry& g, int64_t block, int64_t offset) {
  return base + block * g.block_stride + offset * g.row_stride;
}

// A quantized block's scales, [block_size][num_kv_heads] (nullptr for a model-dtype cache).
template <typename C>
inline const float* block_scales(const C* base, const CacheGeometry& g, int64_t block) {
  if constexpr (kIsCode<C>) {
    return kvmesh::page_scales(base, block, g.block_stride, g.block_size, g.num_kv_heads);
  } else {
    return nullptr;
  }
}

// s[t] = exp(s[t] - max(s)) in place; returns their sum (the softmax's denominator).
inline float exp_in_place(float* s, int64_t len) {
  float m = s[0];
  for (int64_t t = 1; t < len; ++t) m = std::max(m, s[t]);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < len; ++t) {
    s[t] = std::exp(s[t] - m);
    sum += s[t];
  }
  return sum;
}

// s[t] = cap * tanh(s[t] / cap) for the len scores (cap > 0).
inline void soft_cap(float* s, int64_t len, float cap) {
  for (int64_t t = 0; t < len; ++t) s[t] = cap * std::tanh(s[t] / cap);
}

// Keys [begin, len) of one (sequence, KV head) pair: the `group` query heads
// that share the KV head. HEAD_DIM is a compile-time constant so the per-head
// accumulators live in vector registers (4 zmm or 8 ymm for 64 floats)
// instead of memory. `scores` holds group x (len - begin) floats.
// C: the cache's element type (T, or a quantized cache's codes: each K score
// and each V weight then times its row's scale). k_base/v_base: the caches'
// first rows; `kv_head` picks the head's slice of each row and its scale.
template <int HEAD_DIM, typename T, typename C>
void attend_one(const T* const* q, T* const* out, int64_t group, const C* k_base, const C* v_base,
                const int64_t* table, int64_t begin, int64_t len, const CacheGeometry& geo,
                int64_t kv_head, float scale, float softcap, float* scores) {
  const int64_t count = len - begin;
  const int64_t block_size = geo.block_size, row_stride = geo.row_stride;
  // Scores: one dot product per (head, token), K rows read through the block table.
  for (int64_t g = 0; g < group; ++g) {
    float qg[HEAD_DIM];
    for (int d = 0; d < HEAD_DIM; ++d) qg[d] = to_float(q[g][d]) * scale;
    float* s = scores + g * count - begin;  // indexed by position
    // Block-major walk: no division per token.
    for (int64_t start = begin; start < len;) {
      const int64_t offset = start % block_size;
      const int64_t block = table[start / block_size];
      const C* k = cache_row(k_base, geo, block, offset) + kv_head * HEAD_DIM;
      const float* k_scales = block_scales(k_base, geo, block);
      const int64_t n = std::min(block_size - offset, len - start);
      for (int64_t j = 0; j < n; ++j, k += row_stride) {
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int d = 0; d < HEAD_DIM; ++d) sum += qg[d] * to_float(k[d]);
        if constexpr (kIsCode<C>) sum *= k_scales[(offset + j) * geo.num_kv_heads + kv_head];
        s[start + j] = sum;
      }
      start += n;
    }
    if (softcap > 0.f) soft_cap(s + begin, count, softcap);
  }
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * count - begin;
    const float inv = 1.f / exp_in_place(s + begin, count);
    float acc[HEAD_DIM] = {};
    for (int64_t start = begin; start < len;) {
      const int64_t offset = start % block_size;
      const int64_t block = table[start / block_size];
      const C* v = cache_row(v_base, geo, block, offset) + kv_head * HEAD_DIM;
      const float* v_scales = block_scales(v_base, geo, block);
      const int64_t n = std::min(block_size - offset, len - start);
      for (int64_t j = 0; j < n; ++j, v += row_stride) {
        float p = s[start + j];
        if constexpr (kIsCode<C>) p *= v_scales[(offset + j) * geo.num_kv_heads + kv_head];
#pragma omp simd
        for (int d = 0; d < HEAD_DIM; ++d) acc[d] += p * to_float(v[d]);
      }
      start += n;
    }
    T* o = out[g];
#pragma omp simd
    for (int d = 0; d < HEAD_DIM; ++d) o[d] = from_float<T>(acc[d] * inv);
  }
}

// Any head size: same math, accumulators in memory.
template <typename T, typename C>
void attend_one_generic(const T* const* q, T* const* out, int64_t group, int64_t head_dim,
                        const C* k_base, const C* v_base, const int64_t* table, int64_t begin,
                        int64_t len, const CacheGeometry& geo, int64_t kv_head, float scale,
                        float softcap, float* scores, float* acc) {
  const int64_t count = len - begin;
  const int64_t block_size = geo.block_size;
  // Row t's scale (1 for a model-dtype cache).
  auto row_scale = [&](const C* base, int64_t t) {
    if constexpr (kIsCode<C>) {
      return block_scales(base, geo, table[t / block_size])[(t % block_size) * geo.num_kv_heads +
                                                             kv_head];
    } else {
      return 1.f;
    }
  };
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * count - begin;  // indexed by position
    for (int64_t t = begin; t < len; ++t) {
      const C* k = cache_row(k_base, geo, table[t / block_size], t % block_size) +
                   kv_head * head_dim;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t d = 0; d < head_dim; ++d) {
        sum += to_float(q[g][d]) * to_float(k[d]);
      }
      if constexpr (kIsCode<C>) sum *= row_scale(k_base, t);
      s[t] = sum * scale;
    }
    if (softcap > 0.f) soft_cap(s + begin, count, softcap);
    float m = s[begin];
    for (int64_t t = begin + 1; t < len; ++t) m = std::max(m, s[t]);
    float total = 0.f;
    for (int64_t t = begin; t < len; ++t) {
      s[t] = std::exp(s[t] - m);
      total += s[t];
    }
    std::fill(acc, acc + head_dim, 0.f);
    for (int64_t t = begin; t < len; ++t) {
      const C* v = cache_row(v_base, geo, table[t / block_size], t % block_size) +
                   kv_head * head_dim;
      const float p = kIsCode<C> ? s[t] * row_scale(v_base, t) : s[t];
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) acc[d] += p * to_float(v[d]);
    }
    for (int64_t d = 0; d < head_dim; ++d) out[g][d] = from_float<T>(acc[d] / total);
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// The run path (Vec16: one AVX-512 or two AVX2 registers; head_dim 64 or 128,
// GQA groups of up to 8).
//
// One work item is a run of one sequence's context, for every head: the
// cache rows of a token (all KV heads side by side) are contiguous, so an
// item reads whole blocks front to back, the next rows prefetched into L2.
// Reading one KV head's slice of each row instead (one item per sequence and
// KV head, the float path below) turns a block into block_size short strided
// reads; on the Zen 4 EPYC that ran at 8-13 GB/s from DRAM, runs at ~15 (a
// plain read of whole 6 KB blocks in random order, both cores: ~16; 24 KB
// blocks ~24, 96 KB ~32). A long context is cut into
// runs (split-K, "flash decoding") when the batch alone would leave threads
// idle; the runs' partial softmaxes are merged.
//
// Per block, per KV head: sixteen tokens' dot products with each query head
// of the group (bfloat16 at AVX512-BF16: vdpbf16ps on the pairs as stored,
// products exact in float32; float32: FMAs), summed across lanes together
// (transpose_sum16), then an online softmax over the block (running max,
// rescaled sums) and the value rows read once for the whole GQA group. Only
// the order of additions and the exp's last ulp differ from the float path.
using Bf16 = c10::BFloat16;

using kvmesh::Vec16;

// r[j] = the sum of a[j]'s sixteen lanes, for sixteen vectors at once: a
// transposing tree (45 shuffles and adds on AVX-512 instead of sixteen 8-step
// reductions).
inline Vec16 transpose_sum16(const Vec16* a) {
#if defined(__AVX512F__)
  __m512 t[8];
  for (int i = 0; i < 8; ++i) {
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i].v, a[2 * i + 1].v),
                         _mm512_unpackhi_ps(a[2 * i].v, a[2 * i + 1].v));
  }
  __m512 u[4];
  for (int i = 0; i < 4; ++i) {
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
  }
  __m512 v[2];
  for (int i = 0; i < 2; ++i) {
    v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
  }
  return {_mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], 0x88),
                        _mm512_shuffle_f32x4(v[0], v[1], 0xDD))};
#else
  // Each vector's halves added, then eight 8-lane sums at a time by hadd.
  auto eight = [](const Vec16* x) {
    __m256 h[8];
    for (int i = 0; i < 8; ++i) h[i] = _mm256_add_ps(x[i].lo, x[i].hi);
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(h[4], h[5]), _mm256_hadd_ps(h[6], h[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
  };
  return {eight(a), eight(a + 8)};
#endif
}

// How far ahead: one default block (16 tokens) was best on the Zen 4 EPYC
// (batch 16 x 1,024 tokens, 30 layers' caches in turn: 0.80 ms per call at 16
// tokens, 0.81 at 48, 0.87 at 96, 0.90 at 192).
constexpr int64_t kPrefetchTokens = 16;

template <typename T>
inline void prefetch_row(const T* row, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(p + line, _MM_HINT_T1);
}


// A run's state per query head: running max, sum of exp(score - max), and the
// exp-weighted value sum (HEAD_DIM floats).
struct RunState {
  float* max;
  float* sum;
  float* acc;
};

inline Vec16 load_row(const float* p) { return Vec16::load(p); }
inline Vec16 load_row(const Bf16* p) {
  return Vec16::load_bf16(reinterpret_cast<const uint16_t*>(p));
}
// A quantized cache's codes, widened (kv_codes.h); the row's scale is applied
// to its score (K) or its probability (V), once per row.
inline Vec16 load_row(const int8_t* p) { return kvmesh::load_codes(p); }
inline Vec16 load_row(const kvmesh::E4m3* p) { return kvmesh::load_codes(p); }
inline Vec16 load_row(const kvmesh::E5m2* p) { return kvmesh::load_codes(p); }

// q·k for one query head against sixteen-lane slices of K rows: the query
// held in registers as the row type wants it. dot() returns the unreduced
// lanes (their sum is the score).
template <typename T, int HEAD_DIM>
struct QueryDots;

template <int HEAD_DIM>
struct QueryDots<float, HEAD_DIM> {
  Vec16 q[HEAD_DIM / 16];
  explicit QueryDots(const float* query) {
    for (int i = 0; i < HEAD_DIM / 16; ++i) q[i] = Vec16::load(query + 16 * i);
  }
  Vec16 dot(const float* k) const {
    Vec16 acc = q[0] * Vec16::load(k);
    for (int i = 1; i < HEAD_DIM / 16; ++i) acc = Vec16::fma(q[i], Vec16::load(k + 16 * i), acc);
    return acc;
  }
};

template <int HEAD_DIM>
struct QueryDots<Bf16, HEAD_DIM> {
#if defined(__AVX512BF16__)
  // vdpbf16ps on the bfloat16 pairs as stored: products exact in float32.
  __m512bh q[HEAD_DIM / 32];
  explicit QueryDots(const Bf16* query) {
    for (int c = 0; c < HEAD_DIM / 32; ++c) {
      q[c] = (__m512bh)_mm512_loadu_si512(query + 32 * c);
    }
  }
  Vec16 dot(const Bf16* k) const {
    __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[0], (__m512bh)_mm512_loadu_si512(k));
    for (int c = 1; c < HEAD_DIM / 32; ++c) {
      acc = _mm512_dpbf16_ps(acc, q[c], (__m512bh)_mm512_loadu_si512(k + 32 * c));
    }
    return {acc};
  }
#else
  // Widened to float (exactly) and multiplied by FMAs.
  Vec16 q[HEAD_DIM / 16];
  explicit QueryDots(const Bf16* query) {
    for (int i = 0; i < HEAD_DIM / 16; ++i) q[i] = load_row(query + 16 * i);
  }
  Vec16 dot(const Bf16* k) const {
    Vec16 acc = q[0] * load_row(k);
    for (int i = 1; i < HEAD_DIM / 16; ++i) acc = Vec16::fma(q[i], load_row(k + 16 * i), acc);
    return acc;
  }
#endif
};

// q . codes for a quantized cache: the query widened to float32 once, each
// row's codes widened as they are read.
template <typename T, int HEAD_DIM>
struct WidenedQueryDots {
  Vec16 q[HEAD_DIM / 16];
  explicit WidenedQueryDots(const T* query) {
    for (int i = 0; i < HEAD_DIM / 16; ++i) q[i] = load_row(query + 16 * i);
  }
  template <typename C>
  Vec16 dot(const C* k) const {
    Vec16 acc = q[0] * load_row(k);
    for (int i = 1; i < HEAD_DIM / 16; ++i) acc = Vec16::fma(q[i], load_row(k + 16 * i), acc);
    return acc;
  }
};

template <typename T, typename C, int HEAD_DIM>
using DotsFor =
    std::conditional_t<kIsCode<C>, WidenedQueryDots<T, HEAD_DIM>, QueryDots<T, HEAD_DIM>>;

#if defined(__AVX512BF16__)
#define KVMESH_PV_PAIRS 1
// P V on vdpbf16ps: P rounded to bfloat16 (as the prefill kernel and torch's
// bfloat16 SDPA round it), two value rows at a time interleaved word by word
// into (row j, row j + 1) pairs, so one instruction adds p_j v_j + p_j+1 v_j+1
// for 16 dims. The interleave (vpunpck{l,h}wd) works within 128-bit lanes, so
// the accumulators hold each 32 dims in a lane order that unpermute_pairs
// undoes once per run. Against float P times widened
// rows (FMAs), on the Zen 4 EPYC (2 cores, 30 layers' caches in turn,
// interleaved runs): batch 16 x 1,024 1.07-1.10x with blocks scattered,
// 1.08-1.09x in order (as the scheduler allocates them); 16 x 1,024 from
// cache 1.12x; 4 x 1,024 1.01-1.03x.

// acc[g] (GROUP x HEAD_DIM floats, pair lane order) = acc[g] * rescale[g] +
// sum over the block's n rows of p[g][j] v_j.
template <int HEAD_DIM, int GROUP>
inline void values_by_pairs(const Bf16* v_head, int64_t row_stride, int64_t n,
                            const uint16_t* probs, int64_t tile_stride, const float* rescale,
                            float* acc_base) {
  const __m512i zero = _mm512_setzero_si512();
  for (int c = 0; c < HEAD_DIM / 32; ++c) {
    __m512 acc[GROUP][2];
    for (int g = 0; g < GROUP; ++g) {
      const __m512 r = _mm512_set1_ps(rescale[g]);
      float* a = acc_base + g * HEAD_DIM + 32 * c;
      acc[g][0] = _mm512_mul_ps(_mm512_loadu_ps(a), r);
      acc[g][1] = _mm512_mul_ps(_mm512_loadu_ps(a + 16), r);
    }
    const Bf16* v = v_head + 32 * c;
    for (int64_t j = 0; j < n; j += 2) {
      const __m512i r0 = _mm512_loadu_si512(v + j * row_stride);
      // Past the block's last row: zeros, not whatever the cache holds there.
      const __m512i r1 = j + 1 < n ? _mm512_loadu_si512(v + (j + 1) * row_stride) : zero;
      const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(r0, r1);
      const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(r0, r1);
      for (int g = 0; g < GROUP; ++g) {
        int32_t pair;
        std::memcpy(&pair, probs + g * tile_stride + j, sizeof(pair));
        const __m512bh p = (__m512bh)_mm512_set1_epi32(pair);
        acc[g][0] = _mm512_dpbf16_ps(acc[g][0], p, lo);
        acc[g][1] = _mm512_dpbf16_ps(acc[g][1], p, hi);
      }
    }
    for (int g = 0; g < GROUP; ++g) {
      float* a = acc_base + g * HEAD_DIM + 32 * c;
      _mm512_storeu_ps(a, acc[g][0]);
      _mm512_storeu_ps(a + 16, acc[g][1]);
    }
  }
}

// Lane m of the low accumulator holds dim 8 * (m / 4) + m % 4 of its 32, lane m
// of the high one dim 8 * (m / 4) + 4 + m % 4: back to dims in order.
template <int HEAD_DIM>
inline void unpermute_pairs(float* acc) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int c = 0; c < HEAD_DIM / 32; ++c) {
    float* a = acc + 32 * c;
    const __m512 lo = _mm512_loadu_ps(a), hi = _mm512_loadu_ps(a + 16);
    _mm512_storeu_ps(a, _mm512_permutex2var_ps(lo, first, hi));
    _mm512_storeu_ps(a + 16, _mm512_permutex2var_ps(lo, second, hi));
  }
}
#endif

// Tokens [begin, end) of one sequence, all heads. `scores`: 1.5 x GROUP x
// round_up(block_size, 16) floats of scratch (the scores, then room for the
// bfloat16 probabilities of the pair path). C: the cache's element type, T
// or a quantized cache's codes (scores then times their K rows' scales, the
// probabilities P V multiplies times their V rows').
template <typename T, typename C, int HEAD_DIM, int GROUP>
void attend_run(const T* q, int64_t q_head, const C* k_cache, const C* v_cache,
                const int64_t* table, int64_t begin, int64_t end, const CacheGeometry& geo,
                float scale, float softcap, float* scores, RunState state) {
  constexpr bool kCodes = kIsCode<C>;
  const int64_t block_size = geo.block_size, num_kv_heads = geo.num_kv_heads;
  constexpr int kVecs = HEAD_DIM / 16;  // Vec16 per head row
#if defined(__AVX512F__)
  // GROUP x 4 of 32 zmm for head_dim 64; head_dim 256 (Gemma) in chunks of 8
  // like 128, or its GROUP x 16 accumulators would not fit in registers.
  constexpr int kChunk = kVecs < 8 ? kVecs : 8;
#else
  // AVX2 has 16 ymm: all of a row at once spilled the accumulators. Two
  // Vec16 at a time, on the Zen 4 EPYC built at the avx2 level (30 layers'
  // caches in turn, batch 16 x 1,024 / 4 x 1,024 / 16 x 256): float32 1.24x /
  // 1.23x / 1.17x the per-head path (all at once: 1.09x / 1.13x / 1.01x),
  // bfloat16 1.13-1.18x all at once.
  constexpr int kChunk = 2;
#endif
  const int64_t row_stride = num_kv_heads * HEAD_DIM;
  const int64_t tile_stride = (block_size + 15) / 16 * 16;
  const int64_t num_heads = num_kv_heads * GROUP;
#if defined(KVMESH_PV_PAIRS)
  constexpr bool kPairs = std::is_same_v<T, Bf16> && std::is_same_v<C, Bf16>;
  uint16_t* probs = reinterpret_cast<uint16_t*>(scores + GROUP * tile_stride);
#else
  constexpr bool kPairs = false;
#endif
  for (int64_t h = 0; h < num_heads; ++h) {
    state.max[h] = -INFINITY;
    state.sum[h] = 0.f;
    std::fill(state.acc + h * HEAD_DIM, state.acc + (h + 1) * HEAD_DIM, 0.f);
  }
  const int64_t row_bytes = row_stride * static_cast<int64_t>(sizeof(C));
  const Vec16 minus_inf = Vec16::splat(-INFINITY);
  int64_t fetched = begin;
  for (int64_t start = begin; start < end;) {
    const int64_t offset = start % block_size;
    const int64_t n = std::min(block_size - offset, end - start);
    const int64_t block = table[start / block_size];
    const C* k_block = cache_row(k_cache, geo, block, offset);
    const C* v_block = cache_row(v_cache, geo, block, offset);
    // The block's scales from this run's first row (quantized caches only).
    const float* k_scales = kCodes ? block_scales(k_cache, geo, block) + offset * num_kv_heads
                                   : nullptr;
    const float* v_scales = kCodes ? block_scales(v_cache, geo, block) + offset * num_kv_heads
                                   : nullptr;
    // Rows kPrefetchTokens ahead, asked for (into L2) while this block is
    // computed: blocks are scattered through the cache, so the hardware
    // prefetcher stops at each block's end.
    const int64_t fetch_to = std::min(end, start + n + kPrefetchTokens);
    const int64_t fetch_from = std::max(fetched, start + n);
    fetched = std::max(fetched, fetch_to);
    for (int64_t kv = 0; kv < num_kv_heads; ++kv) {
      // This head's share of the prefetching.
      const int64_t count = std::max<int64_t>(0, fetch_to - fetch_from);
      const int64_t lo = fetch_from + count * kv / num_kv_heads;
      const int64_t hi = fetch_from + count * (kv + 1) / num_kv_heads;
      for (int64_t t = lo; t < hi; ++t) {
        const int64_t ahead = table[t / block_size];
        prefetch_row(cache_row(k_cache, geo, ahead, t % block_size), row_bytes);
        prefetch_row(cache_row(v_cache, geo, ahead, t % block_size), row_bytes);
      }
      const C* k_head = k_block + kv * HEAD_DIM;
      const C* v_head = v_block + kv * HEAD_DIM;
      // This head's K row scales, 16 tokens per tile (zeros past n).
      alignas(64) float k_scale[16];
      // Scores for the block: s[g][j] = q_g · k_j * scale.
      for (int g = 0; g < GROUP; ++g) {
        const DotsFor<T, C, HEAD_DIM> query(q + (kv * GROUP + g) * q_head);
        for (int64_t t0 = 0; t0 < n; t0 += 16) {
          const int m = static_cast<int>(std::min<int64_t>(16, n - t0));
          Vec16 dots[16];
          for (int j = 0; j < 16; ++j) {
            dots[j] = j < m ? query.dot(k_head + (t0 + j) * row_stride) : Vec16::zero();
          }
          Vec16 scaled = transpose_sum16(dots) * Vec16::splat(scale);
          if constexpr (kCodes) {
            for (int j = 0; j < 16; ++j) {
              k_scale[j] = j < m ? k_scales[(t0 + j) * num_kv_heads + kv] : 0.f;
            }
            scaled = scaled * Vec16::load(k_scale);
          }
          (softcap > 0.f ? kvmesh::softcap16(scaled, softcap) : scaled)
              .store(scores + g * tile_stride + t0);
        }
      }
      // Online softmax over the block: p = exp(s - new max), the old sums
      // rescaled by exp(old max - new max).
      float rescale[GROUP];
      for (int g = 0; g < GROUP; ++g) {
        const int64_t h = kv * GROUP + g;
        float* s = scores + g * tile_stride;
        Vec16 vmax = minus_inf;
        for (int64_t t0 = 0; t0 < n; t0 += 16) {
          vmax = Vec16::max(vmax, Vec16::first_lanes(n - t0, Vec16::load(s + t0), minus_inf));
        }
        const float new_max = std::max(state.max[h], vmax.reduce_max());
        rescale[g] = state.max[h] == -INFINITY ? 0.f : std::exp(state.max[h] - new_max);
        const Vec16 shift = Vec16::splat(new_max);
        Vec16 vsum = Vec16::zero();
        for (int64_t t0 = 0; t0 < n; t0 += 16) {
          const Vec16 p = kvmesh::exp16<!kPairs>(Vec16::load(s + t0) - shift);
          const Vec16 kept = Vec16::first_lanes(n - t0, p, Vec16::zero());
#if defined(KVMESH_PV_PAIRS)
          if constexpr (kPairs) {
            // The row sums add what P V multiplies: the rounded probabilities.
            vsum = vsum + kept.store_bf16_rounded(probs + g * tile_stride + t0);
            continue;
          }
#endif
          kept.store(s + t0);
          vsum = vsum + kept;
        }
        state.sum[h] = state.sum[h] * rescale[g] + vsum.reduce_add();
        state.max[h] = new_max;
      }
#if defined(KVMESH_PV_PAIRS)
      if constexpr (kPairs) {
        values_by_pairs<HEAD_DIM, GROUP>(v_head, row_stride, n, probs, tile_stride, rescale,
                                         state.acc + kv * GROUP * HEAD_DIM);
        continue;
      }
#endif
      // Values: each row read (and widened) once for the group, kChunk
      // vectors of it at a time so the accumulators stay in registers.
      for (int i0 = 0; i0 < kVecs; i0 += kChunk) {
        Vec16 acc[GROUP][kChunk];
        for (int g = 0; g < GROUP; ++g) {
          const float* a = state.acc + (kv * GROUP + g) * HEAD_DIM + 16 * i0;
          for (int i = 0; i < kChunk; ++i) {
            acc[g][i] = Vec16::load(a + 16 * i) * Vec16::splat(rescale[g]);
          }
        }
        for (int64_t j = 0; j < n; ++j) {
          const C* v = v_head + j * row_stride + 16 * i0;
          Vec16 vf[kChunk];
          for (int i = 0; i < kChunk; ++i) vf[i] = load_row(v + 16 * i);
          for (int g = 0; g < GROUP; ++g) {
            const float weight = scores[g * tile_stride + j];
            const Vec16 p =
                Vec16::splat(kCodes ? weight * v_scales[j * num_kv_heads + kv] : weight);
            for (int i = 0; i < kChunk; ++i) acc[g][i] = Vec16::fma(p, vf[i], acc[g][i]);
          }
        }
        for (int g = 0; g < GROUP; ++g) {
          float* a = state.acc + (kv * GROUP + g) * HEAD_DIM + 16 * i0;
          for (int i = 0; i < kChunk; ++i) acc[g][i].store(a + 16 * i);
        }
      }
    }
    start += n;
  }
#if defined(KVMESH_PV_PAIRS)
  if constexpr (kPairs) {
    for (int64_t h = 0; h < num_heads; ++h) unpermute_pairs<HEAD_DIM>(state.acc + h * HEAD_DIM);
  }
#endif
}

template <typename T, typename C, int HEAD_DIM>
using RunFn = void (*)(const T*, int64_t, const C*, const C*, const int64_t*, int64_t, int64_t,
                       const CacheGeometry&, float, float, float*, RunState);

template <typename T, typename C, int HEAD_DIM>
RunFn<T, C, HEAD_DIM> run_for(int64_t group) {
  switch (group) {
    case 1: return &attend_run<T, C, HEAD_DIM, 1>;
    case 2: return &attend_run<T, C, HEAD_DIM, 2>;
    case 3: return &attend_run<T, C, HEAD_DIM, 3>;
    case 4: return &attend_run<T, C, HEAD_DIM, 4>;
    case 5: return &attend_run<T, C, HEAD_DIM, 5>;
    case 6: return &attend_run<T, C, HEAD_DIM, 6>;
    case 7: return &attend_run<T, C, HEAD_DIM, 7>;
    case 8: return &attend_run<T, C, HEAD_DIM, 8>;
    default: return nullptr;
  }
}

// Tokens per run: whole blocks, long enough that a run's merge and prefetch
// start-up are noise, short enough that the batch makes a few runs per thread.
// `fixed` > 0 (batch-invariant mode, kernels/batch_invariant.py): that many
// tokens (rounded up to whole blocks) whatever the batch and thread count, so
// a row's sums split the same way in every batch.
inline int64_t run_length(const int64_t* begins, const int64_t* lens, int64_t num_decodes,
                          int64_t block_size, int64_t fixed) {
  if (fixed > 0) return (fixed + block_size - 1) / block_size * block_size;
  constexpr int64_t kMinRun = 256;
  constexpr int64_t kRunsPerThread = 4;
  int64_t total = 0;
  for (int64_t i = 0; i < num_decodes; ++i) total += lens[i] - begins[i];
  const int64_t wanted = kRunsPerThread * std::max<int64_t>(1, at::get_num_threads());
  const int64_t tokens = std::max(kMinRun, (total + wanted - 1) / wanted);
  return (tokens + block_size - 1) / block_size * block_size;
}

// Every decode over its runs, then the runs of each split sequence merged.
// Returns false (nothing written) when this path does not cover the shape.
// Runs are aligned to multiples of the run length from token 0 (the first
// one cut at the sequence's window start), so a row's split depends on its
// position and window only.
template <typename T, typename C, int HEAD_DIM>
bool attend_all_runs(T* out_base, const T* q_base, const C* k_cache, const C* v_cache,
                     const int64_t* tables, const int64_t* begins, const int64_t* lens,
                     const int64_t* row_ids, int64_t num_decodes, const CacheGeometry& geo,
                     int64_t group, int64_t max_blocks, int64_t q_tok, int64_t q_head,
                     int64_t o_tok, int64_t o_head, float scale, float softcap,
                     int64_t fixed_run) {
  const int64_t num_kv_heads = geo.num_kv_heads, block_size = geo.block_size;
  const RunFn<T, C, HEAD_DIM> fn = run_for<T, C, HEAD_DIM>(group);
  if (fn == nullptr) return false;
  const int64_t num_heads = num_kv_heads * group;
  const int64_t run = run_length(begins, lens, num_decodes, block_size, fixed_run);
  // Run i covers tokens [(i - first_run[seq] + begins[seq] / run) * run, ...)
  // of its sequence, from begins[seq] at the earliest.
  std::vector<int64_t> first_run(num_decodes + 1, 0);
  for (int64_t i = 0; i < num_decodes; ++i) {
    first_run[i + 1] = first_run[i] + (lens[i] + run - 1) / run - begins[i] / run;
  }
  const int64_t num_runs = first_run[num_decodes];
  // Per run and head: max, sum, and HEAD_DIM floats of weighted values.
  const int64_t state_floats = num_heads * (HEAD_DIM + 2);
  std::vector<float> states(num_runs * state_floats);
  std::vector<int64_t> seq_of(num_runs);
  for (int64_t i = 0; i < num_decodes; ++i) {
    std::fill(seq_of.begin() + first_run[i], seq_of.begin() + first_run[i + 1], i);
  }
  const int64_t tile_stride = (block_size + 15) / 16 * 16;
  kvmesh::parallel_items(num_runs, [&](int64_t item, bool) {
    thread_local std::vector<float> scores;
    scores.resize(group * tile_stride * 3 / 2);
    const int64_t seq = seq_of[item];
    const int64_t aligned = (item - first_run[seq] + begins[seq] / run) * run;
    const int64_t begin = std::max(aligned, begins[seq]);
    const int64_t end = std::min(lens[seq], aligned + run);
    float* state = states.data() + item * state_floats;
    fn(q_base + row_ids[seq] * q_tok, q_head, k_cache, v_cache, tables + seq * max_blocks, begin,
       end, geo, scale, softcap, scores.data(),
       RunState{state, state + num_heads, state + 2 * num_heads});
  });
  // out = sum_r exp(max_r - M) acc_r / sum_r exp(max_r - M) sum_r, M = max_r max_r.
  kvmesh::parallel_items(num_decodes * num_heads, [&](int64_t item, bool) {
    const int64_t seq = item / num_heads, h = item % num_heads;
    float global_max = -INFINITY;
    for (int64_t r = first_run[seq]; r < first_run[seq + 1]; ++r) {
      global_max = std::max(global_max, states[r * state_floats + h]);
    }
    float total = 0.f;
    Vec16 acc[HEAD_DIM / 16];
    for (auto& a : acc) a = Vec16::zero();
    for (int64_t r = first_run[seq]; r < first_run[seq + 1]; ++r) {
      const float* state = states.data() + r * state_floats;
      const float weight = std::exp(state[h] - global_max);
      total += weight * state[num_heads + h];
      const float* a = state + 2 * num_heads + h * HEAD_DIM;
      for (int i = 0; i < HEAD_DIM / 16; ++i) {
        acc[i] = Vec16::fma(Vec16::splat(weight), Vec16::load(a + 16 * i), acc[i]);
      }
    }
    T* o = out_base + row_ids[seq] * o_tok + h * o_head;
    const Vec16 inv = Vec16::splat(1.f / total);
    for (int i = 0; i < HEAD_DIM / 16; ++i) {
      if constexpr (std::is_same_v<T, float>) {
        (acc[i] * inv).store(o + 16 * i);
      } else {
        (acc[i] * inv).store_bf16(reinterpret_cast<uint16_t*>(o + 16 * i));
      }
    }
  });
  return true;
}
#endif

// Every (sequence, KV head) pair of the batch, over torch's threads; the
// arguments are validated by paged_decode_attention.
template <typename T, typename C>
void attend_all(T* out_base, const T* q_base, const C* k, const C* v, const int64_t* tables,
                const int64_t* begins, const int64_t* lens, const int64_t* row_ids,
                int64_t num_decodes, const CacheGeometry& geo, int64_t group, int64_t head_dim,
                int64_t max_blocks, int64_t max_len, int64_t q_tok, int64_t q_head, int64_t o_tok,
                int64_t o_head, float scale, float softcap) {
  const int64_t num_kv_heads = geo.num_kv_heads;
  kvmesh::parallel_items(num_decodes * num_kv_heads, [&](int64_t item, bool) {
    thread_local std::vector<float> scores;
    thread_local std::vector<float> acc;
    thread_local std::vector<const T*> q;
    thread_local std::vector<T*> o;
    scores.resize(group * max_len);
    acc.resize(head_dim);
    q.resize(group);
    o.resize(group);
    const int64_t seq = item / num_kv_heads;
    const int64_t kv_head = item % num_kv_heads;
    const int64_t row = row_ids[seq];
    for (int64_t g = 0; g < group; ++g) {
      q[g] = q_base + row * q_tok + (kv_head * group + g) * q_head;
      o[g] = out_base + row * o_tok + (kv_head * group + g) * o_head;
    }
    const int64_t* table = tables + seq * max_blocks;
    const int64_t begin = begins[seq], len = lens[seq];
    switch (head_dim) {
      case 64:
        attend_one<64>(q.data(), o.data(), group, k, v, table, begin, len, geo, kv_head, scale,
                       softcap, scores.data());
        break;
      case 128:
        attend_one<128>(q.data(), o.data(), group, k, v, table, begin, len, geo, kv_head, scale,
                        softcap, scores.data());
        break;
      case 256:
        attend_one<256>(q.data(), o.data(), group, k, v, table, begin, len, geo, kv_head, scale,
                        softcap, scores.data());
        break;
      default:
        attend_one_generic(q.data(), o.data(), group, head_dim, k, v, table, begin, len, geo,
                           kv_head, scale, softcap, scores.data(), acc.data());
    }
  });
}

// out[rows[i]] = softmax(q K^T * scale) V for every decode i.
//   out, query:   [num_tokens, num_heads, head_dim], last dim contiguous
//   key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim] contiguous
//   (all four float32, or all four bfloat16)
//   block_tables: [num_decodes, max_blocks_per_seq] int64
//   context_lens: [num_decodes] int64 (>= 1)
//   rows:         [num_decodes] int64, query/out row of each decode
//   run_tokens:   0: split long contexts into runs sized from the batch and
//                 thread count; > 0: runs of this many tokens (whole blocks)
//                 from token 0, whatever the batch (batch-invariant mode: a
//                 row's result then depends on its context only). The
//                 per-(sequence, KV head) path never splits.
//   sliding_window: > 0: each decode sees its last sliding_window tokens only,
//                 and no block before them is read (or validated); 0: all.
//   softcap:      > 0: scores become softcap * tanh(score / softcap); 0: off.
void paged_decode_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, const at::Tensor& rows, double scale,
                            int64_t run_tokens, int64_t sliding_window, double softcap) {
  const char* op = "paged_decode_attention";
  kvmesh::check_same_dtype(query, out, op, "query", "out");
  // A quantized cache (kv_codes.h) holds codes and scales; any other has the query's dtype.
  const bool codes = kvmesh::is_code_type(key_cache.scalar_type());
  if (!codes) {
    kvmesh::check_same_dtype(query, key_cache, op, "query", "key_cache");
    kvmesh::check_same_dtype(query, value_cache, op, "query", "value_cache");
  }
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3 && key_cache.dim() == 4,
              "paged_decode_attention: bad ranks");
  if (codes) {
    kvmesh::check_code_pages(key_cache, value_cache, op);
  } else {
    TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(),
                "paged_decode_attention: caches must be contiguous");
  }
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(),
              "paged_decode_attention: key and value caches differ in shape");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1,
              "paged_decode_attention: head_dim must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong &&
                  rows.scalar_type() == at::kLong,
              "paged_decode_attention: index tensors must be int64");
  TORCH_CHECK(block_tables.is_contiguous() && context_lens.is_contiguous() && rows.is_contiguous(),
              "paged_decode_attention: index tensors must be contiguous");

  const int64_t num_decodes = rows.size(0);
  const int64_t num_heads = query.size(1);
  const int64_t head_dim = query.size(2);
  const int64_t num_blocks = key_cache.size(0);
  const int64_t block_size = key_cache.size(1);
  const int64_t num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim && out.size(2) == head_dim && out.size(1) == num_heads,
              "paged_decode_attention: head shape mismatch");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "paged_decode_attention: heads do not group");
  TORCH_CHECK(block_tables.size(0) == num_decodes && context_lens.size(0) == num_decodes,
              "paged_decode_attention: one block table and length per decode");
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t row_stride = num_kv_heads * head_dim;  // between tokens in a block
  const float scale_f = static_cast<float>(scale);
  const float softcap_f = static_cast<float>(softcap);
  TORCH_CHECK(sliding_window >= 0 && softcap >= 0.0,
              "paged_decode_attention: sliding_window and softcap must be >= 0");

  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* row_ids = rows.data_ptr<int64_t>();

  // Validate every index once, outside the parallel region: a bad block id
  // would otherwise read outside the cache.
  // First key of each decode: its window's start.
  std::vector<int64_t> begin_keys(num_decodes, 0);
  int64_t max_len = 0;
  for (int64_t i = 0; i < num_decodes; ++i) {
    const int64_t len = lens[i];
    TORCH_CHECK(len >= 1 && len <= max_blocks * block_size, "paged_decode_attention: context length ",
                len, " out of range");
    TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < query.size(0) && row_ids[i] < out.size(0),
                "paged_decode_attention: row out of range");
    if (sliding_window > 0) begin_keys[i] = std::max<int64_t>(0, len - sliding_window);
    for (int64_t b = begin_keys[i] / block_size; b < (len + block_size - 1) / block_size; ++b) {
      const int64_t block = tables[i * max_blocks + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "paged_decode_attention: block id ", block,
                  " out of range");
    }
    max_len = std::max(max_len, len - begin_keys[i]);
  }
  const int64_t* begins = begin_keys.data();
  // In elements of the cache (one byte for codes): a block's page apart.
  const CacheGeometry geo{block_size, key_cache.stride(0), row_stride, num_kv_heads};

  kvmesh::dispatch_float_or_bf16(query.scalar_type(), op, [&](auto tag) {
    using T = decltype(tag);
    kvmesh::dispatch_cache<T>(key_cache.scalar_type(), op, [&](auto cache_tag) {
      using C = decltype(cache_tag);
      const auto* k = static_cast<const C*>(key_cache.data_ptr());
      const auto* v = static_cast<const C*>(value_cache.data_ptr());
#if defined(__AVX2__) && defined(__FMA__)
      bool done = false;
      auto runs = [&](auto fn) {
        done = fn(out.data_ptr<T>(), query.data_ptr<T>(), k, v, tables, begins, lens, row_ids,
                  num_decodes, geo, group, max_blocks, query.stride(0), query.stride(1),
                  out.stride(0), out.stride(1), scale_f, softcap_f, run_tokens);
      };
      if (head_dim == 64) runs(&attend_all_runs<T, C, 64>);
      if (head_dim == 128) runs(&attend_all_runs<T, C, 128>);
      if (head_dim == 256) runs(&attend_all_runs<T, C, 256>);
      if (done) return;
#endif
      attend_all<T, C>(out.data_ptr<T>(), query.data_ptr<T>(), k, v, tables, begins, lens,
                       row_ids, num_decodes, geo, group, head_dim, max_blocks, max_len,
                       query.stride(0), query.stride(1), out.stride(0), out.stride(1), scale_f,
                       softcap_f);
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor context_lens, Tensor rows, float scale, int run_tokens=0, "
      "int sliding_window=0, float softcap=0.0) -> ()");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
