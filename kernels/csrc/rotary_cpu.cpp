// Rotary position embedding (the "rotate half" form), for CPU float32.
//
// torch spends seven ops on it (two slices, four multiplies, a subtract, an
// add, a cat) per layer; at decode batch sizes each costs more in dispatch
// than in arithmetic. Built with -ffp-contract=off (kernels/native.py): every
// product is rounded before the add or subtract, as torch's separate ops do,
// so the result is bit-identical to worker/models/rotary.py's.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kMinElementsPerTask = 32768;

// x [tokens, heads, head_dim] (any row and head strides, head_dim contiguous);
// cos, sin [tokens, 1, head_dim / 2] or [tokens, head_dim / 2].
// Returns a contiguous [tokens, heads, head_dim]:
//   out[..., :half] = x1 * cos - x2 * sin;  out[..., half:] = x2 * cos + x1 * sin
at::Tensor rotary_embedding(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 3 && x.stride(2) == 1,
              "rotary_embedding: x must be float32 [tokens, heads, head_dim], head_dim contiguous");
  const int64_t tokens = x.size(0), heads = x.size(1), head_dim = x.size(2);
  TORCH_CHECK(head_dim % 2 == 0, "rotary_embedding: odd head_dim ", head_dim);
  const int64_t half = head_dim / 2;
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->size(0) == tokens &&
                    t->numel() == tokens * half,
                "rotary_embedding: cos and sin must be contiguous float32 [tokens, 1, head_dim / 2]");
  }
  at::Tensor out = at::empty({tokens, heads, head_dim}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t x_tok = x.stride(0), x_head = x.stride(1);
  at::parallel_for(0, tokens, std::max<int64_t>(1, kMinElementsPerTask / (heads * head_dim)),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t t = begin; t < end; ++t) {
                       const float* c = cp + t * half;
                       const float* s = sp + t * half;
                       for (int64_t h = 0; h < heads; ++h) {
                         const float* x1 = xp + t * x_tok + h * x_head;
                         const float* x2 = x1 + half;
                         float* o = op + (t * heads + h) * head_dim;
#pragma omp simd
                         for (int64_t i = 0; i < half; ++i) {
                           o[i] = x1[i] * c[i] - x2[i] * s[i];
                           o[i + half] = x2[i] * c[i] + x1[i] * s[i];
                         }
                       }
                     }
                   });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("rotary_embedding(Tensor x, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("rotary_embedding", &rotary_embedding); }
