// y = x Wᵀ with W kept as a GGUF file's own blocks (as ggml_block_linear.cpp)
// and x quantized to int8 on the way in: llama.cpp's own trick for its CPU
// decode (its q8_0 / q8_K activations), behind --quantization w8a8.
//
// Why: a batch-1 decode step reads each weight byte once, so it should run at
// memory bandwidth; the float kernel rebuilds every weight to float32 first
// (a handful of instructions per weight) and is bound by that arithmetic
// instead. Here every 32 weights of a block are unpacked to 32 unsigned bytes
// in one register (nibbles, a fifth or sixth bit) and multiplied with 32 int8
// activations by one maddubs (u8 x s8 -> pairwise int16 sums) and one madd
// (-> eight int32 sums): the weight bytes are touched once, as integers.
//
// The math: x is quantized per 32 features (one block of it per 32 weights,
// whatever the weight type): scale dx = max|x| / 127, codes
// q = round(x * (127 / max|x|)) (ties to even), as kernels/int8_reference.py
// quantizes per token. Every GGUF type's weight is w = a * c + b over a run
// of 16 or 32 weights, c an unsigned code and (a, b) that run's factors:
//   Q4_0 / Q5_0: c = the 4 / 5-bit code, a = d, b = -8 d / -16 d;
//   Q4_1 / Q5_1: a = d, b = m;  Q8_0: c signed (int8), a = d, b = 0;
//   Q4_K / Q5_K: per 32-weight sub-block a = d * sc, b = -(dmin * m);
//   Q6_K: per 16-weight sub-block a = d * sc, b = -32 a.
// So a run contributes dx * (a * sum(c q) + b * sum(q)): sum(c q) is the exact
// integer dot product and sum(q) is computed once per x block.
// kernels/ggml_q8_reference.py computes the same in float64 from the
// gguf package's dequantized weights; only float32 roundings separate them.
//
// Threads split the output rows (kvmesh::parallel_items); each row's blocks
// are unpacked once per call and dotted with every row of x (a decode batch).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define KVMESH_Q8_AVX2 1
#endif
#include "ggml_blocks.h"
#include "ggml_codes_avx2.h"
#include "work_stealing.h"

