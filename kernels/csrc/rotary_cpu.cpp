// Rotary position embedding (the "rotate half" form), for CPU float32 and bfloat16.
//
// torch spends seven ops on it (two slices, four multiplies, a subtract, an
// add, a cat) per layer; at decode batch sizes each costs more in dispatch
// than in arithmetic. Built with -ffp-contract=off (kernels/native.py): every
// product is rounded before the add or subtract, as torch's separate ops do,
// so the result is bit-identical to worker/models/rotary.py's, in either dtype.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "float_or_bf16.h"

namespace {

using kvmesh::from_float;
using kvmesh::round_as;
using kvmesh::to_float;

constexpr int64_t kMinElementsPerTask = 32768;

// x [tokens, heads, head_dim] (any row and head strides, head_dim contiguous);
// cos, sin [tokens, 1, head_dim / 2] or [tokens, head_dim / 2], x's dtype.
// Returns a contiguous [tokens, heads, head_dim]:
//   out[..., :half] = x1 * cos - x2 * sin;  out[..., half:] = x2 * cos + x1 * sin
// In bfloat16 every product is rounded before the sum, as torch's separate
// bfloat16 ops (and transformers' apply_rotary_pos_emb) round them.
at::Tensor rotary_embedding(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1,
              "rotary_embedding: x must be float32 or bfloat16 [tokens, heads, head_dim], "
              "head_dim contiguous");
  const int64_t tokens = x.size(0), heads = x.size(1), head_dim = x.size(2);
  TORCH_CHECK(head_dim % 2 == 0, "rotary_embedding: odd head_dim ", head_dim);
  const int64_t half = head_dim / 2;
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->is_contiguous() && t->size(0) == tokens && t->numel() == tokens * half,
                "rotary_embedding: cos and sin must be contiguous [tokens, 1, head_dim / 2]");
  }
  kvmesh::check_same_dtype(x, cos, "rotary_embedding", "x", "cos");
  kvmesh::check_same_dtype(x, sin, "rotary_embedding", "x", "sin");
  at::Tensor out = at::empty({tokens, heads, head_dim}, x.options());
  const int64_t x_tok = x.stride(0), x_head = x.stride(1);
  kvmesh::dispatch_float_or_bf16(x.scalar_type(), "rotary_embedding", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    const T* cp = cos.data_ptr<T>();
    const T* sp = sin.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(
        0, tokens, std::max<int64_t>(1, kMinElementsPerTask / (heads * head_dim)),
        [&](int64_t begin, int64_t end) {
          for (int64_t t = begin; t < end; ++t) {
            const T* c = cp + t * half;
            const T* s = sp + t * half;
            for (int64_t h = 0; h < heads; ++h) {
              const T* x1 = xp + t * x_tok + h * x_head;
              const T* x2 = x1 + half;
              T* o = op + (t * heads + h) * head_dim;
#pragma omp simd
              for (int64_t i = 0; i < half; ++i) {
                const float a = to_float(x1[i]), b = to_float(x2[i]);
                const float ci = to_float(c[i]), si = to_float(s[i]);
                o[i] = from_float<T>(round_as<T>(a * ci) - round_as<T>(b * si));
                o[i + half] = from_float<T>(round_as<T>(b * ci) + round_as<T>(a * si));
              }
            }
          }
        });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("rotary_embedding(Tensor x, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("rotary_embedding", &rotary_embedding); }
