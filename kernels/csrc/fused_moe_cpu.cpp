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
// once per step for all its rows, the pairs are sorted by a counting sort,
// and nothing is gathered.
//
// Layout: the experts' weights in 16-feature panels (worker/models/moe.py's
// pack_expert_panels packs them at load), bfloat16 words (widened exactly)
// or float32, as bf16_weight_linear.cpp's dense panels:
//   gate_up [E, ceil(I / 16), 2, H, 16]: panel pair j holds gate features
//           16 j .. 16 j + 15, then the up features of the same columns, so an
//           item reads both in one contiguous run (features past I are zero);
//   down    [E, ceil(H / 16), I, 16].
// x float32 or bfloat16, float32 sums.
//
// Two passes over torch's threads (work_stealing.h), each over items of one
// active expert and a few panels:
//   1. gate and up panels times the expert's rows -> the activated rows of a
//      float32 scratch [pairs, I];
//   2. down panels times the activated rows -> a [pairs, H] scratch;
// then each token's rows, scaled by their routing weights, are summed in
// expert order (the grouped path's order), threads over tokens.
// An expert with few rows (decode) runs panel_tile.h's loop: each panel
// streams from memory once, every row's sums beside each other. An expert
// with many rows (prefill, kGemmMinRows and up, AVX2 level) runs the blocked
// GEMM of float_gemm_avx2.h over its rows: the bench checkpoint's 2,048-token
// prefill step ran its experts at ~43% of the two cores' FMA peak through
// dot-product tiles with horizontal sums (docs/performance.md, "MoE prefill").
// Both compute each output as one chain of fused multiply-adds over k in
// order from zero, so a row's result is bitwise the same on either path, on
// every ISA level, whatever else the step holds: a token's output does not
// depend on its batch.
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

#include "float_gemm_avx2.h"
#include "float_or_bf16.h"
#include "panel_tile.h"
#include "work_stealing.h"

namespace {

using kvmesh::round_as;
using kvmesh::panel::kLanes;
using kvmesh::panel::kMaxRows;

// Down panels per panel-loop item (a decode step's down pass): 4 x I x 16
// words, one contiguous run of the expert's panels.
constexpr int64_t kDownPanels = 4;

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define KVMESH_MOE_BLOCKED_GEMM 1
// An expert with at least this many rows runs the blocked GEMM.
constexpr int64_t kGemmMinRows = 24;
// Panels (pairs in pass 1) per GEMM item.
constexpr int64_t kGemmPanels = 4;
#endif

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

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
  std::vector<int64_t> slots;       // [tokens, top_k]: a token's sorted pairs, in expert order
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
  // Slots in increasing order: each token's experts in expert order.
  r.slots.resize(pairs);
  std::vector<int64_t> filled(top_k > 0 ? pairs / top_k : 0, 0);
  for (int64_t slot = 0; slot < pairs; ++slot) {
    const int64_t t = r.token[slot];
    r.slots[t * top_k + filled[t]++] = slot;
  }
  return r;
}

// One work item: panels [first_panel, first_panel + panels) of an active
// expert, by the GEMM or by the panel loop.
struct Item {
  int64_t expert;
  int64_t first_panel;
  int64_t panels;
  bool gemm;
};

// Each active expert's panels cut into items: GEMM items of kGemmPanels for an
// expert with many rows, else items of `loop_panels`.
std::vector<Item> cut_items(const Routing& r, int64_t num_panels, int64_t loop_panels) {
  std::vector<Item> items;
  for (const int64_t e : r.active) {
    const int64_t rows = r.starts[e + 1] - r.starts[e];
    bool gemm = false;
    int64_t per_item = loop_panels;
#ifdef KVMESH_MOE_BLOCKED_GEMM
    if (rows >= kGemmMinRows) {
      gemm = true;
      per_item = kGemmPanels;
    }
#endif
    for (int64_t p = 0; p < num_panels; p += per_item) {
      items.push_back({e, p, std::min(per_item, num_panels - p), gemm});
    }
  }
  return items;
}

#ifdef KVMESH_MOE_BLOCKED_GEMM
// y[:rows, 0 .. cols) = the rows times `count` panels (panel j at first + j *
// stride words), by the blocked GEMM.
template <typename Word>
void gemm_rows(const float* const* rows, int64_t count, int64_t K, const Word* first,
               int64_t stride, int64_t panels, int64_t cols, float* y, int64_t ldy) {
  namespace fg = kvmesh::float_gemm;
  thread_local fg::Scratch scratch;
  fg::gemm_chunk_rows(
      [rows](int64_t m) { return rows[m]; }, count, K, panels, cols, y, ldy, /*granule=*/kLanes,
      scratch,
      [&](int64_t k0, int64_t kc) -> fg::SliceView {
        if constexpr (std::is_same_v<Word, uint16_t>) {
          float* widened =
              fg::aligned_floats(scratch.widened, fg::kMaxChunkPanels * fg::kMaxKc * kLanes);
          kvmesh::panel::widen_slice(first, stride, panels, k0, kc, widened);
          return {widened, kc * kLanes};
        } else {
          return {first + k0 * kLanes, stride};
        }
      });
}
#endif

