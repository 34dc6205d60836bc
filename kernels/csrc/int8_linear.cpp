// W8A8: y = x Wᵀ with the weights as 8-bit block codes (block_code_linear.cpp's
// layout and meaning: W[n, k] = code[n, k] * scale[n, k/32] + offset[n, k/32])
// AND the activations quantized to int8 per call, multiplied with integer
// dot-product instructions. Opt-in (--quantization w8a8): it adds the
// activations' rounding error to the weights' (README, "Quantized weights").
//
// Activations: dynamic per-token symmetric int8, as vLLM's dynamic per-token
// w8a8: for each row, a = max |x[m, :]|, q[m, k] = round(x[m, k] * (127 / a))
// (float32 product, nearest even), row scale s[m] = a / 127 (0 for a zero row).
// Per 32-feature block kb and output n, with d = Σ_k q[m, k] code[n, k] and
// t = Σ_k q[m, k] (both exact int32):
//   acc[m, n] += scale[n, kb] * float(d) + offset[n, kb] * float(t)
// in float32 (d < 2^24, so float(d) is exact), and y = acc * s[m], stored in
// x's dtype (float32 or bfloat16, rounded once). The offset term uses the
// quantized activations' block sums, so that Q8_0-style codes (code + 128,
// offset -128 * scale) cancel exactly as the signed codes would.
//
// The uint8 codes are vpdpbusd's unsigned operand as they are, the activations
// its signed one: a decode row reads 1 byte per weight and does no float work
// per weight (one float fused multiply-add per 32 of them). The codes' layout
// holds, per input feature, the panel's 16 outputs; the dot-product
// instructions want 4 consecutive features of one output per 32-bit lane, so
// every 4 x 16 bytes are transposed in registers (one vpermd and one vpshufb
// per 64 weights; no extra copy of the weights is kept).
//
// Paths by instruction-set level (kernels/cpu_isa.py):
//   AVX512-VNNI (avx512_bf16, amx): up to 8 rows per register tile, the
//     block's 8 transposed code vectors reused by every row, one vpdpbusd per
//     4 features per row.
//   AMX-INT8 (amx, kAmxMinRows rows and more): the panel's codes transposed
//     once into a thread-local buffer in AMX's B-tile layout; per 16 rows and
//     block one tdpbsud (signed activations x unsigned codes, K = 32), the
//     int32 tile stored and scaled into 16 float32 register accumulators.
//   otherwise: portable C++ with the same arithmetic (and results).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "amx_tiles.h"
#include "float_or_bf16.h"
#include "work_stealing.h"

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kCodeBlock = 32;
constexpr int64_t kGroup = 4;  // features per 32-bit lane of vpdpbusd / tdpbsud
// From this many rows a panel runs on AMX tiles where the level has them
// (below: vpdpbusd). One 3072x576 weight, one thread, on the 2-core AMX Xeon
// (load 1.1), AMX-INT8 vs a build with vpdpbusd only: 16 rows 0.598 vs 0.603
// ms, 32: 0.966 vs 1.075, 64: 1.85 vs 2.07, 512: 16.9 vs 17.0. Each tile op
// costs ~10-20 ns on that VM and a block takes five (B and A loads, zero,
// tdpbsud, store) per 16 rows; sharing B across row tiles and storing running
// sums (no zeroing; block = difference of two stores) would cut that to ~3.
constexpr int64_t kAmxMinRows = 16;

// x's rows as int8, with each row's scale and each block's sum of codes.
struct QuantizedRows {
  at::Tensor q;           // [M, K] int8
  at::Tensor row_scales;  // [M] float32
  at::Tensor block_sums;  // [M, K / 32] float32 (exact integers)
};

template <typename T>
QuantizedRows quantize_rows(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), blocks = K / kCodeBlock;
  QuantizedRows out{at::empty({M, K}, x.options().dtype(at::kChar)),
                    at::empty({M}, x.options().dtype(at::kFloat)),
                    at::empty({M, blocks}, x.options().dtype(at::kFloat))};
  const T* xp = x.data_ptr<T>();
  int8_t* qp = out.q.data_ptr<int8_t>();
  float* sp = out.row_scales.data_ptr<float>();
  float* bp = out.block_sums.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / K), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const T* row = xp + m * K;
      float amax = 0.0f;