namespace {

using namespace kvmesh::ggml;

constexpr int64_t kRun = 32;  // activation block: weights per x scale

// x [M, K] per 32 features: int8 codes, the block's scale, and the code sums
// of each half block (16 features: Q6_K's sub-blocks).
struct QuantizedX {
  std::vector<int8_t> codes;    // [M, K]
  std::vector<float> scale;     // [M, K / 32]
  std::vector<int32_t> sums16;  // [M, K / 16]
};

void quantize_x(const float* x, int64_t M, int64_t K, QuantizedX& out) {
  out.codes.resize(M * K);
  out.scale.resize(M * K / kRun);
  out.sums16.resize(M * K / 16);
  for (int64_t b = 0; b < M * K / kRun; ++b) {
    const float* xb = x + b * kRun;
    float amax = 0.0f;
    for (int l = 0; l < kRun; ++l) amax = std::max(amax, std::fabs(xb[l]));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    out.scale[b] = amax / 127.0f;
    int8_t* q = out.codes.data() + b * kRun;
    int32_t sums[2] = {0, 0};
    for (int l = 0; l < kRun; ++l) {
      // nearbyint: the current rounding mode, ties to even (torch.round's).
      const float v = std::min(127.0f, std::max(-127.0f, std::nearbyint(xb[l] * inv)));
      q[l] = static_cast<int8_t>(v);
      sums[l / 16] += q[l];
    }
    out.sums16[2 * b] = sums[0];
    out.sums16[2 * b + 1] = sums[1];
  }
}

// The factors (a, b) of each 16-weight half run of one block: run r of 32
// weights uses a[2r], b[2r] (first 16) and a[2r + 1], b[2r + 1].
struct Factors {
  float a[16];
  float b[16];
};

template <int64_t kind>
inline void block_factors(const uint8_t* blk, Factors& f) {
  if constexpr (kind == kQ4_0 || kind == kQ5_0 || kind == kQ4_1 || kind == kQ5_1 ||
                kind == kQ8_0) {
    {
      const float d = half_at(blk);
      float b = 0.0f;
      if (kind == kQ4_0) b = -8.0f * d;
      if (kind == kQ5_0) b = -16.0f * d;
      if (kind == kQ4_1 || kind == kQ5_1) b = half_at(blk + 2);
      f.a[0] = f.a[1] = d;
      f.b[0] = f.b[1] = b;
    }
  } else if constexpr (kind == kQ4_K || kind == kQ5_K) {
    {
      const float d = half_at(blk), dmin = half_at(blk + 2);
      const uint8_t* q = blk + 4;  // 12 bytes of 6-bit scales and minimums
      for (int j = 0; j < 8; ++j) {
        uint8_t sc, m;
        scale_min_k4(j, q, sc, m);
        // Rounded as the dequantization rounds them (d * sc, dmin * m).
        f.a[2 * j] = f.a[2 * j + 1] = d * static_cast<float>(sc);
        f.b[2 * j] = f.b[2 * j + 1] = -(dmin * static_cast<float>(m));
      }
    }
  } else {
    static_assert(kind == kQ6_K);
    const float d = half_at(blk + 208);
    const auto* sc = reinterpret_cast<const int8_t*>(blk + 192);
    for (int i = 0; i < 16; ++i) {
      f.a[i] = d * static_cast<float>(sc[i]);
      f.b[i] = -32.0f * f.a[i];
    }
  }
}


// y[m, n] for one weight row (its blocks `row`) and rows m0 .. m0 + MB of x:
// MB accumulators stay in registers, the row's codes are unpacked once per
// MB rows of x.
template <int64_t kind, int MB>
void dot_row(const uint8_t* row, const QuantizedX& qx, int64_t m0, int64_t K, float* y,
             int64_t ldy) {
  constexpr Format f = block_format(kind);
  constexpr int runs = f.weights / kRun;
  const int64_t blocks = K / f.weights, x_runs = K / kRun;
  const int8_t* codes = qx.codes.data() + m0 * K;
  const float* scale = qx.scale.data() + m0 * x_runs;
  const int32_t* sums16 = qx.sums16.data() + 2 * m0 * x_runs;
  Factors fac;
  float bias[MB] = {};
#if KVMESH_Q8_AVX2
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = row + b * f.bytes;
    block_factors<kind>(blk, fac);
    for (int r = 0; r < runs; ++r) {
      const __m256i c = run_codes_avx2<kind>(blk, r);
      const __m256i c_abs = kind == kQ8_0 ? _mm256_sign_epi8(c, c) : c;
      const int64_t xr = b * runs + r;
      for (int m = 0; m < MB; ++m) {
        __m256i xq = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(codes + m * K + xr * kRun));
        // maddubs takes an unsigned left operand: int8 weights lend x their sign.
        if constexpr (kind == kQ8_0) xq = _mm256_sign_epi8(xq, c);
        const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(c_abs, xq), ones);
        const float dx = scale[m * x_runs + xr];
        const int32_t* s16 = sums16 + 2 * (m * x_runs + xr);
        if constexpr (runs == 8 && kind != kQ6_K) {
          // One factor for all 32 weights (K-quant sub-blocks of 32).
          acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(fac.a[2 * r] * dx), _mm256_cvtepi32_ps(sums),
                                   acc[m]);
          bias[m] += dx * fac.b[2 * r] * static_cast<float>(s16[0] + s16[1]);
        } else if constexpr (kind == kQ6_K) {
          // Lanes 0-3 hold the first 16 weights' sums, lanes 4-7 the last 16's.
          const __m256 a = _mm256_set_m128(_mm_set1_ps(fac.a[2 * r + 1] * dx),
                                           _mm_set1_ps(fac.a[2 * r] * dx));
          acc[m] = _mm256_fmadd_ps(a, _mm256_cvtepi32_ps(sums), acc[m]);
          bias[m] += dx * (fac.b[2 * r] * static_cast<float>(s16[0]) +
                           fac.b[2 * r + 1] * static_cast<float>(s16[1]));
        } else {
          acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(fac.a[0] * dx), _mm256_cvtepi32_ps(sums),
                                   acc[m]);
          bias[m] += dx * fac.b[0] * static_cast<float>(s16[0] + s16[1]);
        }
      }
    }
  }
  for (int m = 0; m < MB; ++m) y[m * ldy] = hsum(acc[m]) + bias[m];
