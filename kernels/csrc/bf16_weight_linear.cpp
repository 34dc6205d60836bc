// y = x Wᵀ in float32 for small batches, with W kept as bfloat16 words.
//
// Why: most checkpoints ship their weights in bfloat16. Served in float32 (on a
// CPU without bfloat16 dot products, where float32 is the fast dtype), each such
// weight is exactly a bfloat16 value widened: its low 16 bits are zero. A decode
// step multiplies a handful of rows by every weight, so it is bound by reading
// the weights; reading the 2 bytes that carry information instead of 4 halves
// that traffic, and widening a bfloat16 word to float32 is exact (a 16-bit
// shift). The arithmetic stays float32: the products and sums are those of the
// float32 weight, only their order differs from oneDNN's. worker/models/linear.py
// keeps such a weight only in this layout (half a float32 copy's memory) and
// widens it into a scratch buffer for prefill-sized batches.
//
// Layout, 16 output features per panel (one AVX-512 register of float32):
//   panels: [num_panels, K, 16] bfloat16 words: word l of feature k of panel p
//           is W[16 p + l, k]; panels past out_features are zeros.
// (kernels/bf16_weights.py packs it.)
//
// Paths by instruction-set level (kernels/cpu_isa.py):
//   AVX-512:      a panel's 16 words widened into one register per feature.
//   AVX2 + FMA:   two 8-lane halves per panel, same operations in the same order,
//                 so the float32 results are bitwise those of AVX-512.
//   otherwise:    portable C++ (the compiler vectorizes what the level allows).
// Each row's sum runs over k in order, one accumulator per output, whatever the
// other rows of the call: a row's result does not depend on the batch
// (batch-invariant mode relies on this).
//
// Prefill-sized batches (AVX2 level, kBlockedMinRows rows and up): the panel
// loop above streams all of x once per panel of 16 outputs, from L3 once x
// outgrows L2, and widens each word once per 6-row tile. There the batch runs
// as a cache-blocked GEMM in the manner of BLIS / GotoBLAS: per chunk of
// panels and kKc-deep slice of k, the slice of the panels is widened once into
// a float32 buffer that stays in L2; x, packed once per call into 6-row
// strips (kMr floats per k, contiguous), is read kMc rows at a time; a 6 x 16
// register tile (12 ymm accumulators) then runs over each strip and panel.
// Measured on the 2-core Zen 2 (one thread, 2,048 x 1,024 x 4,096 and the
// other projection shapes of a Qwen3 layer): ~92 GFLOP/s, 86% of the FMA peak
// (107 GFLOP/s per core measured by a register-only FMA loop), against oneDNN's
// 72 on the float32 weight it packed at load. The sums stay exactly the
// per-row chains above: the first k slice starts from zero, each later slice
// reloads the partial sums from y (a store and a load of a float change
// nothing) and continues over k in order, and the bias is added at the end,
// so a row's result is bitwise the same on either path.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include "float_gemm_avx2.h"
#include "panel_tile.h"
#include "work_stealing.h"

