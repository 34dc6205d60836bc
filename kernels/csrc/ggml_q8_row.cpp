// y = x Wᵀ for ONE row of x (a batch-1 decode step) over a GGUF file's blocks
// on int8 activations: ggml_q8_linear.cpp's arithmetic (its header comment
// says it), with a loop per weight type written for the single row.
//
// Why a kernel of its own: at batch 1 a decode step is these loops and
// little else (~75% of a step of the default model's Q4_K_M file), and the
// general kernel, written for up to 4 rows of x, is bound there by its
// dependency chains rather than by its work: one float accumulator per row
// (each run's fused multiply-add waits ~5 cycles for the previous one), a
// scalar bias chain, and each block's factors rebuilt in scalar code. Here:
//   * two accumulators per row (runs alternate between them);
//   * the terms of each run that depend on x alone precomputed once per call
//     (dx of each half run, dx times each run's code sum), so a block's
//     factors and its minimum terms are a few vector products;
//   * offset codes (Q4_0's c - 8, Q5_0's c - 16) corrected in the integer
//     sums: sum((c - o) q) = sum(c q) - o sum(q), exact, no bias term.
// Every type's weight is still w = a * c + b per run of codes and the
// activations are quantized per 32 features exactly as ggml_q8_linear.cpp
// quantizes them, so kernels/ggml_q8_reference.py is this kernel's reference
// too; only the order of float32 roundings differs.
//
// Threads split the output rows (kvmesh::parallel_items).
//
// Also here: ggml_llama_layer_row, a whole Llama decoder layer for one token
// on such blocks, its ops called from C++ (see its comment).

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVMESH_ROW_AVX2 1
#endif
#include "ggml_blocks.h"
#include "ggml_codes_avx2.h"
#include "work_stealing.h"

namespace {

using namespace kvmesh::ggml;

constexpr int64_t kRun = 32;  // features per activation scale

// One row of x quantized per 32 features (codes q, scale dx = max|x| / 127),
// with what the weight loops read per run computed once per call.
struct RowX {
  std::vector<int8_t> codes;  // [K]
  std::vector<float> dx;      // [K / 32]
  std::vector<float> dx16;    // [K / 16]: dx of each half run (Q6_K's 16-weight scales)
  std::vector<float> dxs16;   // [K / 16]: dx * sum(q) of each half run
  std::vector<float> dxs32;   // [K / 32]: dx * sum(q) of each run
  // [K / 32 * 8]: 8 int32 lanes per run, lane 0 = o * sum(q) for the offset o
  // of Q4_0 (8) and Q5_0 (16), the rest 0: subtracted from a run's lane sums.
  std::vector<int32_t> offset8;
  std::vector<int32_t> offset16;
};


void quantize_row(const float* x, int64_t K, RowX& q) {
  const int64_t runs = K / kRun;
  q.codes.resize(K);
  q.dx.resize(runs);
  q.dx16.resize(2 * runs);
  q.dxs16.resize(2 * runs);
  q.dxs32.resize(runs);
  q.offset8.assign(8 * runs, 0);
  q.offset16.assign(8 * runs, 0);
  for (int64_t r = 0; r < runs; ++r) {
    const float* xr = x + r * kRun;
    int8_t* codes = q.codes.data() + r * kRun;
#if KVMESH_ROW_AVX2
    // The same float32 operations as ggml_q8_linear.cpp's quantize_x, eight
    // at a time: max |x| (exact), one division, a product, ties-to-even rounding.
    __m256 v[4];
    __m256 amax8 = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xr + 8 * i);
      amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign, v[i]));
    }
    const float amax = hmax(amax8);
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    __m256i ints[4];
    for (int i = 0; i < 4; ++i) {
      __m256 t = _mm256_round_ps(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      t = _mm256_min_ps(_mm256_set1_ps(127.0f), _mm256_max_ps(_mm256_set1_ps(-127.0f), t));
      ints[i] = _mm256_cvtps_epi32(t);
    }
    // Packing interleaves the 128-bit lanes; the permutation puts them back in order.
    const __m256i bytes = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(ints[0], ints[1]),
                           _mm256_packs_epi32(ints[2], ints[3])),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes), bytes);
