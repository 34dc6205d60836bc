// SwiGLU's silu(gate) * up in one pass, for CPU float32 and bfloat16.
//
// [rows, 2 * I] (gate | up, as the fused gate_up projection writes them) ->
// [rows, I]. From the avx2 level up, 16 lanes at a time on Vec16 (vec16.h):
// exp by exp16's degree-6 polynomial (about a float32 ulp), bfloat16 loaded
// and rounded in registers. The portable loop (the generic level, and each
// row's last I % 16 outputs) calls std::exp; it was the whole kernel before,
// vectorized by gcc with glibc's vector exp under -ffast-math, with its
// bfloat16 conversions in scalar code. Against that loop (built from the
// previous source), on the 2-core "AMD EPYC" family 25 model 17 (Zen 4,
// AVX-512 + AVX512-BF16, no AMX), 2 alternating runs: bfloat16
// [16, 2 x 1,536] 15-18 us vs 21-24, [2,048, 2 x 1,536] 1.29 vs 1.32-1.48 ms
// (there the bytes bound it: ~14-16 GB/s). torch's silu uses its own
// vectorized exp, so the two agree to a few ulps, not bit for bit.
//
// GeGLU (Gemma's gelu_pytorch_tanh(gate) * up) the same way: gelu_tanh(g) =
// 0.5 g (1 + tanh(u)), u = sqrt(2 / pi) (g + 0.044715 g^3), is g * sigmoid(2 u)
// exactly (1 + tanh(u) = 2 / (1 + exp(-2 u))), computed as silu is, so no
// 1 - 2 / (exp + 1) cancellation near 0; a few ulps from torch's tanh form.
// Unfused it was two torch ops and a [rows, I] temporary per layer (Gemma 3's
// decode step at batch 16: 2.4 of 67.5 ms in aten::gelu alone on the Zen 2).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "float_or_bf16.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <type_traits>

#include "vec16.h"
#define KVMESH_SILU_VEC16 1
#endif

namespace {

using kvmesh::from_float;
using kvmesh::round_as;
using kvmesh::to_float;

// Rows per thread chunk: decode batches (a few rows) stay on the calling thread.
constexpr int64_t kMinElementsPerTask = 32768;
// gelu_pytorch_tanh's constants.
constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;

#if defined(KVMESH_SILU_VEC16)
using kvmesh::Vec16;

template <typename T>
inline Vec16 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec16::load(p);
  } else {
    return Vec16::load_bf16(reinterpret_cast<const uint16_t*>(p));
  }
}

// The first 16 * (I / 16) outputs of one row; returns how many it wrote.
template <typename T, bool GELU>
int64_t silu_and_mul_vec16(const T* gate, const T* up, T* out, int64_t inter) {
  const int64_t whole = inter - inter % 16;
  for (int64_t i = 0; i < whole; i += 16) {
    const Vec16 g = load16(gate + i);
    // silu(g) = g * sigmoid(g); gelu_tanh(g) = g * sigmoid(2 u).
    Vec16 arg = g;
    if constexpr (GELU) {
      const Vec16 cube = g * g * g;
      arg = Vec16::fma(Vec16::splat(kGeluCubic), cube, g) * Vec16::splat(2.f * kSqrt2OverPi);
    }
    Vec16 silu = g / (Vec16::splat(1.f) + kvmesh::exp16<true, true>(Vec16::zero() - arg));
    if constexpr (std::is_same_v<T, float>) {
      (silu * load16(up + i)).store(out + i);
    } else {
      silu = silu.round_bf16();
      (silu * load16(up + i)).store_bf16(reinterpret_cast<uint16_t*>(out + i));
    }
  }
  return whole;
}
#endif

// [rows, 2 * I] (gate | up) -> [rows, I]: act(gate) * up, act silu or (GELU)
// gelu_tanh. In bfloat16, act's result is rounded before the multiply, as
// F.silu(gate) * up stores it.
template <bool GELU>
at::Tensor act_and_mul(const at::Tensor& gate_up, const char* op) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous(), op,
              ": gate_up must be a contiguous float32 or bfloat16 [rows, features] tensor");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, op, ": odd feature count ", gate_up.size(1));
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, gate_up.options());
  kvmesh::dispatch_float_or_bf16(gate_up.scalar_type(), op, [&](auto tag) {
    using T = decltype(tag);
    const T* gp = gate_up.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, rows, std::max<int64_t>(1, kMinElementsPerTask / inter),
                     [&](int64_t begin, int64_t end) {
                       for (int64_t r = begin; r < end; ++r) {
                         const T* gate = gp + r * 2 * inter;
                         const T* up = gate + inter;
                         T* o = op + r * inter;
                         int64_t first = 0;
#if defined(KVMESH_SILU_VEC16)
                         first = silu_and_mul_vec16<T, GELU>(gate, up, o, inter);
#endif
#pragma omp simd
                         for (int64_t i = first; i < inter; ++i) {
                           const float g = to_float(gate[i]);
                           const float arg =
                               GELU ? (g + kGeluCubic * g * g * g) * (2.f * kSqrt2OverPi) : g;
                           const float act = round_as<T>(g / (1.f + std::exp(-arg)));
                           o[i] = from_float<T>(act * to_float(up[i]));
                         }
                       }
                     });
  });
  return out;
}

}  // namespace

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  return act_and_mul<false>(gate_up, "silu_and_mul");
}

at::Tensor gelu_tanh_and_mul(const at::Tensor& gate_up) {
  return act_and_mul<true>(gate_up, "gelu_tanh_and_mul");
}

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("gelu_tanh_and_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) {
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("gelu_tanh_and_mul", &gelu_tanh_and_mul);
}
