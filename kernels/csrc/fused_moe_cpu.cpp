// A mixture-of-experts MLP step in one op: for the step's (token, expert)
// pairs, each active expert's gate_up over its rows, SiLU(gate) * up (or
// GELU-tanh(gate) * up), its down projection, scaled by the routing weight
// and summed into each token's output.
//
// Why not torch._grouped_mm (worker/models/moe.py's other path): at decode a
// step of 16 tokens x top-4 of 32 experts gives each expert 2-3 rows, and the
// grouped product over such runs reads the experts' float32 weights at ~7 GB/s
// on one Zen 2 core (docs/performance.md, "the fused MoE kernel"), where a
// step has nothing else to do. Here every active expert's weights are read
// once per step (for all its rows: a register tile of up to kRowBlock rows
// reuses each loaded weight vector, and each block of weight rows stays in L1
// over the expert's row blocks), the next block of weight rows is prefetched
// a block ahead, the pairs are sorted by a counting sort, and nothing is
// gathered: 1.45-1.85x the grouped path per layer at 1-64 tokens in float32,
// 2.0-2.4x with bfloat16 experts.
//
// Layout (transformers' and kvmesh's): gate_up [E, 2I, H], each expert's I
// gate rows then its I up rows; down [E, H, I]; weights float32 or bfloat16
// (bfloat16 widened in registers), x float32 or bfloat16, float32 sums.
//
// Two passes over torch's threads (work_stealing.h):
//   1. items = (active expert, kColTile intermediate columns): that expert's
//      gate and up rows for those columns, times its rows -> the activated
//      [rows, kColTile] block of a float32 scratch [pairs, I].
//   2. decode-sized steps (up to kExpertMajorPairs pairs): items = (active
//      expert, kDownTile output columns) like pass 1, each one contiguous
//      run of that expert's down rows times its activated rows, into a
//      [pairs, H] scratch; then each pair's row, scaled by its routing
//      weight, is added into its token's output in the sorted order.
//      Larger steps: items = kColTile output columns, for every active expert
//      in order its down rows for those columns times its activated rows,
//      scaled and added at once (no [pairs, H] scratch). Either way each
//      token's experts are summed in expert order, as the grouped path sums
//      them, with the same float operations: a token's output does not
//      depend on the path or on which thread ran what.
//
// Expert-major down items read 16.5 MB of runs of 48 KB instead of 28 runs
// of 12 KB per item; with each tile prefetching the rows its thread most
// likely reads next (the next tile's, across gate -> up and expert
// boundaries too), a 16-token step of the bench checkpoint's layer went
// 2.87 -> 2.73 ms on two Zen 2 cores (docs/performance.md, "expert-major").
//
// In bfloat16 (x) every intermediate is rounded where the grouped path's
// bfloat16 tensors store it (the projections, silu, the product, the scaled
// down rows; torch's bfloat16 index_add_ sums a token's rows in float32 and
// rounds once, as here), so the two agree to the order of the float32 sums
// inside the dot products.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__SSE4_1__)
#include <immintrin.h>
#endif

#include "float_or_bf16.h"
#include "work_stealing.h"