#else
    float amax = 0.0f;
    for (int l = 0; l < kRun; ++l) amax = std::max(amax, std::fabs(xr[l]));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int l = 0; l < kRun; ++l) {
      const float t = std::min(127.0f, std::max(-127.0f, std::nearbyint(xr[l] * inv)));
      codes[l] = static_cast<int8_t>(t);
    }
#endif
    const float dx = amax / 127.0f;
    int32_t sums[2] = {0, 0};
    for (int l = 0; l < kRun; ++l) sums[l / 16] += codes[l];
    q.dx[r] = dx;
    q.dx16[2 * r] = q.dx16[2 * r + 1] = dx;
    q.dxs16[2 * r] = dx * static_cast<float>(sums[0]);
    q.dxs16[2 * r + 1] = dx * static_cast<float>(sums[1]);
    q.dxs32[r] = dx * static_cast<float>(sums[0] + sums[1]);
    q.offset8[8 * r] = 8 * (sums[0] + sums[1]);
    q.offset16[8 * r] = 16 * (sums[0] + sums[1]);
  }
}

#if KVMESH_ROW_AVX2
// Lane r of v in every lane.
inline __m256 lane(__m256 v, int r) { return _mm256_permutevar8x32_ps(v, _mm256_set1_epi32(r)); }

// Legacy blocks (32 weights, one float16 d; Q4_1/Q5_1 a float16 m too).
// One block's integer lane sums of c q, with Q4_0's / Q5_0's offset taken
// off in integers (w = d (c - 8) / d (c - 16)).
template <int64_t kind>
inline __m256i legacy_sums(const uint8_t* blk, const RowX& x, int64_t b) {
  constexpr LegacyLayout at = legacy_layout(kind);
  const int8_t* q = x.codes.data() + b * kRun;
  if constexpr (kind == kQ8_0) {
    return dot_lanes_signed(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2)), q);
  } else {
    __m256i c = nibbles32(blk + at.qs);
    if constexpr (at.five) c = _mm256_or_si256(c, fifth_bits32(blk + at.qh));
    const __m256i sums = dot_lanes(c, q);
    if constexpr (kind == kQ4_0 || kind == kQ5_0) {
      const int32_t* off = (kind == kQ4_0 ? x.offset8 : x.offset16).data() + 8 * b;
      return _mm256_sub_epi32(sums, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(off)));
    }
    return sums;
  }
}

// Two blocks per iteration into two named accumulators: an array indexed by
// the block's parity was kept on the stack by the compiler, so every block's
// fused multiply-add waited on a store and a reload of the previous one
// (~7 cycles a block, the loop's bound; 1.15x faster on Q5_0 rows here).
template <int64_t kind>
float dot_legacy(const uint8_t* row, const RowX& x, int64_t K) {
  constexpr Format f = block_format(kind);
  const int64_t blocks = K / f.weights;
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  float bias0 = 0.0f, bias1 = 0.0f;
  int64_t b = 0;
  for (; b + 2 <= blocks; b += 2) {
    const uint8_t* blk = row + b * f.bytes;
    // Q8_0: the weight bytes ~4 KiB ahead, asked for every 68 bytes (about one
    // cache line) here instead of a row's lines at once per row (dot_rows):
    // its loop is short enough per byte that a burst of 10 requests per
    // 576-wide row left the stream waiting (a standalone copy of the step's
    // 121 Q8_0 projections, 1 thread: 13.1 -> 11.6 ms). Past a tensor's end
    // the address is still only a hint: prefetches never fault.
    if constexpr (kind == kQ8_0) __builtin_prefetch(blk + kPrefetchAheadBytes);
    const __m256i s0 = legacy_sums<kind>(blk, x, b);
    const __m256i s1 = legacy_sums<kind>(blk + f.bytes, x, b + 1);
    acc0 = _mm256_fmadd_ps(_mm256_set1_ps(half_at(blk) * x.dx[b]), _mm256_cvtepi32_ps(s0), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_set1_ps(half_at(blk + f.bytes) * x.dx[b + 1]),
                           _mm256_cvtepi32_ps(s1), acc1);
    if constexpr (kind == kQ4_1 || kind == kQ5_1) {
      bias0 += half_at(blk + 2) * x.dxs32[b];
      bias1 += half_at(blk + f.bytes + 2) * x.dxs32[b + 1];
    }
  }
  if (b < blocks) {
    const uint8_t* blk = row + b * f.bytes;
    const __m256i s0 = legacy_sums<kind>(blk, x, b);
    acc0 = _mm256_fmadd_ps(_mm256_set1_ps(half_at(blk) * x.dx[b]), _mm256_cvtepi32_ps(s0), acc0);
    if constexpr (kind == kQ4_1 || kind == kQ5_1) bias0 += half_at(blk + 2) * x.dxs32[b];
  }
  return hsum(_mm256_add_ps(acc0, acc1)) + (bias0 + bias1);
}

