// Batched LoRA for one (possibly fused) projection, every adapter of a step in
// one parallel region: y[t] += B_s (A_s x[t]) for each token t of a segment
// with slot s, for CPU float32 and bfloat16 (accumulated in float32).
//
// Why: the torch path runs two small matmuls per adapter, segment and
// projection (hundreds per step), each its own parallel region whose barrier
// waits for the slowest thread, plus a dozen tensor views each built in
// Python. Here one call covers the projection: per-step overhead is one op
// call, and a thread preempted by a neighbour only delays its own items
// (work stealing, work_stealing.h).
//
// Layout (worker/lora/slots.py):
//   lora_a:   [slots, columns, in]   the slot's A rows; per slice, `rank` rows
//   lora_b_t: [slots, columns, out]  B transposed, scaling folded in
//   segments: [n, 3] int64           (first token, end token, slot); base tokens in none
//   slices:   [slots, n_slices, 4] int64  per slot and output slice:
//             (first column, columns, first output row, output rows); 0 columns
//             when the slot's adapter does not target that slice
//   min_parallel_macs: below this many multiply-adds, one thread
// A fused projection's B is block-diagonal (slice i's output rows read only
// slice i's columns), so the expand reads each slice's own block and skips
// the zeros the torch path multiplies.
//
// Work items: tiles of up to kTile tokens of one segment, times parts of the
// output rows when there are fewer tiles than threads (a few tokens of one
// adapter on a large model). An item shrinks its tokens for only the slices
// its rows need, then expands them. Each output element is written by exactly
// one item. Calls under `min_parallel_macs` run their items on the calling
// thread (a small model's decode step: no barrier to wait at).
//
// Rounding: the shrink and expand accumulate in float32 (the shrink's sum in
// vector lanes, the expand in column order) and y is rounded once, as
// y + delta; float32 agrees with torch's x @ Aᵀ @ Bᵀ up to the order of sums.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>

#include "vec16.h"
#endif

#include "float_or_bf16.h"
#include "work_stealing.h"

namespace {

using kvmesh::from_float;
using kvmesh::to_float;

constexpr int64_t kTile = 8;  // tokens per work item, sharing each load of B (and of A, by 4)
constexpr int64_t kMinPartRows = 128;  // output rows per item, at the least

struct Item {
  int64_t start, end, slot, row_begin, row_end;
};

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KVMESH_LORA_AVX512 1
// 16 lanes of float32 from float or bfloat16 (the first `n` only, rest 0).
__attribute__((always_inline)) inline __m512 load16(const float* p, int64_t n = 16) {
  return n >= 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
}

__attribute__((always_inline)) inline __m512 load16(const c10::BFloat16* p, int64_t n = 16) {
  const __m256i bits = n >= 16 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                               : _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p);
  return kvmesh::bf16_bits_to_float(bits);
}

__attribute__((always_inline)) inline void store16(float* p, __m512 v, int64_t n) {
  if (n >= 16) {
    _mm512_storeu_ps(p, v);
  } else {
    _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), v);
  }
}

// from_float<c10::BFloat16> on 16 lanes: the same integer rounding.
__attribute__((always_inline)) inline void store16(c10::BFloat16* p, __m512 v, int64_t n) {
  const __m256i halves = kvmesh::float_to_bf16_bits(v);
  if (n >= 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), halves);
  } else {
    _mm256_mask_storeu_epi16(p, static_cast<__mmask16>((1u << n) - 1), halves);
  }
}

// s[t * ld + j] = x[t] · a[j] for N tokens and CB rows of A: N x CB
// accumulators, so each load of x or A feeds several FMAs.
template <int N, int CB, typename T>
void shrink_block(const T* x, int64_t ldx, const T* a, int64_t in, float* s, int64_t ld) {
  __m512 acc[N][CB];
  for (int t = 0; t < N; ++t)
    for (int j = 0; j < CB; ++j) acc[t][j] = _mm512_setzero_ps();
  // Full vectors, then one masked tail: no branch in the hot loop.
  auto step = [&](int64_t k, int64_t n) __attribute__((always_inline)) {
    __m512 xv[N];
    for (int t = 0; t < N; ++t) xv[t] = load16(x + t * ldx + k, n);
    for (int j = 0; j < CB; ++j) {
      const __m512 av = load16(a + j * in + k, n);
      for (int t = 0; t < N; ++t) acc[t][j] = _mm512_fmadd_ps(xv[t], av, acc[t][j]);
    }
  };
  int64_t k = 0;
  for (; k + 16 <= in; k += 16) step(k, 16);
  if (k < in) step(k, in - k);
  for (int t = 0; t < N; ++t)
    for (int j = 0; j < CB; ++j) s[t * ld + j] = _mm512_reduce_add_ps(acc[t][j]);
}