#else
  float acc[MB] = {};
  int16_t c[32];
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = row + b * f.bytes;
    block_factors<kind>(blk, fac);
    for (int r = 0; r < runs; ++r) {
      run_codes<kind>(blk, r, c);
      const int64_t xr = b * runs + r;
      for (int m = 0; m < MB; ++m) {
        const int8_t* xq = codes + m * K + xr * kRun;
        int32_t dots[2] = {0, 0};
        for (int l = 0; l < 32; ++l) dots[l / 16] += c[l] * xq[l];
        const int32_t* s16 = sums16 + 2 * (m * x_runs + xr);
        const float dx = scale[m * x_runs + xr];
        acc[m] += dx * (fac.a[2 * r] * static_cast<float>(dots[0]) +
                        fac.a[2 * r + 1] * static_cast<float>(dots[1]));
        bias[m] += dx * (fac.b[2 * r] * static_cast<float>(s16[0]) +
                         fac.b[2 * r + 1] * static_cast<float>(s16[1]));
      }
    }
  }
  for (int m = 0; m < MB; ++m) y[m * ldy] = acc[m] + bias[m];
#endif
}

// Rows [r0, r1) of one segment of type `kind` ([rows, row_bytes] blocks), every row of x.
template <int64_t kind>
void dot_rows(const uint8_t* base, int64_t row_bytes, int64_t rows, int64_t r0, int64_t r1,
              const QuantizedX& qx, int64_t M, int64_t K, float* y, int64_t ldy) {
  constexpr int kMaxBatch = 4;  // rows of x per pass over a weight row
  for (int64_t r = r0; r < r1; ++r) {
    prefetch_row_ahead(base, row_bytes, r, rows);
    const uint8_t* row = base + r * row_bytes;
    for (int64_t m0 = 0; m0 < M; m0 += kMaxBatch) {
      float* out = y + m0 * ldy + r;
      switch (std::min<int64_t>(kMaxBatch, M - m0)) {
        case 1: dot_row<kind, 1>(row, qx, m0, K, out, ldy); break;
        case 2: dot_row<kind, 2>(row, qx, m0, K, out, ldy); break;
        case 3: dot_row<kind, 3>(row, qx, m0, K, out, ldy); break;
        default: dot_row<kind, 4>(row, qx, m0, K, out, ldy); break;
      }
    }
  }
}

constexpr int64_t kRowsPerItem = 8;  // output rows per work item

at::Tensor ggml_linear_q8(const at::Tensor& x, at::TensorList blocks, at::IntArrayRef kinds) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "ggml_linear_q8: x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(blocks.size() == kinds.size() && !blocks.empty(),
              "ggml_linear_q8: one ggml type per block tensor");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kRun == 0, "ggml_linear_q8: K ", K, " is not a multiple of ", kRun);
  for (size_t s = 0; s < blocks.size(); ++s) {
    check_segment(blocks[s], kinds[s], K, "ggml_linear_q8");
  }
  const SegmentItems items(blocks, kRowsPerItem);
  const int64_t N = items.rows();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  QuantizedX qx;
  quantize_x(x.data_ptr<float>(), M, K, qx);
  float* yp = y.data_ptr<float>();
  kvmesh::parallel_items(items.items(), [&](int64_t i, bool /*forward*/) {
    const SegmentItems::Item item = items.item(i);
    const size_t s = item.segment;
    const Format f = block_format(kinds[s]);
    const int64_t r0 = item.row0, r1 = item.row0 + item.rows;
    const int64_t row_bytes = K / f.weights * f.bytes;
    const uint8_t* base = blocks[s].data_ptr<uint8_t>();
    const int64_t rows = blocks[s].size(0);
    float* out = yp + items.first_row(s);
    switch (kinds[s]) {
      case kQ4_0: dot_rows<kQ4_0>(base, row_bytes, rows, r0, r1, qx, M, K, out, N); break;
      case kQ4_1: dot_rows<kQ4_1>(base, row_bytes, rows, r0, r1, qx, M, K, out, N); break;
      case kQ5_0: dot_rows<kQ5_0>(base, row_bytes, rows, r0, r1, qx, M, K, out, N); break;
      case kQ5_1: dot_rows<kQ5_1>(base, row_bytes, rows, r0, r1, qx, M, K, out, N); break;
      case kQ8_0: dot_rows<kQ8_0>(base, row_bytes, rows, r0, r1, qx, M, K, out, N); break;
      case kQ4_K: dot_rows<kQ4_K>(base, row_bytes, rows, r0, r1, qx, M, K, out, N); break;
      case kQ5_K: dot_rows<kQ5_K>(base, row_bytes, rows, r0, r1, qx, M, K, out, N); break;
      case kQ6_K: dot_rows<kQ6_K>(base, row_bytes, rows, r0, r1, qx, M, K, out, N); break;
      default: TORCH_CHECK(false, "ggml_linear_q8: unsupported ggml type ", kinds[s]);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("ggml_linear_q8(Tensor x, Tensor[] blocks, int[] kinds) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("ggml_linear_q8", &ggml_linear_q8); }