// Q4_K / Q5_K: 256 weights, 8 runs of 32 with 6-bit scale sc and minimum m:
// w = d sc c - dmin m.
template <int64_t kind>
float dot_k45(const uint8_t* row, const RowX& x, int64_t K) {
  constexpr Format f = block_format(kind);
  const int64_t blocks = K / f.weights;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  __m256 mins = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = row + b * f.bytes;
    // The 12 packed bytes to sc[0..7] in bytes 0-7 and m[0..7] in bytes 8-15
    // (llama.cpp's kmask unpacking; the same values as scale_min_k4).
    uint32_t u[4];
    std::memcpy(u, blk + 4, 12);
    constexpr uint32_t kmask1 = 0x3f3f3f3f, kmask2 = 0x0f0f0f0f, kmask3 = 0x03030303;
    u[3] = ((u[2] >> 4) & kmask2) | (((u[1] >> 6) & kmask3) << 4);
    const uint32_t low_mins = u[1] & kmask1;
    u[1] = (u[2] & kmask2) | (((u[0] >> 6) & kmask3) << 4);
    u[2] = low_mins;
    u[0] &= kmask1;
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u));
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(packed));
    const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(packed, 8)));
    const __m256 d = _mm256_set1_ps(half_at(blk)), dmin = _mm256_set1_ps(half_at(blk + 2));
    // Run r's factor d sc_r dx_r, and the minimums' sum over runs of dmin m_r dx_r sum(q_r).
    const __m256 factor = _mm256_mul_ps(_mm256_mul_ps(d, sc), _mm256_loadu_ps(&x.dx[8 * b]));
    mins = _mm256_fmadd_ps(_mm256_mul_ps(dmin, m), _mm256_loadu_ps(&x.dxs32[8 * b]), mins);
    const uint8_t* qs = blk + kquant_nibbles_at(kind);
    __m256i qh;
    if constexpr (kind == kQ5_K) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16));
    const int8_t* q = x.codes.data() + b * f.weights;
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      // Byte l of chunk j: run 2j's weight l in the low nibble, run 2j + 1's in the high.
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
      __m256i c0 = _mm256_and_si256(bytes, low4);
      __m256i c1 = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
      if constexpr (kind == kQ5_K) {
        // Run r's fifth bit is bit r of qh[l]: moved to bit 4 of its byte.
        const __m256i bit4 = _mm256_set1_epi8(0x10);
        const int r = 2 * j;
        const __m256i h0 = r <= 4 ? _mm256_slli_epi16(qh, 4 - r) : _mm256_srli_epi16(qh, r - 4);
        const __m256i h1 =
            r + 1 <= 4 ? _mm256_slli_epi16(qh, 3 - r) : _mm256_srli_epi16(qh, r - 3);
        c0 = _mm256_or_si256(c0, _mm256_and_si256(h0, bit4));
        c1 = _mm256_or_si256(c1, _mm256_and_si256(h1, bit4));
      }
      const __m256i s0 = dot_lanes(c0, q + 64 * j);
      const __m256i s1 = dot_lanes(c1, q + 64 * j + 32);
      acc[0] = _mm256_fmadd_ps(lane(factor, 2 * j), _mm256_cvtepi32_ps(s0), acc[0]);
      acc[1] = _mm256_fmadd_ps(lane(factor, 2 * j + 1), _mm256_cvtepi32_ps(s1), acc[1]);
    }
  }
  return hsum(_mm256_add_ps(acc[0], acc[1])) - hsum(mins);
}