#ifdef __AVX512BF16__
// bfloat16: 32 products per instruction (AVX512-BF16's dot product of pairs,
// exact products accumulated in float32), no conversions. Unlike the FMA
// loop it reads subnormal bfloat16 inputs as zero, far below any tolerance.
template <int N, int CB>
void shrink_block(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* a, int64_t in,
                  float* s, int64_t ld) {
  __m512 acc[N][CB];
  for (int t = 0; t < N; ++t)
    for (int j = 0; j < CB; ++j) acc[t][j] = _mm512_setzero_ps();
  auto step = [&](int64_t k, __mmask32 mask) __attribute__((always_inline)) {
    __m512bh xv[N];
    for (int t = 0; t < N; ++t) xv[t] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + t * ldx + k);
    for (int j = 0; j < CB; ++j) {
      const __m512bh av = (__m512bh)_mm512_maskz_loadu_epi16(mask, a + j * in + k);
      for (int t = 0; t < N; ++t) acc[t][j] = _mm512_dpbf16_ps(acc[t][j], xv[t], av);
    }
  };
  int64_t k = 0;
  for (; k + 32 <= in; k += 32) step(k, ~__mmask32{0});
  if (k < in) step(k, static_cast<__mmask32>((1u << (in - k)) - 1));
  for (int t = 0; t < N; ++t)
    for (int j = 0; j < CB; ++j) s[t * ld + j] = _mm512_reduce_add_ps(acc[t][j]);
}
#endif

template <int N, typename T>
void shrink_rows(const T* x, int64_t ldx, const T* a, int64_t columns, int64_t in, float* s,
                 int64_t ld) {
  int64_t c = 0;
  for (; c + 4 <= columns; c += 4) shrink_block<N, 4>(x, ldx, a + c * in, in, s + c, ld);
  for (; c < columns; ++c) shrink_block<N, 1>(x, ldx, a + c * in, in, s + c, ld);
}

// y[t][i] += Σ_c s[t][c] b[c][i] for N tokens and V x 16 outputs (`last`
// lanes valid in the last vector), the sum in column order, y rounded once.
// Straight-line per column, so the N x V accumulators stay in registers.
template <int N, int V, typename T>
inline void expand_chunk(const float* s, int64_t ld, const T* b, int64_t ldb, int64_t columns,
                         T* y, int64_t ldy, int64_t last) {
  __m512 acc[N][V];
  for (int t = 0; t < N; ++t)
    for (int v = 0; v < V; ++v) acc[t][v] = _mm512_setzero_ps();
  for (int64_t c = 0; c < columns; ++c) {
    __m512 bv[V];
    for (int v = 0; v < V; ++v) bv[v] = load16(b + c * ldb + 16 * v, v == V - 1 ? last : 16);
    for (int t = 0; t < N; ++t) {
      const __m512 w = _mm512_set1_ps(s[t * ld + c]);
      for (int v = 0; v < V; ++v) acc[t][v] = _mm512_fmadd_ps(w, bv[v], acc[t][v]);
    }
  }
  for (int t = 0; t < N; ++t) {
    for (int v = 0; v < V; ++v) {
      T* out = y + t * ldy + 16 * v;
      const int64_t n = v == V - 1 ? last : 16;
      store16(out, _mm512_add_ps(load16(out, n), acc[t][v]), n);
    }
  }
}

template <int N, typename T>
void expand_rows(const float* s, int64_t ld, const T* b, int64_t ldb, int64_t columns,
                 int64_t rows, T* y, int64_t ldy) {
  int64_t i = 0;
  for (; i + 32 <= rows; i += 32) expand_chunk<N, 2>(s, ld, b + i, ldb, columns, y + i, ldy, 16);
  for (; i < rows; i += 16) {
    expand_chunk<N, 1>(s, ld, b + i, ldb, columns, y + i, ldy, std::min<int64_t>(16, rows - i));
  }
}
#else
// Portable versions (the compiler vectorizes what it can).
template <int N, typename T>
void shrink_rows(const T* x, int64_t ldx, const T* a, int64_t columns, int64_t in, float* s,
                 int64_t ld) {
  for (int64_t c = 0; c < columns; ++c) {
    for (int t = 0; t < N; ++t) {
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t k = 0; k < in; ++k) acc += to_float(x[t * ldx + k]) * to_float(a[c * in + k]);
      s[t * ld + c] = acc;
    }
  }
}