template <typename T, typename Word>
void run(const at::Tensor& x, const Routing& r, const Word* gate_up, const Word* down,
         int64_t inter, int64_t top_k, bool gelu, at::Tensor& out) {
  const int64_t tokens = x.size(0), hidden = x.size(1);
  const int64_t pairs = static_cast<int64_t>(r.token.size());
  const int64_t pair_panels = cdiv(inter, kLanes), down_panels = cdiv(hidden, kLanes);
  // Strides in words: a gate/up panel pair, an expert's gate_up, a down
  // panel, an expert's down.
  const int64_t pair_stride = 2 * hidden * kLanes, expert_gate_up = pair_panels * pair_stride;
  const int64_t down_stride = inter * kLanes, expert_down = down_panels * down_stride;

  // x as float32 rows (bfloat16 widened once, not once per expert).
  std::unique_ptr<float[]> widened;
  const float* xf;
  if constexpr (std::is_same_v<T, float>) {
    xf = x.data_ptr<float>();
  } else {
    widened.reset(new float[tokens * hidden]);
    const T* xp = x.data_ptr<T>();
    for (int64_t i = 0; i < tokens * hidden; ++i) widened[i] = kvmesh::to_float(xp[i]);
    xf = widened.get();
  }
  std::vector<const float*> x_rows(pairs);
  for (int64_t p = 0; p < pairs; ++p) x_rows[p] = xf + r.token[p] * hidden;

  // Pass 1: activated [pairs, I].
  std::unique_ptr<float[]> act(new float[pairs * inter]);
  const std::vector<Item> gate_items = cut_items(r, pair_panels, 1);
  kvmesh::parallel_items(static_cast<int64_t>(gate_items.size()), [&](int64_t i, bool) {
    const Item& item = gate_items[i];
    const int64_t first = r.starts[item.expert], count = r.starts[item.expert + 1] - first;
    const int64_t c0 = item.first_panel * kLanes;
    const int64_t cols = std::min(item.panels * kLanes, inter - c0);
    const int64_t ld = item.panels * kLanes;
    const Word* gate_w = gate_up + item.expert * expert_gate_up + item.first_panel * pair_stride;
    const Word* up_w = gate_w + hidden * kLanes;
    const float* const* rows = x_rows.data() + first;
    thread_local std::vector<float> gate, up;
    gate.resize(std::max<int64_t>(count, kMaxRows) * ld);
    up.resize(gate.size());
#ifdef KVMESH_MOE_BLOCKED_GEMM
    if (item.gemm) {
      gemm_rows(rows, count, hidden, gate_w, pair_stride, item.panels, cols, gate.data(), ld);
      gemm_rows(rows, count, hidden, up_w, pair_stride, item.panels, cols, up.data(), ld);
    } else
#endif
    {
      kvmesh::panel::rows_times_panel(rows, count, hidden, gate_w, gate.data(), ld, cols);
      kvmesh::panel::rows_times_panel(rows, count, hidden, up_w, up.data(), ld, cols);
    }
    for (int64_t m = 0; m < count; ++m) {
      float* a = act.get() + (first + m) * inter + c0;
      for (int64_t c = 0; c < cols; ++c) {
        a[c] = activate<T>(round_as<T>(gate[m * ld + c]), round_as<T>(up[m * ld + c]), gelu);
      }
    }
  });

  // Pass 2: down [pairs, H].
  std::unique_ptr<float[]> down_rows(new float[pairs * hidden]);
  std::vector<const float*> act_rows(pairs);
  for (int64_t p = 0; p < pairs; ++p) act_rows[p] = act.get() + p * inter;
  const std::vector<Item> down_items = cut_items(r, down_panels, kDownPanels);
  kvmesh::parallel_items(static_cast<int64_t>(down_items.size()), [&](int64_t i, bool) {
    const Item& item = down_items[i];
    const int64_t first = r.starts[item.expert], count = r.starts[item.expert + 1] - first;
    const int64_t n0 = item.first_panel * kLanes;
    const int64_t cols = std::min(item.panels * kLanes, hidden - n0);
    const Word* down_w = down + item.expert * expert_down + item.first_panel * down_stride;
    const float* const* rows = act_rows.data() + first;
    float* y = down_rows.get() + first * hidden + n0;
#ifdef KVMESH_MOE_BLOCKED_GEMM
    if (item.gemm) {
      gemm_rows(rows, count, inter, down_w, down_stride, item.panels, cols, y, hidden);
      return;
    }
#endif
    for (int64_t j = 0; j < item.panels; ++j) {
      kvmesh::panel::rows_times_panel(rows, count, inter, down_w + j * down_stride, y + j * kLanes,
                                      hidden, std::min(kLanes, cols - j * kLanes));
    }
  });

  // Each token's rows scaled and summed in expert order, in float32, rounded
  // to T once at the end.
  T* op = out.data_ptr<T>();
  kvmesh::parallel_items(tokens, [&](int64_t t, bool) {
    thread_local std::vector<float> sums;
    sums.assign(hidden, 0.f);
    for (int64_t i = 0; i < top_k; ++i) {
      const int64_t p = r.slots[t * top_k + i];
      const float w = r.weight[p];
      const float* d = down_rows.get() + p * hidden;
      for (int64_t c = 0; c < hidden; ++c) sums[c] += round_as<T>(w * round_as<T>(d[c]));
    }
    for (int64_t c = 0; c < hidden; ++c) op[t * hidden + c] = kvmesh::from_float<T>(sums[c]);
  });
}