// Q6_K: 256 weights, 16 sub-blocks of 16 with an int8 scale: w = d sc (c - 32).
float dot_q6k(const uint8_t* row, const RowX& x, int64_t K) {
  constexpr Format f = block_format(kQ6_K);
  const int64_t blocks = K / f.weights;
  const __m256i low4 = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30);
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  __m256 offsets = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = row + b * f.bytes;
    const __m256 d = _mm256_set1_ps(half_at(blk + 208));
    const __m128i sc_bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));
    // d sc_h of the 16 sub-blocks (runs 0-3 in ds[0], 4-7 in ds[1]).
    const __m256 ds[2] = {
        _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc_bytes))),
        _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc_bytes, 8))))};
    // The -32 of every code: sum over sub-blocks of d sc_h dx sum(q_h), times 32 at the end.
    offsets = _mm256_fmadd_ps(ds[0], _mm256_loadu_ps(&x.dxs16[16 * b]), offsets);
    offsets = _mm256_fmadd_ps(ds[1], _mm256_loadu_ps(&x.dxs16[16 * b + 8]), offsets);
    const int8_t* q = x.codes.data() + b * f.weights;
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      // The factor d sc dx of each of this 128-weight half's 8 sub-blocks.
      const __m256 factor = _mm256_mul_ps(ds[h], _mm256_loadu_ps(&x.dx16[16 * b + 8 * h]));
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
      const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h));
      const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32));
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) {
        // Run 4h + g: the low 4 bits in nibble g / 2 of ql[64 h + 32 (g % 2) + l],
        // the high 2 in bits 2g, 2g + 1 of qh[32 h + l], moved to bits 4-5.
        const __m256i ql = g % 2 ? ql1 : ql0;
        const __m256i low = _mm256_and_si256(g < 2 ? ql : _mm256_srli_epi16(ql, 4), low4);
        const __m256i high = g == 0   ? _mm256_slli_epi16(qh, 4)
                             : g == 1 ? _mm256_slli_epi16(qh, 2)
                             : g == 2 ? qh
                                      : _mm256_srli_epi16(qh, 2);
        const __m256i c = _mm256_or_si256(low, _mm256_and_si256(high, bits45));
        // Lanes 0-3 sum the run's first 16 weights, lanes 4-7 its last 16.
        const __m256i sums = dot_lanes(c, q + 128 * h + 32 * g);
        const __m256 f2 = _mm256_permutevar8x32_ps(
            factor, _mm256_setr_epi32(2 * g, 2 * g, 2 * g, 2 * g, 2 * g + 1, 2 * g + 1, 2 * g + 1,
                                      2 * g + 1));
        acc[g & 1] = _mm256_fmadd_ps(f2, _mm256_cvtepi32_ps(sums), acc[g & 1]);
      }
    }
  }
  return hsum(_mm256_add_ps(acc[0], acc[1])) - 32.0f * hsum(offsets);
}