namespace {

using kvmesh::round_as;
using kvmesh::to_float;

// Rows of one expert multiplied together: each weight vector loaded is used
// this many times. Three rows x four weight rows is 12 accumulators + 3 rows
// + 1 weight vector = 16 AVX2 registers.
constexpr int kRowBlock = 3;
// Output columns per work item (both passes).
constexpr int64_t kColTile = 16;
// An expert's rows handled together by one item (a prefill chunk's expert
// may have hundreds): each block of weight rows is read from memory once per
// this many rows, which with their results stay in L2.
constexpr int64_t kRowChunk = 48;
// Pass 2 runs expert-major up to this many (token, expert) pairs: 1-16
// tokens x top-4 gained 5%, 64 tokens tied and 128 lost 1% (two Zen 2
// cores); the scratch is pairs x H floats.
constexpr int64_t kExpertMajorPairs = 256;
// Output columns of an expert-major down item (32-128 measured the same).
constexpr int64_t kDownTile = 64;

// One SIMD register of float32 lanes and what the dot products need of it.
#if defined(__AVX512F__)
struct Lanes {
  using V = __m512;
  static constexpr int64_t kWidth = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const c10::BFloat16* p) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
};
#elif defined(__AVX2__) && defined(__FMA__)
struct Lanes {
  using V = __m256;
  static constexpr int64_t kWidth = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const c10::BFloat16* p) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
};
#elif defined(__SSE4_1__)
// The generic x86 level (x86-64-v2): four lanes, multiply then add.
struct Lanes {
  using V = __m128;
  static constexpr int64_t kWidth = 4;
  static V zero() { return _mm_setzero_ps(); }
  static V load(const float* p) { return _mm_loadu_ps(p); }
  static V load(const c10::BFloat16* p) {
    const __m128i bits = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(bits), 16));
  }
  static V fma(V a, V b, V c) { return _mm_add_ps(_mm_mul_ps(a, b), c); }
  static float sum(V v) {
    __m128 s = _mm_add_ps(v, _mm_movehl_ps(v, v));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
};
#else
// Other architectures: one lane (gcc vectorizes what it can).
struct Lanes {
  using V = float;
  static constexpr int64_t kWidth = 1;
  static V zero() { return 0.f; }
  static V load(const float* p) { return *p; }
  static V load(const c10::BFloat16* p) { return to_float(*p); }
  static V fma(V a, V b, V c) { return a * b + c; }
  static float sum(V v) { return v; }
};
#endif

// One cache line ahead into L1 (a hint: no fault past the end of memory).
template <typename W>
inline void prefetch(const W* p) {
#if defined(__SSE4_1__)
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
#else
  __builtin_prefetch(p);
#endif
}

// Weight rows per register tile: kRowBlock rows x kWeightRows (12
// accumulators), or one row alone x kWeightRowsAlone (more independent sums
// to hide the fused multiply-add's latency).
constexpr int kWeightRows = 4;
constexpr int kWeightRowsAlone = 8;

