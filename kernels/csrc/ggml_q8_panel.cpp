// y = x Wᵀ for decode batches of 2 rows and more, W a GGUF file's own blocks
// and x quantized to int8 per 32 features: ggml_q8_linear.cpp's arithmetic
// (and kernels/ggml_q8_reference.py's), organised for many rows of x.
//
// Why: ggml_q8_linear.cpp unpacks a weight row's codes in registers and can
// keep only 4 rows of x in flight there, so it unpacks every code again for
// each 4 rows of x, and applies each run's factors with scalar float work
// per row of x. Past 4 rows it was no faster than rebuilding float weights.
// Here a tile of weight rows is unpacked once per call into a panel that stays
// in L1 (a byte per weight, plus each run's factors), and every row of x is
// dotted against it from there, 4 rows of x by 2 weight rows in registers.
//
// The math, per run r of 32 weights of weight row n and row m of x:
//   the weight is w = d * (s * c) + b, c its unsigned code (Q8_0: signed),
//   s an integer sub-block scale (K-quants: 6-bit sc for Q4_K / Q5_K, one
//   int8 per 16 weights for Q6_K; 1 for the legacy types), d the float16
//   (super-)block scale and b a float offset per 16 weights (-dmin * m,
//   -32 d sc, -8 d, -16 d, the Q4_1 / Q5_1 minimum, 0 for Q8_0);
//   x's run is dx * q, q its int8 codes, dx its scale.
// so y[m, n] = Σ_r (d dx) * Σ_l s c q  +  Σ_h b_h * (dx Σ_{l in h} q).
// The first sum is integer up to its run: maddubs (u8 x s8 -> int16 pairs),
// then madd against s (int16 -> int32, the sub-block scale applied exactly),
// one int32 -> float32 conversion and one fused multiply-add by d * dx per
// run. d * sc is an exact float32 product (11 x 8 bits), so applying sc in
// integer or in float gives the same real number: only float32 roundings
// separate this from the reference, as they do ggml_q8_linear.cpp. The
// offset term is a float dot product of length K / 16 per (m, n), with
// dx * Σ q computed once per row of x.
//
// Threads take tiles of kTileRows weight rows (kvmesh::parallel_items: a
// thread that finishes early takes tiles from the others).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVMESH_PANEL_AVX2 1
#endif
#include "ggml_blocks.h"
#include "ggml_codes_avx2.h"
#include "work_stealing.h"

namespace {

using namespace kvmesh::ggml;

constexpr int64_t kRun = 32;       // weights per activation scale
constexpr int64_t kTileRows = 8;   // weight rows per panel (and per work item)
constexpr int kXRows = 4;          // rows of x per register tile
constexpr int kWRows = 2;          // weight rows per register tile

// Offsets are per 16 weights; their arrays are padded to whole 8-float vectors.
inline int64_t padded_halves(int64_t K) { return (K / 16 + 7) / 8 * 8; }

// x [M, K] quantized per 32 features as kernels/ggml_q8_reference.py does.
struct QuantizedRows {
  std::vector<int8_t> codes;      // [M, K]
  std::vector<float> scale;       // [M, K / 32]: dx
  std::vector<float> half_sums;   // [M, padded_halves]: dx * Σ q over each 16
};

void quantize_rows(const float* x, int64_t M, int64_t K, QuantizedRows& out) {
  const int64_t runs = K / kRun, halves = padded_halves(K);
  out.codes.resize(M * K);
  out.scale.resize(M * runs);
  out.half_sums.assign(M * halves, 0.0f);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t r = 0; r < runs; ++r) {
      const float* xr = x + m * K + r * kRun;
      float amax = 0.0f;
      for (int l = 0; l < kRun; ++l) amax = std::max(amax, std::fabs(xr[l]));
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      const float dx = amax / 127.0f;
      int8_t* q = out.codes.data() + m * K + r * kRun;
      int32_t sums[2] = {0, 0};
      for (int l = 0; l < kRun; ++l) {
        // nearbyint: the current rounding mode, ties to even (torch.round's).
        const float v = std::min(127.0f, std::max(-127.0f, std::nearbyint(xr[l] * inv)));
        q[l] = static_cast<int8_t>(v);
        sums[l / 16] += q[l];
      }
      out.scale[m * runs + r] = dx;
      out.half_sums[m * halves + 2 * r] = dx * static_cast<float>(sums[0]);
      out.half_sums[m * halves + 2 * r + 1] = dx * static_cast<float>(sums[1]);
    }
  }
}