#pragma omp simd reduction(max : amax)
      for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(kvmesh::to_float(row[k])));
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      sp[m] = amax / 127.0f;
      int8_t* q = qp + m * K;
      for (int64_t kb = 0; kb < blocks; ++kb) {
        int32_t sum = 0;
#pragma omp simd reduction(+ : sum)
        for (int64_t k = kb * kCodeBlock; k < (kb + 1) * kCodeBlock; ++k) {
          const float r = std::nearbyint(kvmesh::to_float(row[k]) * inv);
          const auto v = static_cast<int32_t>(std::clamp(r, -127.0f, 127.0f));
          q[k] = static_cast<int8_t>(v);
          sum += v;
        }
        bp[m * blocks + kb] = static_cast<float>(sum);
      }
    }
  });
  return out;
}

// Where one panel's results go: rows of 16 float32 accumulators, scaled by
// the row's activation scale and rounded once to T.
template <typename T>
struct PanelOut {
  T* y;
  int64_t ldy;
  int64_t valid_lanes;
  const float* row_scales;

  void store(int64_t m, const float* acc) const {
    for (int64_t l = 0; l < valid_lanes; ++l) {
      y[m * ldy + l] = kvmesh::from_float<T>(acc[l] * row_scales[m]);
    }
  }
};

// One panel's operands for `rows` rows starting at activation row 0 of `q`.
struct PanelIn {
  const int8_t* q;          // [rows, K]
  const float* block_sums;  // [rows, K / 32]
  int64_t K;
  const uint8_t* codes;  // [K, 16]
  const float* scales;   // [K / 32, 16]
  const float* offsets;  // [K / 32, 16]
};

#if defined(__AVX512VNNI__)
constexpr int64_t kMaxRows = 8;  // 8 code vectors + 8 int32 + 8 float32 accumulators

// Features k..k+3 of the panel's 16 outputs (64 bytes: 4 rows of 16 codes),
// transposed so that 32-bit lane n holds code[n, k..k+3]: vpermd gathers
// lane j's dwords (outputs 4j..4j+3) from each feature's row, then vpshufb
// interleaves their bytes.
inline __m512i vnni_codes(const uint8_t* codes_k) {
  const __m512i rows = _mm512_loadu_si512(codes_k);
  const __m512i gather = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  const __m512i interleave = _mm512_broadcast_i32x4(
      _mm_set_epi8(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0));
  return _mm512_shuffle_epi8(_mm512_permutexvar_epi32(gather, rows), interleave);
}

template <int ROWS, typename T>
void panel_vnni(const PanelIn& in, const PanelOut<T>& out, int64_t m0) {
  const int64_t blocks = in.K / kCodeBlock;
  __m512 acc[ROWS];
  for (int m = 0; m < ROWS; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < blocks; ++kb) {
    __m512i w[kCodeBlock / kGroup];
    for (int64_t g = 0; g < kCodeBlock / kGroup; ++g) {
      w[g] = vnni_codes(in.codes + (kb * kCodeBlock + g * kGroup) * kLanes);
    }
    const __m512 scale = _mm512_loadu_ps(in.scales + kb * kLanes);
    const __m512 offset = _mm512_loadu_ps(in.offsets + kb * kLanes);
    for (int m = 0; m < ROWS; ++m) {
      const int8_t* q = in.q + m * in.K + kb * kCodeBlock;
      // Two chains of 4 vpdpbusd each, so that their latency overlaps.
      __m512i dot0 = _mm512_setzero_si512(), dot1 = _mm512_setzero_si512();
      for (int64_t g = 0; g < kCodeBlock / kGroup; g += 2) {
        int32_t a0, a1;
        std::memcpy(&a0, q + g * kGroup, sizeof(a0));
        std::memcpy(&a1, q + (g + 1) * kGroup, sizeof(a1));
        dot0 = _mm512_dpbusd_epi32(dot0, w[g], _mm512_set1_epi32(a0));
        dot1 = _mm512_dpbusd_epi32(dot1, w[g + 1], _mm512_set1_epi32(a1));
      }
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(dot0, dot1));
      acc[m] = _mm512_fmadd_ps(dot, scale, acc[m]);
      acc[m] = _mm512_fmadd_ps(offset, _mm512_set1_ps(in.block_sums[m * blocks + kb]), acc[m]);
    }
  }
  alignas(64) float row[kLanes];
  for (int m = 0; m < ROWS; ++m) {
    _mm512_store_ps(row, acc[m]);
    out.store(m0 + m, row);
  }
}

template <typename T>
using VnniFn = void (*)(const PanelIn&, const PanelOut<T>&, int64_t);

template <typename T, int... R>
constexpr auto make_vnni(std::integer_sequence<int, R...>) {
  return std::array<VnniFn<T>, sizeof...(R)>{&panel_vnni<R + 1, T>...};
}

