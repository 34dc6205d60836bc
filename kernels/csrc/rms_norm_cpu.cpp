// RMSNorm (and the residual add before it) fused, for CPU float32 and bfloat16.
//
// Unfused, RMSNorm is six torch ops (pow, mean, add, rsqrt, mul, mul) plus
// the residual add, each a pass over memory and a Python dispatch; at decode
// batch sizes the dispatches dominate. The arithmetic follows transformers'
// order — x * (1 / sqrt(mean(x²) + eps)), then * weight — in float32; only the
// order of the additions inside mean(x²) differs. bfloat16 tensors are read
// as float and rounded where transformers rounds (float_or_bf16.h). Built
// without -ffast-math (kernels/native.py), so the square root and division
// are correctly rounded, as torch's are, not approximated.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <tuple>

#include "float_or_bf16.h"

namespace {

using kvmesh::from_float;
using kvmesh::round_as;
using kvmesh::to_float;

// Rows per thread chunk: decode batches (a few rows) stay on the calling thread.
constexpr int64_t kMinElementsPerTask = 32768;

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous(), name,
              " must be a contiguous float32 or bfloat16 [rows, features] tensor");
}

// transformers' LlamaRMSNorm: x * inv in float32, cast to the input dtype,
// then * weight in that dtype (in bfloat16: a second rounding).
template <typename T>
inline void norm_row(const T* x, const T* weight, T* out, int64_t n, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    const float xi = to_float(x[i]);
    sum += xi * xi;
  }
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    out[i] = from_float<T>(to_float(weight[i]) * round_as<T>(to_float(x[i]) * inv));
  }
}

void check_weight(const at::Tensor& x, const at::Tensor& weight, const char* op) {
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1), op,
              ": weight must be contiguous [features]");
  kvmesh::check_same_dtype(x, weight, op, "x", "weight");
}

// weight * RMSNorm(x)
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm: x");
  check_weight(x, weight, "rms_norm");
  at::Tensor out = at::empty_like(x);
  const int64_t n = x.size(1);
  kvmesh::dispatch_float_or_bf16(x.scalar_type(), "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    const T* wp = weight.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, x.size(0), std::max<int64_t>(1, kMinElementsPerTask / n),
                     [&](int64_t begin, int64_t end) {
                       for (int64_t r = begin; r < end; ++r) {
                         norm_row(xp + r * n, wp, op + r * n, n, static_cast<float>(eps));
                       }
                     });
  });
  return out;
}

// (weight * RMSNorm(x + residual), x + residual): the residual stream update
// and the next norm in one pass. The sum is stored in x's dtype and the norm
// reads it back, as transformers' `residual + hidden` does in bfloat16.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_rows(x, "add_rms_norm: x");
  check_rows(residual, "add_rms_norm: residual");
  TORCH_CHECK(x.sizes() == residual.sizes(), "add_rms_norm: x and residual differ in shape");
  kvmesh::check_same_dtype(x, residual, "add_rms_norm", "x", "residual");
  check_weight(x, weight, "add_rms_norm");
  at::Tensor out = at::empty_like(x);
  at::Tensor sum = at::empty_like(x);
  const int64_t n = x.size(1);
  kvmesh::dispatch_float_or_bf16(x.scalar_type(), "add_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    const T* rp = residual.data_ptr<T>();
    const T* wp = weight.data_ptr<T>();
    T* op = out.data_ptr<T>();
    T* sp = sum.data_ptr<T>();
    const int64_t rows_per_task = std::max<int64_t>(1, kMinElementsPerTask / n);
    at::parallel_for(0, x.size(0), rows_per_task, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        T* s = sp + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) {
          s[i] = from_float<T>(to_float(rp[r * n + i]) + to_float(xp[r * n + i]));
        }
        norm_row(s, wp, op + r * n, n, static_cast<float>(eps));
      }
    });
  });
  return {out, sum};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
}