template <int64_t kind>
float dot_row(const uint8_t* row, const RowX& x, int64_t K) {
  if constexpr (kind == kQ4_K || kind == kQ5_K) {
    return dot_k45<kind>(row, x, K);
  } else if constexpr (kind == kQ6_K) {
    return dot_q6k(row, x, K);
  } else {
    return dot_legacy<kind>(row, x, K);
  }
}
#else
// Without AVX2: the same sums, one code at a time.
template <int64_t kind>
float dot_row(const uint8_t* row, const RowX& x, int64_t K) {
  constexpr Format f = block_format(kind);
  constexpr int runs = f.weights / kRun;
  int16_t c[32];
  float acc = 0.0f;
  for (int64_t b = 0; b < K / f.weights; ++b) {
    const uint8_t* blk = row + b * f.bytes;
    for (int r = 0; r < runs; ++r) {
      run_codes<kind>(blk, r, c);
      const int64_t xr = b * runs + r;
      const int8_t* q = x.codes.data() + xr * kRun;
      int32_t dots[2] = {0, 0};
      for (int l = 0; l < 32; ++l) dots[l / 16] += c[l] * q[l];
      float a[2], off[2];  // w = a (c - off) per half run, or a c + off for Q4_1/Q5_1
      if constexpr (kind == kQ4_K || kind == kQ5_K) {
        uint8_t sc, m;
        scale_min_k4(r, blk + 4, sc, m);
        a[0] = a[1] = half_at(blk) * static_cast<float>(sc);
        off[0] = off[1] = -(half_at(blk + 2) * static_cast<float>(m));
      } else if constexpr (kind == kQ6_K) {
        const auto* sc = reinterpret_cast<const int8_t*>(blk + 192);
        for (int h = 0; h < 2; ++h) {
          a[h] = half_at(blk + 208) * static_cast<float>(sc[2 * r + h]);
          off[h] = -32.0f * a[h];
        }
      } else {
        const float d = half_at(blk);
        a[0] = a[1] = d;
        off[0] = off[1] = kind == kQ4_0   ? -8.0f * d
                          : kind == kQ5_0 ? -16.0f * d
                          : kind == kQ8_0 ? 0.0f
                                          : half_at(blk + 2);
      }
      acc += a[0] * x.dx[xr] * static_cast<float>(dots[0]) +
             a[1] * x.dx[xr] * static_cast<float>(dots[1]) + off[0] * x.dxs16[2 * xr] +
             off[1] * x.dxs16[2 * xr + 1];
    }
  }
  return acc;
}
#endif

constexpr int64_t kRowsPerItem = 16;  // output rows per work item

// Rows [r0, r1) of one segment of type `kind` ([rows, row_bytes] blocks).
template <int64_t kind>
void dot_rows(const uint8_t* base, int64_t row_bytes, int64_t rows, int64_t r0, int64_t r1,
              const RowX& qx, int64_t K, float* out) {
  for (int64_t r = r0; r < r1; ++r) {
#if KVMESH_ROW_AVX2
    // Q8_0's AVX2 loop asks for its bytes itself (dot_legacy).
    if constexpr (kind != kQ8_0) prefetch_row_ahead(base, row_bytes, r, rows);
#else
    prefetch_row_ahead(base, row_bytes, r, rows);
#endif
    out[r] = dot_row<kind>(base + r * row_bytes, qx, K);
  }
}