// All M rows of one panel, kMaxRows at a time.
template <typename T>
void panel_rows(const PanelIn& in, const PanelOut<T>& out, int64_t M) {
  static constexpr auto tiles = make_vnni<T>(std::make_integer_sequence<int, kMaxRows>{});
  const int64_t blocks = in.K / kCodeBlock;
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
    const int64_t rows = std::min(kMaxRows, M - m0);
    PanelIn part = in;
    part.q = in.q + m0 * in.K;
    part.block_sums = in.block_sums + m0 * blocks;
    tiles[rows - 1](part, out, m0);
  }
}
#else
// Portable: the same integer dot products and float32 operations, in order.
template <typename T>
void panel_rows(const PanelIn& in, const PanelOut<T>& out, int64_t M) {
  const int64_t blocks = in.K / kCodeBlock;
  for (int64_t m = 0; m < M; ++m) {
    float acc[kLanes] = {};
    const int8_t* q = in.q + m * in.K;
    for (int64_t kb = 0; kb < blocks; ++kb) {
      int32_t dot[kLanes] = {};
      for (int64_t k = kb * kCodeBlock; k < (kb + 1) * kCodeBlock; ++k) {
        const int32_t a = q[k];
#pragma omp simd
        for (int64_t l = 0; l < kLanes; ++l) dot[l] += a * in.codes[k * kLanes + l];
      }
      const float t = in.block_sums[m * blocks + kb];
      for (int64_t l = 0; l < kLanes; ++l) {
        acc[l] = std::fma(static_cast<float>(dot[l]), in.scales[kb * kLanes + l], acc[l]);
        acc[l] = std::fma(in.offsets[kb * kLanes + l], t, acc[l]);
      }
    }
    out.store(m, acc);
  }
}
#endif  // VNNI

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512VNNI__)
constexpr bool kAmxInt8 = true;
constexpr int64_t kTileRows = 16;
constexpr int64_t kBTileBytes = kCodeBlock * kLanes;  // 8 rows of 64 bytes
constexpr int64_t kBlocksInFlight = 4;                 // C tiles 4..7

// Tiles: 0 and 1 = B (one block's codes), 2 and 3 = A (up to 16 rows x 32
// int8), alternating by block; 4..7 = C (int32), one per block of a group of
// kBlocksInFlight, all multiplied before any is stored and scaled, so that the
// tiles' latency (tdpbsud, then the store the vector loads wait for) overlaps
// across blocks instead of stalling every block.
kvmesh::TileConfig int8_config(int64_t rows) {
  kvmesh::TileConfig config{};
  config.palette_id = 1;
  for (int tile = 0; tile < 8; ++tile) {
    const bool b = tile < 2, a = tile == 2 || tile == 3;
    config.rows[tile] = b ? kCodeBlock / kGroup : static_cast<uint8_t>(rows);
    config.colsb[tile] = a ? kCodeBlock : kLanes * sizeof(int32_t);
  }
  return config;
}

// C tile 4 + j = block j of the group: codes of `b` x activations of `a`.
// GCC's AMX intrinsics take literal tile numbers, hence the switch.
inline void multiply_block(int j, const uint8_t* b, const int8_t* a, int64_t a_stride) {
#define KVMESH_BLOCK(C, B, A)         \
  _tile_loadd(B, b, kLanes * kGroup); \
  _tile_loadd(A, a, a_stride);        \
  _tile_zero(C);                      \
  _tile_dpbsud(C, A, B);              \
  break;
  switch (j) {
    case 0: KVMESH_BLOCK(4, 0, 2)
    case 1: KVMESH_BLOCK(5, 1, 3)
    case 2: KVMESH_BLOCK(6, 0, 2)
    default: KVMESH_BLOCK(7, 1, 3)
  }
#undef KVMESH_BLOCK
}

inline void store_block(int j, int32_t* out) {
  kvmesh::store_tile(4 + j, out, kLanes * sizeof(int32_t));
}