namespace {

using kvmesh::panel::kLanes;
using kvmesh::panel::kMaxRows;
using kvmesh::panel::kTiles;

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define KVMESH_BF16_BLOCKED_GEMM 1
// The blocked GEMM (see the top of the file; its micro-kernel and loops are
// float_gemm_avx2.h, shared with ggml_float_gemm.cpp).
// At and above this many rows the blocked GEMM beats the panel loop (AVX2):
// see bf16_weight_bench.py --blocked-crossover in docs/performance.md.
constexpr int64_t kBlockedMinRows = 32;

template <class Word>
void blocked_gemm(const float* x, int64_t ldx, int64_t M, int64_t K, const Word* panels,
                  int64_t num_panels, float* y, int64_t out_features) {
  namespace fg = kvmesh::float_gemm;
  const int64_t per_item = fg::panels_per_item(num_panels, at::get_num_threads());
  const int64_t items = (num_panels + per_item - 1) / per_item;
  // x into strips once, read by every chunk of panels.
  const float* packed = fg::pack_x(x, ldx, M, K);
  kvmesh::parallel_items(items, [&](int64_t item, bool /*forward*/) {
    thread_local fg::Scratch scratch;
    const int64_t first = item * per_item;
    const int64_t count = std::min(per_item, num_panels - first);
    const int64_t cols = std::min(count * kLanes, out_features - first * kLanes);
    // float32 panels are used in place (a k slice of a panel is kc x 16 floats
    // in a row); bfloat16 words are widened a k slice at a time.
    fg::gemm_chunk_packed(packed, M, K, count, cols, y + first * kLanes, out_features,
                          /*granule=*/kLanes,
                          [&](int64_t k0, int64_t kc) -> fg::SliceView {
                            if constexpr (std::is_same_v<Word, uint16_t>) {
                              float* widened = fg::aligned_floats(
                                  scratch.widened, fg::kMaxChunkPanels * fg::kMaxKc * kLanes);
                              kvmesh::panel::widen_slice(panels + first * K * kLanes, K * kLanes, count,
                                                         k0, kc, widened);
                              return {widened, kc * kLanes};
                            } else {
                              return {panels + (first * K + k0) * kLanes, K * kLanes};
                            }
                          });
  });
}
#endif

template <class Word>
at::Tensor panel_linear(const char* op, const at::Tensor& x, const at::Tensor& panels,
                        const std::optional<at::Tensor>& bias, int64_t out_features) {
  constexpr auto kPanelType = std::is_same_v<Word, float> ? at::kFloat : at::kBFloat16;
  TORCH_CHECK(x.device().is_cpu() && panels.device().is_cpu(),
              op, ": CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              op, ": x must be float32 [M, K] with unit feature stride");
  TORCH_CHECK(panels.scalar_type() == kPanelType && panels.is_contiguous() &&
                  panels.dim() == 3 && panels.size(2) == kLanes,
              op, ": panels must be contiguous ", c10::toString(kPanelType), " [panels, K, 16]");
  const int64_t M = x.size(0), K = x.size(1), num_panels = panels.size(0);
  TORCH_CHECK(panels.size(1) == K, op, ": x has ", K, " features, panels ",
              panels.size(1));
  TORCH_CHECK(out_features > (num_panels - 1) * kLanes && out_features <= num_panels * kLanes,
              op, ": out_features ", out_features, " does not match ", num_panels,
              " panels");
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == out_features,
                op, ": bias must be contiguous float32 [out_features]");
  }
  at::Tensor y = at::empty({M, out_features}, x.options());
  if (M == 0) return y;
  const auto* wp = reinterpret_cast<const Word*>(panels.data_ptr());
  const float* xp = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  float* yp = y.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;

#ifdef KVMESH_BF16_BLOCKED_GEMM
  if (M >= kBlockedMinRows) {
    blocked_gemm(xp, ldx, M, K, wp, num_panels, yp, out_features);
    if (bp != nullptr) {
      at::parallel_for(0, M, 64, [&](int64_t begin, int64_t end) {
        for (int64_t m = begin; m < end; ++m) {
          for (int64_t n = 0; n < out_features; ++n) yp[m * out_features + n] += bp[n];
        }
      });
    }
    return y;
  }
#endif
  kvmesh::parallel_items(num_panels, [&](int64_t p, bool /*forward*/) {
    const int64_t n0 = p * kLanes;
    const int64_t valid = std::min(kLanes, out_features - n0);
    const Word* panel = wp + p * K * kLanes;
    // Row tiles after the first find the panel in L1/L2 (K x 32 bytes).
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
      const int64_t rows = std::min(kMaxRows, M - m0);
      const float* row_starts[kMaxRows];
      for (int64_t r = 0; r < rows; ++r) row_starts[r] = xp + (m0 + r) * ldx;
      kTiles<Word>[rows - 1](row_starts, K, panel, yp + m0 * out_features + n0, out_features,
                             valid);
    }
    if (bp != nullptr) {
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t l = 0; l < valid; ++l) yp[m * out_features + n0 + l] += bp[n0 + l];
      }
    }
  });
  return y;
}

at::Tensor bf16_weight_linear(const at::Tensor& x, const at::Tensor& panels,
                              const std::optional<at::Tensor>& bias, int64_t out_features) {
  return panel_linear<uint16_t>("bf16_weight_linear", x, panels, bias, out_features);
}

at::Tensor float_panel_linear(const at::Tensor& x, const at::Tensor& panels,
                              const std::optional<at::Tensor>& bias, int64_t out_features) {
  return panel_linear<float>("float_panel_linear", x, panels, bias, out_features);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("bf16_weight_linear(Tensor x, Tensor panels, Tensor? bias, int out_features) -> Tensor");
  m.def("float_panel_linear(Tensor x, Tensor panels, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) {
  m.impl("bf16_weight_linear", &bf16_weight_linear);
  m.impl("float_panel_linear", &float_panel_linear);
}