// kTileRows weight rows unpacked: codes a byte per weight, factors per run.
struct Panel {
  std::vector<uint8_t> codes;   // [rows, K]: unsigned codes (Q8_0: |c|)
  std::vector<int8_t> signs;    // [rows, K]: Q8_0's signed codes (their signs)
  std::vector<int16_t> scales;  // [rows, K / 32, 16]: s per int16 pair sum (K-quants)
  std::vector<float> d;         // [rows, K / 32]
  std::vector<float> offset;    // [rows, padded_halves]: b per 16 weights

  void reserve(int64_t K) {
    codes.resize(kTileRows * K);
    signs.resize(kTileRows * K);
    scales.resize(kTileRows * K / 2);
    d.resize(kTileRows * K / kRun);
    offset.assign(kTileRows * padded_halves(K), 0.0f);
  }
};

// Codes of run r of a block into `out` (32 bytes; Q8_0 also its signs).
template <int64_t kind>
inline void put_codes(const uint8_t* blk, int r, uint8_t* out, int8_t* signs) {
#if KVMESH_PANEL_AVX2
  const __m256i c = run_codes_avx2<kind>(blk, r);
  if constexpr (kind == kQ8_0) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(signs), c);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_sign_epi8(c, c));
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), c);
  }
#else
  int16_t c[32];
  run_codes<kind>(blk, r, c);
  for (int l = 0; l < 32; ++l) {
    out[l] = static_cast<uint8_t>(kind == kQ8_0 ? std::abs(c[l]) : c[l]);
    if constexpr (kind == kQ8_0) signs[l] = static_cast<int8_t>(c[l]);
  }
#endif
}

// Weight row `row` (its blocks) into panel row t.
template <int64_t kind>
void unpack_row(const uint8_t* row, int64_t K, Panel& p, int64_t t) {
  constexpr Format f = block_format(kind);
  const int64_t runs = K / kRun, halves = padded_halves(K);
  uint8_t* codes = p.codes.data() + t * K;
  int8_t* signs = p.signs.data() + t * K;
  int16_t* scales = p.scales.data() + t * runs * 16;
  float* d = p.d.data() + t * runs;
  float* offset = p.offset.data() + t * halves;
  // The padding past K / 16 multiplies x's zero padding: keep it finite (zero).
  std::fill(offset + K / 16, offset + halves, 0.0f);
  for (int64_t b = 0; b < K / f.weights; ++b) {
    const uint8_t* blk = row + b * f.bytes;
    if constexpr (f.weights == 32) {
      put_codes<kind>(blk, 0, codes + b * kRun, signs + b * kRun);
      const float db = half_at(blk);
      float off = 0.0f;
      if (kind == kQ4_0) off = -8.0f * db;
      if (kind == kQ5_0) off = -16.0f * db;
      if (kind == kQ4_1 || kind == kQ5_1) off = half_at(blk + 2);
      d[b] = db;
      offset[2 * b] = offset[2 * b + 1] = off;
    } else {
      // The super-block's factors first: the stores below may alias blk for
      // all the compiler knows, so nothing is read from it twice.
      const float dq = half_at(blk + (kind == kQ6_K ? 208 : 0));
      float sub_offset[16];
      int16_t sub_scale[16];
      if constexpr (kind == kQ6_K) {
        const auto* sc = reinterpret_cast<const int8_t*>(blk + 192);
        for (int i = 0; i < 16; ++i) {
          sub_scale[i] = sc[i];
          // w = (d sc) (c - 32): the -32 as an offset, rounded as the reference's d * sc.
          sub_offset[i] = -32.0f * (dq * static_cast<float>(sc[i]));
        }
      } else {
        const float dmin = half_at(blk + 2);
        for (int j = 0; j < 8; ++j) {
          uint8_t sc, m;
          scale_min_k4(j, blk + 4, sc, m);
          sub_scale[2 * j] = sub_scale[2 * j + 1] = sc;
          sub_offset[2 * j] = sub_offset[2 * j + 1] = -(dmin * static_cast<float>(m));
        }
      }
      for (int j = 0; j < 8; ++j) {
        const int64_t r = 8 * b + j;
        put_codes<kind>(blk, j, codes + r * kRun, signs + r * kRun);
        int16_t* s = scales + r * 16;
        for (int l = 0; l < 8; ++l) s[l] = sub_scale[2 * j];
        for (int l = 8; l < 16; ++l) s[l] = sub_scale[2 * j + 1];
        d[r] = dq;
        offset[2 * r] = sub_offset[2 * j];
        offset[2 * r + 1] = sub_offset[2 * j + 1];
      }
    }
  }
}

