// SwiGLU's silu(gate) * up in one pass, for CPU float32.
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

namespace {

// Rows per thread chunk: decode batches (a few rows) stay on the calling thread.
constexpr int64_t kMinElementsPerTask = 32768;

// [rows, 2 * I] (gate | up) -> [rows, I]: silu(gate) * up
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat && gate_up.dim() == 2 && gate_up.is_contiguous(),
              "silu_and_mul: gate_up must be a contiguous float32 [rows, features] tensor");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_and_mul: odd feature count ", gate_up.size(1));
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, kMinElementsPerTask / inter),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t r = begin; r < end; ++r) {
                       const float* gate = gp + r * 2 * inter;
                       const float* up = gate + inter;
                       float* o = op + r * inter;
#pragma omp simd
                       for (int64_t i = 0; i < inter; ++i) {
                         o[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
                       }
                     }
                   });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) { m.def("silu_and_mul(Tensor gate_up) -> Tensor"); }

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("silu_and_mul", &silu_and_mul); }