template <int N, typename T>
void expand_rows(const float* s, int64_t ld, const T* b, int64_t ldb, int64_t columns,
                 int64_t rows, T* y, int64_t ldy) {
  for (int t = 0; t < N; ++t) {
#pragma omp simd
    for (int64_t i = 0; i < rows; ++i) {
      float acc = 0.f;
      for (int64_t c = 0; c < columns; ++c) acc += s[t * ld + c] * to_float(b[c * ldb + i]);
      y[t * ldy + i] = from_float<T>(to_float(y[t * ldy + i]) + acc);
    }
  }
}
#endif

template <template <int> class Fn, typename... Args>
void with_count(int64_t count, Args&&... args) {
  switch (count) {
    case 8: Fn<8>::run(args...); break;
    case 7: Fn<7>::run(args...); break;
    case 6: Fn<6>::run(args...); break;
    case 5: Fn<5>::run(args...); break;
    case 4: Fn<4>::run(args...); break;
    case 3: Fn<3>::run(args...); break;
    case 2: Fn<2>::run(args...); break;
    default: Fn<1>::run(args...); break;
  }
}

template <int N>
struct Shrink {
  template <typename T>
  static void run(const T* x, int64_t ldx, const T* a, int64_t cols, int64_t in, float* s,
                  int64_t ld) {
    shrink_rows<N>(x, ldx, a, cols, in, s, ld);
  }
};

template <int N>
struct Expand {
  template <typename T>
  static void run(const float* s, int64_t ld, const T* b, int64_t ldb, int64_t cols, int64_t rows,
                  T* y, int64_t ldy) {
    expand_rows<N>(s, ld, b, ldb, cols, rows, y, ldy);
  }
};

// Shrink then expand `count` (1-kTile) tokens: the shrink 4 tokens at a time
// (4 x 4 accumulators), the expand all at once (B converted once per tile).
template <typename T>
void tokens_delta(int64_t count, const T* x, int64_t ldx, const T* a, int64_t cols, int64_t in,
                  float* s, int64_t ld, const T* b, int64_t ldb, int64_t rows, T* y, int64_t ldy) {
  for (int64_t t = 0; t < count; t += 4) {
    with_count<Shrink>(std::min<int64_t>(4, count - t), x + t * ldx, ldx, a, cols, in, s + t * ld,
                       ld);
  }
  with_count<Expand>(count, s, ld, b, ldb, cols, rows, y, ldy);
}