// How a kind's codes multiply: signed codes (Q8_0) and integer sub-block
// scales (K-quants).
constexpr bool is_signed(int64_t kind) { return kind == kQ8_0; }
constexpr bool has_scales(int64_t kind) {
  return kind == kQ4_K || kind == kQ5_K || kind == kQ6_K;
}

#if KVMESH_PANEL_AVX2
inline float hsum8(__m256 v) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}
#endif

// y[m0 + m, t0 + n] for MR rows of x and NR panel rows. `dd` is scratch for
// the products d * dx, [MR, NR, runs].
template <bool kSigned, bool kScaled, int MR, int NR>
void tile(const QuantizedRows& qx, const Panel& p, int64_t m0, int64_t t0, int64_t K, float* y,
          int64_t ldy, float* dd) {
  const int64_t runs = K / kRun, halves = padded_halves(K);
  for (int m = 0; m < MR; ++m) {
    const float* dx = qx.scale.data() + (m0 + m) * runs;
    for (int n = 0; n < NR; ++n) {
      const float* d = p.d.data() + (t0 + n) * runs;
      float* out = dd + (m * NR + n) * runs;
      for (int64_t r = 0; r < runs; ++r) out[r] = d[r] * dx[r];
    }
  }
  const int8_t* xq = qx.codes.data() + m0 * K;
  const uint8_t* codes = p.codes.data() + t0 * K;
  const int8_t* signs = p.signs.data() + t0 * K;
  const int16_t* scales = p.scales.data() + t0 * runs * 16;
#if KVMESH_PANEL_AVX2
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; ++m) {
    for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_setzero_ps();
  }
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t r = 0; r < runs; ++r) {
    __m256i c[NR], s[NR], sc[NR];
    for (int n = 0; n < NR; ++n) {
      c[n] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + n * K + r * kRun));
      if constexpr (kSigned) {
        s[n] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(signs + n * K + r * kRun));
      }
      sc[n] = kScaled ? _mm256_loadu_si256(
                            reinterpret_cast<const __m256i*>(scales + (n * runs + r) * 16))
                      : ones;
    }
    for (int m = 0; m < MR; ++m) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * K + r * kRun));
      for (int n = 0; n < NR; ++n) {
        // maddubs takes an unsigned left operand: Q8_0's signs move onto x.
        const __m256i xs = kSigned ? _mm256_sign_epi8(x, s[n]) : x;
        const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(c[n], xs), sc[n]);
        acc[m][n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums),
                                    _mm256_broadcast_ss(dd + (m * NR + n) * runs + r), acc[m][n]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    const float* hs = qx.half_sums.data() + (m0 + m) * halves;
    for (int n = 0; n < NR; ++n) {
      const float* off = p.offset.data() + (t0 + n) * halves;
      __m256 a = acc[m][n];
      for (int64_t h = 0; h < halves; h += 8) {
        a = _mm256_fmadd_ps(_mm256_loadu_ps(off + h), _mm256_loadu_ps(hs + h), a);
      }
      y[(m0 + m) * ldy + t0 + n] = hsum8(a);
    }
  }
#else
  for (int m = 0; m < MR; ++m) {
    const float* hs = qx.half_sums.data() + (m0 + m) * halves;
    for (int n = 0; n < NR; ++n) {
      float acc = 0.0f;
      for (int64_t r = 0; r < runs; ++r) {
        int32_t sum = 0;
        for (int l = 0; l < kRun; ++l) {
          const int32_t c = kSigned ? signs[n * K + r * kRun + l] : codes[n * K + r * kRun + l];
          const int32_t s = kScaled ? scales[(n * runs + r) * 16 + l / 2] : 1;
          sum += s * c * xq[m * K + r * kRun + l];
        }
        acc += dd[(m * NR + n) * runs + r] * static_cast<float>(sum);
      }
      const float* off = p.offset.data() + (t0 + n) * halves;
      for (int64_t h = 0; h < halves; ++h) acc += off[h] * hs[h];
      y[(m0 + m) * ldy + t0 + n] = acc;
    }
  }
#endif
}