at::Tensor ggml_linear_q8_row(const at::Tensor& x, at::TensorList blocks, at::IntArrayRef kinds) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(0) == 1 && x.is_contiguous(),
              "ggml_linear_q8_row: x must be a contiguous float32 [1, K] tensor");
  TORCH_CHECK(blocks.size() == kinds.size() && !blocks.empty(),
              "ggml_linear_q8_row: one ggml type per block tensor");
  const int64_t K = x.size(1);
  TORCH_CHECK(K % kRun == 0, "ggml_linear_q8_row: K ", K, " is not a multiple of ", kRun);
  for (size_t s = 0; s < blocks.size(); ++s) {
    check_segment(blocks[s], kinds[s], K, "ggml_linear_q8_row");
  }
  const SegmentItems items(blocks, kRowsPerItem);
  const int64_t N = items.rows();
  at::Tensor y = at::empty({1, N}, x.options());
  // The quantized row's buffers are kept per calling thread: their sizes
  // repeat every call, so after the first they cost no allocation (seven
  // vectors per call, ~120 calls a step). The threads below read the
  // caller's through this reference (a thread_local named in the lambda
  // would be each thread's own).
  thread_local RowX row_buffers;
  RowX& qx = row_buffers;
  quantize_row(x.data_ptr<float>(), K, qx);
  float* yp = y.data_ptr<float>();
  kvmesh::parallel_items(items.items(), [&](int64_t i, bool /*forward*/) {
    const SegmentItems::Item item = items.item(i);
    const size_t s = item.segment;
    const Format f = block_format(kinds[s]);
    const int64_t row_bytes = K / f.weights * f.bytes;
    const uint8_t* base = blocks[s].data_ptr<uint8_t>();
    const int64_t rows = blocks[s].size(0);
    float* out = yp + items.first_row(s);
    const int64_t r0 = item.row0, r1 = item.row0 + item.rows;
    switch (kinds[s]) {
      case kQ4_0: dot_rows<kQ4_0>(base, row_bytes, rows, r0, r1, qx, K, out); break;
      case kQ4_1: dot_rows<kQ4_1>(base, row_bytes, rows, r0, r1, qx, K, out); break;
      case kQ5_0: dot_rows<kQ5_0>(base, row_bytes, rows, r0, r1, qx, K, out); break;
      case kQ5_1: dot_rows<kQ5_1>(base, row_bytes, rows, r0, r1, qx, K, out); break;
      case kQ8_0: dot_rows<kQ8_0>(base, row_bytes, rows, r0, r1, qx, K, out); break;
      case kQ4_K: dot_rows<kQ4_K>(base, row_bytes, rows, r0, r1, qx, K, out); break;
      case kQ5_K: dot_rows<kQ5_K>(base, row_bytes, rows, r0, r1, qx, K, out); break;
      case kQ6_K: dot_rows<kQ6_K>(base, row_bytes, rows, r0, r1, qx, K, out); break;
      default: break;  // check_segment refused every other type before the threads ran
    }
  });
  return y;
}

// One kvmesh op by name, called boxed (the ops live in other sources; a
// boxed call through the dispatcher costs well under a microsecond, a call
// from Python several).
class Op {
 public:
  explicit Op(const char* name)
      : handle_(c10::Dispatcher::singleton().findSchemaOrThrow(name, "")) {}

  // Calls the op; its outputs replace the arguments on the stack.
  void operator()(torch::jit::Stack& stack) const { handle_.callBoxed(&stack); }

 private:
  c10::OperatorHandle handle_;
};

// The step's tensors that every layer's attention reads (the same for all
// layers of one step).
struct RowAttention {
  const at::Tensor& cos;
  const at::Tensor& sin;
  const at::Tensor& slot_mapping;
  const at::Tensor& block_tables;
  const at::Tensor& context_lens;
  const at::Tensor& rows;
};

// One layer's own tensors and numbers.
struct RowLayer {
  const at::Tensor& input_norm;
  const at::Tensor& pre_mlp_norm;
  double eps;
  at::TensorList qkv_blocks, o_blocks, gate_up_blocks, down_blocks;
  at::IntArrayRef qkv_kinds, o_kinds, gate_up_kinds, down_kinds;
  int64_t num_heads, num_kv_heads, head_dim;
  const at::Tensor& k_cache;
  const at::Tensor& v_cache;
  double scale;
  int64_t sliding_window;
  double softcap;
};