// out[m * ldo + n] = dot(rows[m], w[n * ldw ...]) over K, for R rows and N
// weight rows: each weight vector is loaded once and used for all R rows.
// `next`: the N weight rows (same ldw) read after these, prefetched meanwhile.
template <int R, int N, typename W>
inline void dot_tile(const float* const* rows, const W* w, int64_t ldw, int64_t K, float* out,
                     int64_t ldo, const W* next) {
  using V = typename Lanes::V;
  // k steps per 64-byte line of W, at least one vector.
  constexpr int64_t kLineFloats = std::max<int64_t>(64 / sizeof(W), Lanes::kWidth);
  V acc[R][N];
#pragma GCC unroll 8
  for (int m = 0; m < R; ++m) {
#pragma GCC unroll 8
    for (int n = 0; n < N; ++n) acc[m][n] = Lanes::zero();
  }
  const int64_t whole = K - K % Lanes::kWidth;
  for (int64_t k = 0; k < whole; k += Lanes::kWidth) {
    V x[R];
#pragma GCC unroll 8
    for (int m = 0; m < R; ++m) x[m] = Lanes::load(rows[m] + k);
#pragma GCC unroll 8
    for (int n = 0; n < N; ++n) {
      // The next tile's rows are fetched a whole tile ahead: each row is
      // only a few KB, too short for the hardware prefetcher to reach full
      // speed on its own.
      if (k % kLineFloats == 0) prefetch(next + n * ldw + k);
      const V wv = Lanes::load(w + n * ldw + k);
#pragma GCC unroll 8
      for (int m = 0; m < R; ++m) acc[m][n] = Lanes::fma(x[m], wv, acc[m][n]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < R; ++m) {
#pragma GCC unroll 8
    for (int n = 0; n < N; ++n) {
      float s = Lanes::sum(acc[m][n]);
      for (int64_t k = whole; k < K; ++k) s += rows[m][k] * to_float(w[n * ldw + k]);
      out[m * ldo + n] = s;
    }
  }
}

// Every one of `count` rows times N consecutive weight rows, kRowBlock rows
// at a time: the N rows' weights stay in L1 from the first row block on.
template <int N, typename W>
inline void rows_times(const float* const* rows, int64_t count, const W* w, int64_t ldw,
                       int64_t K, float* out, int64_t ldo, const W* next) {
  int64_t m = 0;
  for (; m + kRowBlock <= count; m += kRowBlock) {
    dot_tile<kRowBlock, N>(rows + m, w, ldw, K, out + m * ldo, ldo, next);
  }
  switch (count - m) {
    case 2: dot_tile<2, N>(rows + m, w, ldw, K, out + m * ldo, ldo, next); break;
    case 1: dot_tile<1, N>(rows + m, w, ldw, K, out + m * ldo, ldo, next); break;
    default: break;
  }
}

// `count` rows times `cols` consecutive weight rows: out[m * ldo + n].
// `after`: the weight rows (same ldw) this thread most likely reads next.
template <typename W>
void dot_block(const float* const* rows, int64_t count, const W* w, int64_t ldw, int64_t K,
               int64_t cols, float* out, int64_t ldo, const W* after) {
  const auto next = [&](int64_t n) { return n < cols ? w + n * ldw : after; };
  int64_t n = 0;
  if (count == 1) {
    for (; n + kWeightRowsAlone <= cols; n += kWeightRowsAlone) {
      dot_tile<1, kWeightRowsAlone>(rows, w + n * ldw, ldw, K, out + n, ldo,
                                    next(n + kWeightRowsAlone));
    }
  }
  for (; n + kWeightRows <= cols; n += kWeightRows) {
    rows_times<kWeightRows>(rows, count, w + n * ldw, ldw, K, out + n, ldo,
                            next(n + kWeightRows));
  }
  for (; n < cols; ++n) rows_times<1>(rows, count, w + n * ldw, ldw, K, out + n, ldo, next(n + 1));
}

// transformers' activations, in float32 (T rounds their results as torch's
// T tensors would: the caller rounds the projections, act rounds its own).
template <typename T>
inline float activate(float gate, float up, bool gelu) {
  float a;
  if (gelu) {
    constexpr float kSqrt2OverPi = 0.7978845608028654f;
    a = 0.5f * gate * (1.f + std::tanh(kSqrt2OverPi * (gate + 0.044715f * gate * gate * gate)));
  } else {
    a = gate / (1.f + std::exp(-gate));
  }
  return round_as<T>(round_as<T>(a) * up);
}

// The step's pairs sorted by expert (then token, then rank: a stable sort of
// the flattened top-k ids, as the grouped path's argsort).
struct Routing {
  std::vector<int64_t> starts;      // [E + 1]: expert e's pairs are [starts[e], starts[e + 1])
  std::vector<int64_t> token;       // [pairs]: each sorted pair's token
  std::vector<float> weight;        // [pairs]: its routing weight
  std::vector<int64_t> active;      // experts with at least one pair, in order
};

Routing sort_pairs(const int64_t* ids, const float* weights, int64_t pairs, int64_t top_k,
                   int64_t experts) {
  Routing r;
  r.starts.assign(experts + 1, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(ids[p] >= 0 && ids[p] < experts, "fused_moe: expert id ", ids[p],
                " out of range for ", experts, " experts");
    ++r.starts[ids[p] + 1];
  }
  for (int64_t e = 0; e < experts; ++e) {
    if (r.starts[e + 1] > 0) r.active.push_back(e);
    r.starts[e + 1] += r.starts[e];
  }
  std::vector<int64_t> next(r.starts.begin(), r.starts.end() - 1);
  r.token.resize(pairs);
  r.weight.resize(pairs);
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t slot = next[ids[p]]++;
    r.token[slot] = p / top_k;
    r.weight[slot] = weights[p];
  }
  return r;
}

template <typename T, typename W>
void run(const at::Tensor& x, const Routing& r, const W* gate_up, const W* down, int64_t inter,
         bool gelu, at::Tensor& out) {
  const int64_t tokens = x.size(0), hidden = x.size(1);
  const int64_t pairs = static_cast<int64_t>(r.token.size());
  // x as float32 rows (bfloat16 widened once, not once per expert).
  std::unique_ptr<float[]> widened;
  const float* xf;
  if constexpr (std::is_same_v<T, float>) {
    xf = x.data_ptr<float>();
  } else {
    widened.reset(new float[tokens * hidden]);
    const T* xp = x.data_ptr<T>();
    for (int64_t i = 0; i < tokens * hidden; ++i) widened[i] = to_float(xp[i]);
    xf = widened.get();
  }
  std::vector<const float*> x_rows(pairs);
  for (int64_t p = 0; p < pairs; ++p) x_rows[p] = xf + r.token[p] * hidden;

  // Pass 1: activated [pairs, I].
  std::unique_ptr<float[]> act(new float[pairs * inter]);
  const int64_t col_tiles = (inter + kColTile - 1) / kColTile;
  const int64_t items = static_cast<int64_t>(r.active.size()) * col_tiles;
  kvmesh::parallel_items(items, [&](int64_t item, bool) {
    const int64_t e = r.active[item / col_tiles];
    const int64_t c0 = (item % col_tiles) * kColTile, cols = std::min(kColTile, inter - c0);
    const int64_t first = r.starts[e], count = r.starts[e + 1] - first;
    const W* gate_w = gate_up + (e * 2 * inter + c0) * hidden;
    const W* up_w = gate_w + inter * hidden;
    // What this thread most likely reads after the up rows: the next column
    // tile's gate rows, or the next active expert's first ones.
    const size_t slot = static_cast<size_t>(item / col_tiles) + 1;
    const W* after_up = c0 + cols < inter         ? gate_w + cols * hidden
                        : slot < r.active.size() ? gate_up + r.active[slot] * 2 * inter * hidden
                                                 : up_w + cols * hidden;
    float gate[kRowChunk * kColTile], up[kRowChunk * kColTile];
    for (int64_t m0 = 0; m0 < count; m0 += kRowChunk) {
      const int64_t rows = std::min<int64_t>(kRowChunk, count - m0);
      const float* const* xr = x_rows.data() + first + m0;
      dot_block(xr, rows, gate_w, hidden, hidden, cols, gate, kColTile, up_w);
      dot_block(xr, rows, up_w, hidden, hidden, cols, up, kColTile, after_up);
      for (int64_t m = 0; m < rows; ++m) {
        float* a = act.get() + (first + m0 + m) * inter + c0;
        for (int64_t c = 0; c < cols; ++c) {
          const int64_t i = m * kColTile + c;
          a[c] = activate<T>(round_as<T>(gate[i]), round_as<T>(up[i]), gelu);
        }
      }
    }
  });

  // Pass 2: down, scaled and summed per token in expert order, into float32
  // sums (out itself for float32) rounded to T once at the end.
  float* sums;
  std::unique_ptr<float[]> sum_buffer;
  if constexpr (std::is_same_v<T, float>) {
    sums = out.data_ptr<float>();
  } else {
    sum_buffer.reset(new float[tokens * hidden]);
    sums = sum_buffer.get();
  }
  std::fill(sums, sums + tokens * hidden, 0.f);
  std::vector<const float*> act_rows(pairs);
  for (int64_t p = 0; p < pairs; ++p) act_rows[p] = act.get() + p * inter;
  if (pairs <= kExpertMajorPairs) {
    std::unique_ptr<float[]> down_rows(new float[pairs * hidden]);
    const int64_t tiles = (hidden + kDownTile - 1) / kDownTile;
    const int64_t down_items = static_cast<int64_t>(r.active.size()) * tiles;
    kvmesh::parallel_items(down_items, [&](int64_t item, bool) {
      const size_t a = static_cast<size_t>(item / tiles);
      const int64_t e = r.active[a];
      const int64_t n0 = (item % tiles) * kDownTile, cols = std::min(kDownTile, hidden - n0);
      const W* down_w = down + (e * hidden + n0) * inter;
      const W* after = n0 + cols < hidden          ? down_w + cols * inter
                       : a + 1 < r.active.size() ? down + r.active[a + 1] * hidden * inter
                                                 : down_w + cols * inter;
      for (int64_t p0 = r.starts[e]; p0 < r.starts[e + 1]; p0 += kRowChunk) {
        const int64_t rows = std::min<int64_t>(kRowChunk, r.starts[e + 1] - p0);
        dot_block(act_rows.data() + p0, rows, down_w, inter, inter, cols,
                  down_rows.get() + p0 * hidden + n0, hidden, after);
      }
    });
    // Pairs in sorted order: each token's experts in expert order.
    for (int64_t p = 0; p < pairs; ++p) {
      const float w = r.weight[p];
      const float* d = down_rows.get() + p * hidden;
      float* s = sums + r.token[p] * hidden;
      for (int64_t c = 0; c < hidden; ++c) s[c] += round_as<T>(w * round_as<T>(d[c]));
    }
  } else {
    const int64_t out_tiles = (hidden + kColTile - 1) / kColTile;
    kvmesh::parallel_items(out_tiles, [&](int64_t tile, bool) {
      const int64_t n0 = tile * kColTile, cols = std::min(kColTile, hidden - n0);
      float d[kRowChunk * kColTile];
      const size_t active = r.active.size();
      for (size_t a = 0; a < active; ++a) {
        const int64_t e = r.active[a];
        const W* down_w = down + (e * hidden + n0) * inter;
        // The next active expert's rows for these columns, or the next tile's first.
        const W* after = a + 1 < active ? down + (r.active[a + 1] * hidden + n0) * inter
                                        : down + (r.active[0] * hidden + n0 + cols) * inter;
        for (int64_t p0 = r.starts[e]; p0 < r.starts[e + 1]; p0 += kRowChunk) {
          const int64_t rows = std::min<int64_t>(kRowChunk, r.starts[e + 1] - p0);
          dot_block(act_rows.data() + p0, rows, down_w, inter, inter, cols, d, kColTile, after);
          for (int64_t m = 0; m < rows; ++m) {
            const float w = r.weight[p0 + m];
            float* s = sums + r.token[p0 + m] * hidden + n0;
            for (int64_t c = 0; c < cols; ++c) {
              s[c] += round_as<T>(w * round_as<T>(d[m * kColTile + c]));
            }
          }
        }
      }
    });
  }
  if constexpr (!std::is_same_v<T, float>) {
    T* op = out.data_ptr<T>();
    for (int64_t i = 0; i < tokens * hidden; ++i) op[i] = kvmesh::from_float<T>(sums[i]);
  }
}

at::Tensor fused_moe(const at::Tensor& x, const at::Tensor& topk_ids,
                     const at::Tensor& topk_weights, const at::Tensor& gate_up,
                     const at::Tensor& down, bool gelu) {
  constexpr const char* op = "fused_moe";
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), op, ": x must be a contiguous [tokens, hidden]");
  const int64_t tokens = x.size(0), hidden = x.size(1);
  TORCH_CHECK(topk_ids.scalar_type() == at::kLong && topk_ids.dim() == 2 &&
                  topk_ids.is_contiguous() && topk_ids.size(0) == tokens,
              op, ": topk_ids must be contiguous int64 [tokens, k]");
  TORCH_CHECK(topk_weights.scalar_type() == at::kFloat && topk_weights.is_contiguous() &&
                  topk_weights.sizes() == topk_ids.sizes(),
              op, ": topk_weights must be contiguous float32 shaped as topk_ids");
  TORCH_CHECK(gate_up.dim() == 3 && gate_up.is_contiguous() && gate_up.size(2) == hidden &&
                  gate_up.size(1) % 2 == 0,
              op, ": gate_up must be contiguous [experts, 2 * intermediate, hidden]");
  const int64_t experts = gate_up.size(0), inter = gate_up.size(1) / 2;
  TORCH_CHECK(down.dim() == 3 && down.is_contiguous() && down.size(0) == experts &&
                  down.size(1) == hidden && down.size(2) == inter,
              op, ": down must be contiguous [experts, hidden, intermediate]");
  TORCH_CHECK(down.scalar_type() == gate_up.scalar_type(), op, ": down is ", down.scalar_type(),
              " but gate_up is ", gate_up.scalar_type());
  const Routing routing = sort_pairs(topk_ids.data_ptr<int64_t>(), topk_weights.data_ptr<float>(),
                                     topk_ids.numel(), topk_ids.size(1), experts);
  at::Tensor out = at::empty({tokens, hidden}, x.options());
  kvmesh::dispatch_float_or_bf16(x.scalar_type(), op, [&](auto x_tag) {
    using T = decltype(x_tag);
    kvmesh::dispatch_float_or_bf16(gate_up.scalar_type(), op, [&](auto w_tag) {
      using W = decltype(w_tag);
      run<T, W>(x, routing, gate_up.data_ptr<W>(), down.data_ptr<W>(), inter, gelu, out);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def(
      "fused_moe(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor gate_up, Tensor down, "
      "bool gelu) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("fused_moe", &fused_moe); }