at::Tensor fused_moe(const at::Tensor& x, const at::Tensor& topk_ids,
                     const at::Tensor& topk_weights, const at::Tensor& gate_up,
                     const at::Tensor& down, int64_t inter, bool gelu) {
  constexpr const char* op = "fused_moe";
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), op, ": x must be a contiguous [tokens, hidden]");
  const int64_t tokens = x.size(0), hidden = x.size(1);
  TORCH_CHECK(topk_ids.scalar_type() == at::kLong && topk_ids.dim() == 2 &&
                  topk_ids.is_contiguous() && topk_ids.size(0) == tokens,
              op, ": topk_ids must be contiguous int64 [tokens, k]");
  TORCH_CHECK(topk_weights.scalar_type() == at::kFloat && topk_weights.is_contiguous() &&
                  topk_weights.sizes() == topk_ids.sizes(),
              op, ": topk_weights must be contiguous float32 shaped as topk_ids");
  TORCH_CHECK(inter > 0, op, ": intermediate size must be positive, got ", inter);
  TORCH_CHECK(gate_up.dim() == 5 && gate_up.is_contiguous() &&
                  gate_up.size(1) == cdiv(inter, kLanes) && gate_up.size(2) == 2 &&
                  gate_up.size(3) == hidden && gate_up.size(4) == kLanes,
              op, ": gate_up must be contiguous panels [experts, ceil(I / 16), 2, hidden, 16]");
  const int64_t experts = gate_up.size(0);
  TORCH_CHECK(down.dim() == 4 && down.is_contiguous() && down.size(0) == experts &&
                  down.size(1) == cdiv(hidden, kLanes) && down.size(2) == inter &&
                  down.size(3) == kLanes,
              op, ": down must be contiguous panels [experts, ceil(hidden / 16), I, 16]");
  TORCH_CHECK(down.scalar_type() == gate_up.scalar_type(), op, ": down is ", down.scalar_type(),
              " but gate_up is ", gate_up.scalar_type());
  const int64_t top_k = topk_ids.size(1);
  const Routing routing = sort_pairs(topk_ids.data_ptr<int64_t>(), topk_weights.data_ptr<float>(),
                                     topk_ids.numel(), top_k, experts);
  at::Tensor out = at::empty({tokens, hidden}, x.options());
  if (tokens == 0) return out;
  kvmesh::dispatch_float_or_bf16(x.scalar_type(), op, [&](auto x_tag) {
    using T = decltype(x_tag);
    kvmesh::dispatch_float_or_bf16(gate_up.scalar_type(), op, [&](auto w_tag) {
      // bfloat16 weights are read as their 16-bit words (panel_tile.h widens them).
      using Word = std::conditional_t<std::is_same_v<decltype(w_tag), float>, float, uint16_t>;
      run<T, Word>(x, routing, reinterpret_cast<const Word*>(gate_up.data_ptr()),
                   reinterpret_cast<const Word*>(down.data_ptr()), inter, top_k, gelu, out);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def(
      "fused_moe(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor gate_up, Tensor down, "
      "int inter, bool gelu) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("fused_moe", &fused_moe); }