// A whole Llama decoder layer (worker/models/decoder.py's DecoderLayer.forward
// with native ops and the Llama MLP) for ONE token whose projections are GGUF
// blocks on int8 activations: the same ops, in the same order, on the same
// tensors, so the same bits, in one call from Python instead of ~15 (each a
// few microseconds of Python and dispatch: ~4 ms of a 30-layer decode step).
at::Tensor llama_layer_row(const at::Tensor& hidden, const RowLayer& layer,
                           const RowAttention& step) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.size(0) == 1,
              "ggml_llama_layer_row: hidden must be [1, hidden_size]");
  static const Op rms_norm("kvmesh::rms_norm"), add_rms_norm("kvmesh::add_rms_norm"),
      rotary("kvmesh::rotary_embedding"), write_kv("kvmesh::write_kv_cache"),
      attention("kvmesh::paged_decode_attention"), silu_and_mul("kvmesh::silu_and_mul");
  const int64_t num_heads = layer.num_heads, num_kv_heads = layer.num_kv_heads;
  const int64_t head_dim = layer.head_dim;
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  torch::jit::Stack stack;
  stack = {hidden.contiguous(), layer.input_norm, layer.eps};
  rms_norm(stack);
  const at::Tensor qkv = ggml_linear_q8_row(stack[0].toTensor(), layer.qkv_blocks, layer.qkv_kinds);
  // Query and key heads rotate together (one op), as the layer does.
  stack = {qkv.narrow(1, 0, q_size + kv_size).view({1, num_heads + num_kv_heads, head_dim}),
           step.cos, step.sin};
  rotary(stack);
  const at::Tensor query_key = stack[0].toTensor();
  const at::Tensor query = query_key.narrow(1, 0, num_heads);
  const at::Tensor key = query_key.narrow(1, num_heads, num_kv_heads);
  const at::Tensor value = qkv.narrow(1, q_size + kv_size, kv_size).view({1, num_kv_heads, head_dim});
  stack = {key, value, layer.k_cache, layer.v_cache, step.slot_mapping};
  write_kv(stack);
  const at::Tensor attn = at::empty({1, num_heads, head_dim}, query.options());
  stack = {attn,         query,         layer.k_cache,        layer.v_cache,
           step.block_tables, step.context_lens, step.rows,  layer.scale,
           int64_t{0},   layer.sliding_window, layer.softcap};
  attention(stack);
  const at::Tensor attn_out = ggml_linear_q8_row(attn.view({1, q_size}), layer.o_blocks, layer.o_kinds);
  stack = {attn_out, hidden, layer.pre_mlp_norm, layer.eps};
  add_rms_norm(stack);
  const at::Tensor normed = stack[0].toTensor(), residual = stack[1].toTensor();
  stack = {ggml_linear_q8_row(normed, layer.gate_up_blocks, layer.gate_up_kinds)};
  silu_and_mul(stack);
  const at::Tensor down = ggml_linear_q8_row(stack[0].toTensor(), layer.down_blocks, layer.down_kinds);
  return at::add(residual, down);
}

at::Tensor ggml_llama_layer_row(
    const at::Tensor& hidden, const at::Tensor& input_norm, const at::Tensor& pre_mlp_norm,
    double eps, at::TensorList qkv_blocks, at::IntArrayRef qkv_kinds, at::TensorList o_blocks,
    at::IntArrayRef o_kinds, at::TensorList gate_up_blocks, at::IntArrayRef gate_up_kinds,
    at::TensorList down_blocks, at::IntArrayRef down_kinds, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& context_lens, const at::Tensor& rows,
    double scale, int64_t sliding_window, double softcap) {
  const RowLayer layer{input_norm,     pre_mlp_norm, eps,          qkv_blocks, o_blocks,
                       gate_up_blocks, down_blocks,  qkv_kinds,    o_kinds,    gate_up_kinds,
                       down_kinds,     num_heads,    num_kv_heads, head_dim,   k_cache,
                       v_cache,        scale,        sliding_window, softcap};
  return llama_layer_row(hidden, layer, {cos, sin, slot_mapping, block_tables, context_lens, rows});
}