void add_lora(at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a,
              const at::Tensor& lora_b_t, const at::Tensor& segments, const at::Tensor& slices,
              int64_t min_parallel_macs) {
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && y.size(0) == x.size(0),
              "add_lora: y [tokens, out] and x [tokens, in] must have the same rows");
  TORCH_CHECK(y.stride(1) == 1 && x.stride(1) == 1, "add_lora: rows of x and y must be contiguous");
  TORCH_CHECK(lora_a.dim() == 3 && lora_a.is_contiguous() && lora_a.size(2) == x.size(1),
              "add_lora: lora_a must be a contiguous [slots, columns, in] tensor");
  TORCH_CHECK(lora_b_t.dim() == 3 && lora_b_t.is_contiguous() &&
                  lora_b_t.size(0) == lora_a.size(0) && lora_b_t.size(1) == lora_a.size(1) &&
                  lora_b_t.size(2) == y.size(1),
              "add_lora: lora_b_t must be a contiguous [slots, columns, out] tensor");
  TORCH_CHECK(segments.scalar_type() == at::kLong && segments.dim() == 2 &&
                  segments.size(1) == 3 && segments.is_contiguous(),
              "add_lora: segments must be a contiguous int64 [n, 3] tensor");
  TORCH_CHECK(slices.scalar_type() == at::kLong && slices.dim() == 3 && slices.size(2) == 4 &&
                  slices.size(0) == lora_a.size(0) && slices.is_contiguous(),
              "add_lora: slices must be a contiguous int64 [slots, n_slices, 4] tensor");
  kvmesh::check_same_dtype(y, x, "add_lora", "y", "x");
  kvmesh::check_same_dtype(y, lora_a, "add_lora", "y", "lora_a");
  kvmesh::check_same_dtype(y, lora_b_t, "add_lora", "y", "lora_b_t");

  const int64_t tokens = y.size(0), out = y.size(1), in = x.size(1);
  const int64_t num_slots = lora_a.size(0), columns = lora_a.size(1);
  const int64_t num_slices = slices.size(1);
  const int64_t* seg = segments.data_ptr<int64_t>();
  const int64_t* sl = slices.data_ptr<int64_t>();
  for (int64_t i = 0; i < segments.size(0); ++i) {
    const int64_t start = seg[3 * i], end = seg[3 * i + 1], slot = seg[3 * i + 2];
    TORCH_CHECK(0 <= start && start <= end && end <= tokens && 0 <= slot && slot < num_slots,
                "add_lora: segment ", i, " (", start, ", ", end, ", ", slot, ") is out of range");
  }
  for (int64_t i = 0; i < num_slots * num_slices; ++i) {
    const int64_t* d = sl + 4 * i;
    TORCH_CHECK(d[0] >= 0 && d[1] >= 0 && d[0] + d[1] <= columns && d[2] >= 0 && d[3] >= 0 &&
                    d[2] + d[3] <= out,
                "add_lora: slice entry ", i, " is out of range");
  }

  std::vector<Item> tiles;
  for (int64_t i = 0; i < segments.size(0); ++i) {
    for (int64_t t = seg[3 * i]; t < seg[3 * i + 1]; t += kTile) {
      tiles.push_back({t, std::min(t + kTile, seg[3 * i + 1]), seg[3 * i + 2], 0, out});
    }
  }
  if (tiles.empty()) return;
  // Small calls (a decode step's few tokens per adapter) stay on the calling
  // thread: a parallel region ends at a barrier that waits for every thread,
  // and on a shared box the second thread may not run for a scheduler tick
  // (measured: 4 ms for a 33 µs call with 2 threads at load average 4).
  int64_t macs = 0;
  for (const Item& tile : tiles) {
    const int64_t* d = sl + tile.slot * num_slices * 4;
    for (int64_t j = 0; j < num_slices; ++j) {
      macs += (tile.end - tile.start) * d[4 * j + 1] * (in + d[4 * j + 3]);
    }
  }
  const int64_t threads = macs < min_parallel_macs ? 1 : at::get_num_threads();
  // Fewer tiles than threads: split the output rows too (each part shrinks
  // again, but only the slices whose rows it covers).
  int64_t parts = 1;
  if (static_cast<int64_t>(tiles.size()) < threads) {
    parts = std::min<int64_t>((threads + tiles.size() - 1) / tiles.size(),
                              std::max<int64_t>(1, out / kMinPartRows));
  }
  std::vector<Item> items;
  items.reserve(tiles.size() * parts);
  for (const Item& tile : tiles) {
    for (int64_t p = 0; p < parts; ++p) {
      items.push_back({tile.start, tile.end, tile.slot, out * p / parts, out * (p + 1) / parts});
    }
  }

  kvmesh::dispatch_float_or_bf16(y.scalar_type(), "add_lora", [&](auto tag) {
    using T = decltype(tag);
    T* yp = y.data_ptr<T>();
    const T* xp = x.data_ptr<T>();
    const T* ap = lora_a.data_ptr<T>();
    const T* bp = lora_b_t.data_ptr<T>();
    const int64_t ldx = x.stride(0), ldy = y.stride(0);
    auto run_item = [&](int64_t index, bool) {
      const Item& item = items[index];
      const int64_t* slot_slices = sl + item.slot * num_slices * 4;
      std::vector<float> shrunk(kTile * columns);
      float* s = shrunk.data();
      for (int64_t j = 0; j < num_slices; ++j) {
        const int64_t* d = slot_slices + 4 * j;
        const int64_t col = d[0], cols = d[1];
        const int64_t row_begin = std::max(d[2], item.row_begin);
        const int64_t row_end = std::min(d[2] + d[3], item.row_end);
        if (cols == 0 || row_begin >= row_end) continue;
        const T* a = ap + (item.slot * columns + col) * in;
        const T* b = bp + (item.slot * columns + col) * out + row_begin;
        tokens_delta(item.end - item.start, xp + item.start * ldx, ldx, a, cols, in, s, columns, b,
                     out, row_end - row_begin, yp + item.start * ldy + row_begin, ldy);
      }
    };
    if (threads <= 1) {
      for (int64_t i = 0; i < static_cast<int64_t>(items.size()); ++i) run_item(i, true);
    } else {
      kvmesh::parallel_items(static_cast<int64_t>(items.size()), run_item);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def(
      "add_lora(Tensor(a!) y, Tensor x, Tensor lora_a, Tensor lora_b_t, Tensor segments, "
      "Tensor slices, int min_parallel_macs) -> ()");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("add_lora", &add_lora); }