// Every row of x against panel rows [0, rows): register tiles, then the tails.
template <int64_t kind>
void panel_times_x(const QuantizedRows& qx, const Panel& p, int64_t rows, int64_t M, int64_t K,
                   float* y, int64_t ldy, float* dd) {
  constexpr bool kS = is_signed(kind), kC = has_scales(kind);
  for (int64_t m0 = 0; m0 < M; m0 += kXRows) {
    const int64_t mr = std::min<int64_t>(kXRows, M - m0);
    for (int64_t t0 = 0; t0 < rows; t0 += kWRows) {
      const bool two = rows - t0 >= 2;
      switch (mr * 2 + (two ? 1 : 0)) {
        case 2: tile<kS, kC, 1, 1>(qx, p, m0, t0, K, y, ldy, dd); break;
        case 3: tile<kS, kC, 1, 2>(qx, p, m0, t0, K, y, ldy, dd); break;
        case 4: tile<kS, kC, 2, 1>(qx, p, m0, t0, K, y, ldy, dd); break;
        case 5: tile<kS, kC, 2, 2>(qx, p, m0, t0, K, y, ldy, dd); break;
        case 6: tile<kS, kC, 3, 1>(qx, p, m0, t0, K, y, ldy, dd); break;
        case 7: tile<kS, kC, 3, 2>(qx, p, m0, t0, K, y, ldy, dd); break;
        case 8: tile<kS, kC, 4, 1>(qx, p, m0, t0, K, y, ldy, dd); break;
        default: tile<kS, kC, 4, 2>(qx, p, m0, t0, K, y, ldy, dd); break;
      }
    }
  }
}

template <int64_t kind>
void tile_rows(const uint8_t* base, int64_t row_bytes, int64_t r0, int64_t rows,
               const QuantizedRows& qx, int64_t M, int64_t K, float* y, int64_t ldy) {
  // thread_local: one allocation per thread and K, reused by every call.
  thread_local Panel panel;
  thread_local std::vector<float> dd;
  if (static_cast<int64_t>(panel.codes.size()) < kTileRows * K) panel.reserve(K);
  if (static_cast<int64_t>(dd.size()) < kXRows * kWRows * K / kRun) {
    dd.resize(kXRows * kWRows * K / kRun);
  }
  for (int64_t t = 0; t < rows; ++t) unpack_row<kind>(base + (r0 + t) * row_bytes, K, panel, t);
  panel_times_x<kind>(qx, panel, rows, M, K, y + r0, ldy, dd.data());
}

at::Tensor ggml_linear_q8_panel(const at::Tensor& x, at::TensorList blocks,
                                at::IntArrayRef kinds) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "ggml_linear_q8_panel: x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(blocks.size() == kinds.size() && !blocks.empty(),
              "ggml_linear_q8_panel: one ggml type per block tensor");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kRun == 0, "ggml_linear_q8_panel: K ", K, " is not a multiple of ", kRun);
  for (size_t s = 0; s < blocks.size(); ++s) {
    check_segment(blocks[s], kinds[s], K, "ggml_linear_q8_panel");
  }
  const SegmentItems items(blocks, kTileRows);
  const int64_t N = items.rows();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  QuantizedRows qx;
  quantize_rows(x.data_ptr<float>(), M, K, qx);
  float* yp = y.data_ptr<float>();
  kvmesh::parallel_items(items.items(), [&](int64_t i, bool /*forward*/) {
    const SegmentItems::Item item = items.item(i);
    const size_t s = item.segment;
    const int64_t row_bytes = K / block_format(kinds[s]).weights * block_format(kinds[s]).bytes;
    const uint8_t* base = blocks[s].data_ptr<uint8_t>();
    float* out = yp + items.first_row(s);
    const int64_t r0 = item.row0, rows = item.rows;
    switch (kinds[s]) {
      case kQ4_0: tile_rows<kQ4_0>(base, row_bytes, r0, rows, qx, M, K, out, N); break;
      case kQ4_1: tile_rows<kQ4_1>(base, row_bytes, r0, rows, qx, M, K, out, N); break;
      case kQ5_0: tile_rows<kQ5_0>(base, row_bytes, r0, rows, qx, M, K, out, N); break;
      case kQ5_1: tile_rows<kQ5_1>(base, row_bytes, r0, rows, qx, M, K, out, N); break;
      case kQ8_0: tile_rows<kQ8_0>(base, row_bytes, r0, rows, qx, M, K, out, N); break;
      case kQ4_K: tile_rows<kQ4_K>(base, row_bytes, r0, rows, qx, M, K, out, N); break;
      case kQ5_K: tile_rows<kQ5_K>(base, row_bytes, r0, rows, qx, M, K, out, N); break;
      case kQ6_K: tile_rows<kQ6_K>(base, row_bytes, r0, rows, qx, M, K, out, N); break;
      default: TORCH_CHECK(false, "ggml_linear_q8_panel: unsupported ggml type ", kinds[s]);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("ggml_linear_q8_panel(Tensor x, Tensor[] blocks, int[] kinds) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("ggml_linear_q8_panel", &ggml_linear_q8_panel); }