// Every layer of a model, one after the other, each as ggml_llama_layer_row:
// the same calls on the same tensors (so the same bits), one call from Python
// per decode step instead of one per layer (each ~25 us of argument parsing
// for its ~25 arguments: ~0.8 ms of a 30-layer step on this Zen 2). Layer i's
// tensors: norms[2i], norms[2i + 1]; its four projections' block tensors
// (qkv, o, gate_up, down), the next segments[4i..4i + 3] of blocks and kinds;
// rotary tables cos/sin[rope_index[i]]; caches kv_caches[2i] (K), [2i + 1] (V).
at::Tensor ggml_llama_layers_row(
    const at::Tensor& hidden, at::TensorList norms, double eps, at::TensorList blocks,
    at::IntArrayRef kinds, at::IntArrayRef segments, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, at::TensorList cos, at::TensorList sin, at::IntArrayRef rope_index,
    at::TensorList kv_caches, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& context_lens, const at::Tensor& rows, double scale,
    at::IntArrayRef sliding_windows, double softcap) {
  const int64_t layers = static_cast<int64_t>(rope_index.size());
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == 2 * layers &&
                  static_cast<int64_t>(segments.size()) == 4 * layers &&
                  static_cast<int64_t>(kv_caches.size()) == 2 * layers &&
                  static_cast<int64_t>(sliding_windows.size()) == layers,
              "ggml_llama_layers_row: per layer 2 norms, 4 projections, 2 caches, 1 window");
  TORCH_CHECK(blocks.size() == kinds.size(), "ggml_llama_layers_row: one ggml type per block tensor");
  TORCH_CHECK(cos.size() == sin.size(), "ggml_llama_layers_row: one sin table per cos table");
  int64_t total = 0;
  for (const int64_t count : segments) {
    TORCH_CHECK(count > 0, "ggml_llama_layers_row: a projection without blocks");
    total += count;
  }
  TORCH_CHECK(total == static_cast<int64_t>(blocks.size()),
              "ggml_llama_layers_row: segments count ", total, " block tensors, got ", blocks.size());
  at::Tensor h = hidden;
  int64_t next = 0;
  // Projection p of the current layer: the next segments[4i + p] block tensors.
  const auto take = [&](int64_t count, at::TensorList& list, at::IntArrayRef& types) {
    list = blocks.slice(next, count);
    types = kinds.slice(next, count);
    next += count;
  };
  for (int64_t i = 0; i < layers; ++i) {
    const int64_t rope = rope_index[i];
    TORCH_CHECK(rope >= 0 && rope < static_cast<int64_t>(cos.size()),
                "ggml_llama_layers_row: layer ", i, " rotary table ", rope, " out of range");
    at::TensorList qkv, o, gate_up, down;
    at::IntArrayRef qkv_kinds, o_kinds, gate_up_kinds, down_kinds;
    take(segments[4 * i], qkv, qkv_kinds);
    take(segments[4 * i + 1], o, o_kinds);
    take(segments[4 * i + 2], gate_up, gate_up_kinds);
    take(segments[4 * i + 3], down, down_kinds);
    const RowLayer layer{norms[2 * i],      norms[2 * i + 1], eps,       qkv,        o,
                         gate_up,           down,             qkv_kinds, o_kinds,    gate_up_kinds,
                         down_kinds,        num_heads,        num_kv_heads, head_dim, kv_caches[2 * i],
                         kv_caches[2 * i + 1], scale,         sliding_windows[i], softcap};
    h = llama_layer_row(h, layer, {cos[rope], sin[rope], slot_mapping, block_tables, context_lens, rows});
  }
  return h;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("ggml_linear_q8_row(Tensor x, Tensor[] blocks, int[] kinds) -> Tensor");
  m.def(
      "ggml_llama_layer_row(Tensor hidden, Tensor input_norm, Tensor pre_mlp_norm, float eps, "
      "Tensor[] qkv_blocks, int[] qkv_kinds, Tensor[] o_blocks, int[] o_kinds, "
      "Tensor[] gate_up_blocks, int[] gate_up_kinds, Tensor[] down_blocks, int[] down_kinds, "
      "int num_heads, int num_kv_heads, int head_dim, Tensor cos, Tensor sin, "
      "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, Tensor block_tables, "
      "Tensor context_lens, Tensor rows, float scale, int sliding_window, float softcap) -> Tensor");
  m.def(
      "ggml_llama_layers_row(Tensor hidden, Tensor[] norms, float eps, Tensor[] blocks, "
      "int[] kinds, int[] segments, int num_heads, int num_kv_heads, int head_dim, "
      "Tensor[] cos, Tensor[] sin, int[] rope_index, Tensor(a!)[] kv_caches, "
      "Tensor slot_mapping, Tensor block_tables, Tensor context_lens, Tensor rows, "
      "float scale, int[] sliding_windows, float softcap) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) {
  m.impl("ggml_linear_q8_row", &ggml_linear_q8_row);
  m.impl("ggml_llama_layer_row", &ggml_llama_layer_row);
  m.impl("ggml_llama_layers_row", &ggml_llama_layers_row);
}