template <typename T>
void panel_amx(const PanelIn& in, const PanelOut<T>& out, int64_t M) {
  const int64_t blocks = in.K / kCodeBlock;
  // The panel's codes in B-tile layout, transposed once for all its rows.
  thread_local std::vector<uint8_t> b_tiles;
  b_tiles.resize(in.K * kLanes);
  for (int64_t k = 0; k < in.K; k += kGroup) {
    _mm512_storeu_si512(b_tiles.data() + k * kLanes, vnni_codes(in.codes + k * kLanes));
  }
  alignas(64) int32_t c[kBlocksInFlight][kTileRows * kLanes];
  int64_t configured = 0;
  for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
    const int64_t rows = std::min(kTileRows, M - m0);
    if (rows != configured) {
      const kvmesh::TileConfig config = int8_config(rows);
      kvmesh::compiler_barrier();
      _tile_loadconfig(&config);
      configured = rows;
    }
    __m512 acc[kTileRows];
    for (int r = 0; r < kTileRows; ++r) acc[r] = _mm512_setzero_ps();
    const int8_t* q = in.q + m0 * in.K;
    const float* sums = in.block_sums + m0 * blocks;
    for (int64_t kb0 = 0; kb0 < blocks; kb0 += kBlocksInFlight) {
      const int group = static_cast<int>(std::min(kBlocksInFlight, blocks - kb0));
      for (int j = 0; j < group; ++j) {
        const int64_t kb = kb0 + j;
        multiply_block(j, b_tiles.data() + kb * kBTileBytes, q + kb * kCodeBlock, in.K);
      }
      for (int j = 0; j < group; ++j) store_block(j, c[j]);
      kvmesh::compiler_barrier();
      for (int j = 0; j < group; ++j) {
        const int64_t kb = kb0 + j;
        const __m512 scale = _mm512_loadu_ps(in.scales + kb * kLanes);
        const __m512 offset = _mm512_loadu_ps(in.offsets + kb * kLanes);
#pragma GCC unroll 16
        for (int r = 0; r < kTileRows; ++r) {
          if (r < rows) {
            const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512(c[j] + r * kLanes));
            acc[r] = _mm512_fmadd_ps(dot, scale, acc[r]);
            acc[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(sums[r * blocks + kb]), acc[r]);
          }
        }
      }
    }
    alignas(64) float row[kLanes];
    for (int r = 0; r < rows; ++r) {
      _mm512_store_ps(row, acc[r]);
      out.store(m0 + r, row);
    }
  }
  _tile_release();  // oneDNN configures tiles of its own on these threads
}
#else
constexpr bool kAmxInt8 = false;
#endif  // AMX-INT8

at::Tensor int8_block_code_linear(const at::Tensor& x, const at::Tensor& codes,
                                  const at::Tensor& scales, const at::Tensor& offsets,
                                  int64_t out_features) {
  constexpr const char* op = "int8_block_code_linear";
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), op, ": x must be a contiguous [M, K] tensor");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 3 && codes.is_contiguous() &&
                  codes.size(2) == kLanes,
              op, ": codes must be contiguous uint8 [panels, K, 16]");
  const int64_t M = x.size(0), K = x.size(1), panels = codes.size(0);
  TORCH_CHECK(codes.size(1) == K, op, ": x has ", K, " features, codes ", codes.size(1));
  TORCH_CHECK(K % kCodeBlock == 0, op, ": K must be a multiple of 32");
  for (const at::Tensor* t : {&scales, &offsets}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 &&
                    t->size(0) == panels && t->size(1) == K / kCodeBlock && t->size(2) == kLanes,
                op, ": scales and offsets must be contiguous float32 [panels, K / 32, 16]");
  }
  TORCH_CHECK(out_features > (panels - 1) * kLanes && out_features <= panels * kLanes, op,
              ": out_features ", out_features, " does not match ", panels, " panels");
  at::Tensor y = at::empty({M, out_features}, x.options());
  kvmesh::dispatch_float_or_bf16(x.scalar_type(), op, [&](auto t) {
    using T = decltype(t);
    const QuantizedRows rows = quantize_rows<T>(x);
    const bool amx = kAmxInt8 && M >= kAmxMinRows;
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
    if (amx) kvmesh::require_amx_permission(op);
#endif
    const int64_t blocks = K / kCodeBlock;
    const uint8_t* cp = codes.data_ptr<uint8_t>();
    const float* sp = scales.data_ptr<float>();
    const float* op_ = offsets.data_ptr<float>();
    kvmesh::parallel_items(panels, [&](int64_t p, bool) {
      const int64_t n0 = p * kLanes;
      const PanelIn in{rows.q.data_ptr<int8_t>(), rows.block_sums.data_ptr<float>(), K,
                       cp + p * K * kLanes,     sp + p * blocks * kLanes,
                       op_ + p * blocks * kLanes};
      const PanelOut<T> out{y.data_ptr<T>() + n0, out_features,
                            std::min(kLanes, out_features - n0),
                            rows.row_scales.data_ptr<float>()};
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512VNNI__)
      if (amx) {
        panel_amx(in, out, M);
        return;
      }
#endif
      panel_rows(in, out, M);
    });
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def(
      "int8_block_code_linear(Tensor x, Tensor codes, Tensor scales, Tensor offsets, "
      "int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("int8_block_code_linear", &int8_block_code_linear); }
