// Repetition, presence and frequency penalties on float32 logits, in place, for CPU.
//
// Why: the torch form (worker/sampler.py apply_penalties) counts every row's
// tokens into [rows, vocab + 1] tensors and rewrites all of [rows, vocab]
// five times over, though only the tokens a row has seen change. Here each
// row visits its own tokens: counts in a per-thread vocabulary-sized array
// that is cleared again token by token, so a row costs O(its tokens), and a
// row whose three penalties are neutral (1, 0, 0) costs nothing.
//
// The arithmetic is torch's, operation for operation (x / r or x * r by the
// sign of x for tokens of the prompt or the output; then x - f * count, then
// x - p for tokens of the output), so the results are the same floats.

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "work_stealing.h"

namespace {

// Per-thread counts, all zero between rows.
struct Counts {
  std::vector<int32_t> output;  // times in the output
  std::vector<uint8_t> seen;  // in the prompt or the output
  std::vector<int32_t> touched;
};

thread_local Counts counts;

void penalize_row(float* x, int64_t vocab, const int64_t* ids, int64_t prompt_len,
                  int64_t num_tokens, float repetition, float presence, float frequency,
                  Counts& c) {
  if (c.seen.size() < static_cast<size_t>(vocab)) {
    c.output.assign(vocab, 0);
    c.seen.assign(vocab, 0);
  }
  c.touched.clear();
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t token = ids[t];
    if (token < 0 || token >= vocab) continue;  // padding
    if (!c.seen[token]) {
      c.seen[token] = 1;
      c.touched.push_back(static_cast<int32_t>(token));
    }
    c.output[token] += t >= prompt_len;
  }
  for (const int32_t token : c.touched) {
    float v = x[token];
    v = v > 0.f ? v / repetition : v * repetition;
    const int32_t n = c.output[token];
    v = v - frequency * static_cast<float>(n);
    v = v - presence * (n > 0 ? 1.f : 0.f);
    x[token] = v;
    c.output[token] = 0;
    c.seen[token] = 0;
  }
}

// logits [rows, vocab] float32 (unit vocab stride), changed in place;
// token_ids [rows, >= max(num_tokens)] int64, prompt then output tokens;
// prompt_lens, num_tokens [rows] int64; the penalties [rows] float32.
void apply_penalties_(at::Tensor& logits, const at::Tensor& token_ids,
                      const at::Tensor& prompt_lens, const at::Tensor& num_tokens,
                      const at::Tensor& repetition, const at::Tensor& presence,
                      const at::Tensor& frequency) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "apply_penalties_: logits must be a float32 [rows, vocab] tensor with unit vocab "
              "stride");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(token_ids.dim() == 2 && token_ids.size(0) == rows &&
                  token_ids.scalar_type() == at::kLong && token_ids.stride(1) == 1,
              "apply_penalties_: token_ids must be an int64 [rows, length] tensor");
  for (const at::Tensor* column : {&prompt_lens, &num_tokens}) {
    TORCH_CHECK(column->dim() == 1 && column->size(0) == rows &&
                    column->scalar_type() == at::kLong && column->is_contiguous(),
                "apply_penalties_: lengths must be contiguous int64 [rows] tensors");
  }
  for (const at::Tensor* column : {&repetition, &presence, &frequency}) {
    TORCH_CHECK(column->dim() == 1 && column->size(0) == rows &&
                    column->scalar_type() == at::kFloat && column->is_contiguous(),
                "apply_penalties_: penalties must be contiguous float32 [rows] tensors");
  }
  const int64_t length = token_ids.size(1);
  const int64_t* prompt = prompt_lens.data_ptr<int64_t>();
  const int64_t* total = num_tokens.data_ptr<int64_t>();
  for (int64_t row = 0; row < rows; ++row) {
    TORCH_CHECK(0 <= prompt[row] && prompt[row] <= total[row] && total[row] <= length,
                "apply_penalties_: row ", row, " has ", total[row], " tokens (", prompt[row],
                " of the prompt) in a length of ", length);
  }
  float* base = logits.data_ptr<float>();
  const int64_t* ids = token_ids.data_ptr<int64_t>();
  const float* r = repetition.data_ptr<float>();
  const float* p = presence.data_ptr<float>();
  const float* f = frequency.data_ptr<float>();
  const int64_t stride = logits.stride(0), id_stride = token_ids.stride(0);
  kvmesh::parallel_items(rows, [&](int64_t row, bool) {
    if (r[row] == 1.f && p[row] == 0.f && f[row] == 0.f) return;
    penalize_row(base + row * stride, vocab, ids + row * id_stride, prompt[row], total[row],
                 r[row], p[row], f[row], counts);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def(
      "apply_penalties_(Tensor(a!) logits, Tensor token_ids, Tensor prompt_lens, "
      "Tensor num_tokens, Tensor repetition, Tensor presence, Tensor frequency) -> ()");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("apply_penalties_", &apply_penalties_); }
