// SwiGLU's silu(gate) * up in one pass, for CPU float32 and bfloat16.
//
// [rows, 2 * I] (gate | up, as the fused gate_up projection writes them) ->
// [rows, I]. Built with -ffast-math (kernels/native.py) for the vectorized
// exp (glibc libmvec, within 4 ulp); torch's silu uses its own vectorized exp,
// so the two agree to a few ulps, not bit for bit.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "float_or_bf16.h"

namespace {

using kvmesh::from_float;
using kvmesh::round_as;
using kvmesh::to_float;

// Rows per thread chunk: decode batches (a few rows) stay on the calling thread.
constexpr int64_t kMinElementsPerTask = 32768;

// [rows, 2 * I] (gate | up) -> [rows, I]: silu(gate) * up. In bfloat16,
// silu's result is rounded before the multiply, as F.silu(gate) * up stores it.
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous(),
              "silu_and_mul: gate_up must be a contiguous float32 or bfloat16 [rows, features] "
              "tensor");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_and_mul: odd feature count ", gate_up.size(1));
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, gate_up.options());
  kvmesh::dispatch_float_or_bf16(gate_up.scalar_type(), "silu_and_mul", [&](auto tag) {
    using T = decltype(tag);
    const T* gp = gate_up.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, rows, std::max<int64_t>(1, kMinElementsPerTask / inter),
                     [&](int64_t begin, int64_t end) {
                       for (int64_t r = begin; r < end; ++r) {
                         const T* gate = gp + r * 2 * inter;
                         const T* up = gate + inter;
                         T* o = op + r * inter;
#pragma omp simd
                         for (int64_t i = 0; i < inter; ++i) {
                           const float g = to_float(gate[i]);
                           const float silu = round_as<T>(g / (1.f + std::exp(-g)));
                           o[i] = from_float<T>(silu * to_float(up[i]));
                         }
                       }
                     });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) { m.def("silu_and_mul(Tensor gate_up) -> Tensor"); }

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("silu_and_mul", &silu_and_mul); }
