// Paged decode attention for CPU, float32 or bfloat16, as a torch custom op.
//
// One query token per sequence attends to its whole context, read in place
// from the paged KV cache through the sequence's block table: no gather into
// a padded tensor, no mask, no padding work. Work is split over
// (sequence, KV head) pairs on torch's own intra-op thread pool
// (work_stealing.h), so it shares threads with the matmuls instead of
// competing with them. The query heads of a GQA group are done together so
// every K/V row is read from memory once per group, not once per query head.
//
// Numerics: scores and the softmax are float32 with the max subtracted; the
// value sum accumulates in float32. bfloat16 caches at a level with
// AVX512-BF16 take attend_one_bf16 (vdpbf16ps dot products, group sizes <= 8). Only the order of additions differs from
// the PyTorch reference (kernels/reference.py). bfloat16 query and K/V are read
// as float; only the output is rounded to bfloat16, once (float_or_bf16.h).

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include "vec16.h"
#endif

#include "float_or_bf16.h"
#include "work_stealing.h"

namespace {

using kvmesh::from_float;
using kvmesh::to_float;

// s[t] = exp(s[t] - max(s)) in place; returns their sum (the softmax's denominator).
inline float exp_in_place(float* s, int64_t len) {
  float m = s[0];
  for (int64_t t = 1; t < len; ++t) m = std::max(m, s[t]);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < len; ++t) {
    s[t] = std::exp(s[t] - m);
    sum += s[t];
  }
  return sum;
}

// One (sequence, KV head) pair: the `group` query heads that share the KV head.
// HEAD_DIM is a compile-time constant so the per-head accumulators live in
// vector registers (4 zmm or 8 ymm for 64 floats) instead of memory.
template <int HEAD_DIM, typename T>
void attend_one(const T* const* q, T* const* out, int64_t group, const T* k_base, const T* v_base,
                const int64_t* table, int64_t len, int64_t block_size, int64_t row_stride,
                float scale, float* scores) {
  // Scores: one dot product per (head, token), K rows read through the block table.
  for (int64_t g = 0; g < group; ++g) {
    float qg[HEAD_DIM];
    for (int d = 0; d < HEAD_DIM; ++d) qg[d] = to_float(q[g][d]) * scale;
    float* s = scores + g * len;
    // Block-major walk: no division per token.
    for (int64_t start = 0; start < len; start += block_size) {
      const T* k = k_base + table[start / block_size] * block_size * row_stride;
      const int64_t n = std::min(block_size, len - start);
      for (int64_t j = 0; j < n; ++j, k += row_stride) {
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int d = 0; d < HEAD_DIM; ++d) sum += qg[d] * to_float(k[d]);
        s[start + j] = sum;
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * len;
    const float inv = 1.f / exp_in_place(s, len);
    float acc[HEAD_DIM] = {};
    for (int64_t start = 0; start < len; start += block_size) {
      const T* v = v_base + table[start / block_size] * block_size * row_stride;
      const int64_t n = std::min(block_size, len - start);
      for (int64_t j = 0; j < n; ++j, v += row_stride) {
        const float p = s[start + j];
#pragma omp simd
        for (int d = 0; d < HEAD_DIM; ++d) acc[d] += p * to_float(v[d]);
      }
    }
    T* o = out[g];
#pragma omp simd
    for (int d = 0; d < HEAD_DIM; ++d) o[d] = from_float<T>(acc[d] * inv);
  }
}

// Any head size: same math, accumulators in memory.
template <typename T>
void attend_one_generic(const T* const* q, T* const* out, int64_t group, int64_t head_dim,
                        const T* k_base, const T* v_base, const int64_t* table, int64_t len,
                        int64_t block_size, int64_t row_stride, float scale, float* scores,
                        float* acc) {
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * len;
    for (int64_t t = 0; t < len; ++t) {
      const T* k = k_base + (table[t / block_size] * block_size + t % block_size) * row_stride;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t d = 0; d < head_dim; ++d) {
        sum += to_float(q[g][d]) * to_float(k[d]);
      }
      s[t] = sum * scale;
    }
    float m = s[0];
    for (int64_t t = 1; t < len; ++t) m = std::max(m, s[t]);
    float total = 0.f;
    for (int64_t t = 0; t < len; ++t) {
      s[t] = std::exp(s[t] - m);
      total += s[t];
    }
    std::fill(acc, acc + head_dim, 0.f);
    for (int64_t t = 0; t < len; ++t) {
      const T* v = v_base + (table[t / block_size] * block_size + t % block_size) * row_stride;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) acc[d] += s[t] * to_float(v[d]);
    }
    for (int64_t d = 0; d < head_dim; ++d) out[g][d] = from_float<T>(acc[d] / total);
  }
}

#if defined(__AVX512BF16__)
// bfloat16 K/V at a level with AVX512-BF16 (kernels/cpu_isa.py): q·k by
// vdpbf16ps on the bfloat16 pairs as stored (products of two bfloat16 are
// exact in float32, sums are float32: only the order of additions and where
// the scale is applied differ from the float path above), and every K and V
// row is loaded and widened once for the whole GQA group instead of once per
// query head (the float path converts every row once per query head).
constexpr int64_t kPrefetchBlocks = 4;

// The rows of this head kPrefetchBlocks blocks after `start`: blocks are scattered
// through the cache, so the hardware prefetcher stops at each block's end;
// asking for the next one while this one is computed hides that latency
// (without it a batch-16 decode over 1,024 tokens ran at ~4 GB/s on one core).
template <int HEAD_DIM>
inline void prefetch_next_block(const c10::BFloat16* base, const int64_t* table, int64_t start,
                                int64_t len, int64_t block_size, int64_t row_stride) {
  const int64_t next = start + kPrefetchBlocks * block_size;
  if (next >= len) return;
  const c10::BFloat16* row = base + table[next / block_size] * block_size * row_stride;
  const int64_t n = std::min(block_size, len - next);
  for (int64_t j = 0; j < n; ++j, row += row_stride) {
    for (int line = 0; line < HEAD_DIM * 2; line += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(row) + line, _MM_HINT_T0);
    }
  }
}

inline __m512 widen_bf16(const c10::BFloat16* p) {
  return kvmesh::bf16_bits_to_float(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <int HEAD_DIM, int GROUP>
void attend_one_bf16(const c10::BFloat16* const* q, c10::BFloat16* const* out,
                     const c10::BFloat16* k_base, const c10::BFloat16* v_base,
                     const int64_t* table, int64_t len, int64_t block_size, int64_t row_stride,
                     float scale, float* scores) {
  constexpr int kPairs = HEAD_DIM / 32;   // zmm of bfloat16 pairs per row
  constexpr int kFloats = HEAD_DIM / 16;  // zmm of float per row
  __m512bh qv[GROUP][kPairs];
  for (int g = 0; g < GROUP; ++g) {
    for (int c = 0; c < kPairs; ++c) {
      qv[g][c] = (__m512bh)_mm512_loadu_si512(q[g] + 32 * c);
    }
  }
  for (int64_t start = 0; start < len; start += block_size) {
    const c10::BFloat16* k = k_base + table[start / block_size] * block_size * row_stride;
    const int64_t n = std::min(block_size, len - start);
    prefetch_next_block<HEAD_DIM>(k_base, table, start, len, block_size, row_stride);
    for (int64_t j = 0; j < n; ++j, k += row_stride) {
      __m512bh kv[kPairs];
      for (int c = 0; c < kPairs; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(k + 32 * c);
      for (int g = 0; g < GROUP; ++g) {
        __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], kv[0]);
        for (int c = 1; c < kPairs; ++c) acc = _mm512_dpbf16_ps(acc, qv[g][c], kv[c]);
        scores[g * len + start + j] = _mm512_reduce_add_ps(acc) * scale;
      }
    }
  }
  float inv[GROUP];
  for (int g = 0; g < GROUP; ++g) {
    inv[g] = 1.f / exp_in_place(scores + g * len, len);
  }
  __m512 acc[GROUP][kFloats];
  for (int g = 0; g < GROUP; ++g) {
    for (int i = 0; i < kFloats; ++i) acc[g][i] = _mm512_setzero_ps();
  }
  for (int64_t start = 0; start < len; start += block_size) {
    const c10::BFloat16* v = v_base + table[start / block_size] * block_size * row_stride;
    const int64_t n = std::min(block_size, len - start);
    prefetch_next_block<HEAD_DIM>(v_base, table, start, len, block_size, row_stride);
    for (int64_t j = 0; j < n; ++j, v += row_stride) {
      __m512 vf[kFloats];
      for (int i = 0; i < kFloats; ++i) vf[i] = widen_bf16(v + 16 * i);
      for (int g = 0; g < GROUP; ++g) {
        const __m512 p = _mm512_set1_ps(scores[g * len + start + j]);
        for (int i = 0; i < kFloats; ++i) acc[g][i] = _mm512_fmadd_ps(p, vf[i], acc[g][i]);
      }
    }
  }
  for (int g = 0; g < GROUP; ++g) {
    alignas(64) float o[HEAD_DIM];
    for (int i = 0; i < kFloats; ++i) {
      _mm512_store_ps(o + 16 * i, _mm512_mul_ps(acc[g][i], _mm512_set1_ps(inv[g])));
    }
    for (int d = 0; d < HEAD_DIM; ++d) out[g][d] = from_float<c10::BFloat16>(o[d]);
  }
}

// The bfloat16 path for this group size, or nullptr (then the float path runs).
template <int HEAD_DIM>
using AttendBf16Fn = void (*)(const c10::BFloat16* const*, c10::BFloat16* const*,
                              const c10::BFloat16*, const c10::BFloat16*, const int64_t*, int64_t,
                              int64_t, int64_t, float, float*);

template <int HEAD_DIM>
AttendBf16Fn<HEAD_DIM> attend_bf16_for(int64_t group) {
  switch (group) {
    case 1: return &attend_one_bf16<HEAD_DIM, 1>;
    case 2: return &attend_one_bf16<HEAD_DIM, 2>;
    case 3: return &attend_one_bf16<HEAD_DIM, 3>;
    case 4: return &attend_one_bf16<HEAD_DIM, 4>;
    case 5: return &attend_one_bf16<HEAD_DIM, 5>;
    case 6: return &attend_one_bf16<HEAD_DIM, 6>;
    case 7: return &attend_one_bf16<HEAD_DIM, 7>;
    case 8: return &attend_one_bf16<HEAD_DIM, 8>;
    default: return nullptr;
  }
}
#endif

// Every (sequence, KV head) pair of the batch, over torch's threads; the
// arguments are validated by paged_decode_attention.
template <typename T>
void attend_all(T* out_base, const T* q_base, const T* k_base, const T* v_base,
                const int64_t* tables, const int64_t* lens, const int64_t* row_ids,
                int64_t num_decodes, int64_t num_kv_heads, int64_t group, int64_t head_dim,
                int64_t max_blocks, int64_t max_len, int64_t block_size, int64_t row_stride,
                int64_t q_tok, int64_t q_head, int64_t o_tok, int64_t o_head, float scale) {
  kvmesh::parallel_items(num_decodes * num_kv_heads, [&](int64_t item, bool) {
    thread_local std::vector<float> scores;
    thread_local std::vector<float> acc;
    thread_local std::vector<const T*> q;
    thread_local std::vector<T*> o;
    scores.resize(group * max_len);
    acc.resize(head_dim);
    q.resize(group);
    o.resize(group);
    const int64_t seq = item / num_kv_heads;
    const int64_t kv_head = item % num_kv_heads;
    const int64_t row = row_ids[seq];
    for (int64_t g = 0; g < group; ++g) {
      q[g] = q_base + row * q_tok + (kv_head * group + g) * q_head;
      o[g] = out_base + row * o_tok + (kv_head * group + g) * o_head;
    }
    const T* k = k_base + kv_head * head_dim;
    const T* v = v_base + kv_head * head_dim;
    const int64_t* table = tables + seq * max_blocks;
    const int64_t len = lens[seq];
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (head_dim == 64) {
        if (const auto fn = attend_bf16_for<64>(group)) {
          fn(q.data(), o.data(), k, v, table, len, block_size, row_stride, scale, scores.data());
          return;
        }
      } else if (head_dim == 128) {
        if (const auto fn = attend_bf16_for<128>(group)) {
          fn(q.data(), o.data(), k, v, table, len, block_size, row_stride, scale, scores.data());
          return;
        }
      }
    }
#endif
    switch (head_dim) {
      case 64:
        attend_one<64>(q.data(), o.data(), group, k, v, table, len, block_size, row_stride, scale,
                       scores.data());
        break;
      case 128:
        attend_one<128>(q.data(), o.data(), group, k, v, table, len, block_size, row_stride,
                        scale, scores.data());
        break;
      default:
        attend_one_generic(q.data(), o.data(), group, head_dim, k, v, table, len, block_size,
                           row_stride, scale, scores.data(), acc.data());
    }
  });
}

// out[rows[i]] = softmax(q K^T * scale) V for every decode i.
//   out, query:   [num_tokens, num_heads, head_dim], last dim contiguous
//   key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim] contiguous
//   (all four float32, or all four bfloat16)
//   block_tables: [num_decodes, max_blocks_per_seq] int64
//   context_lens: [num_decodes] int64 (>= 1)
//   rows:         [num_decodes] int64, query/out row of each decode
void paged_decode_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, const at::Tensor& rows, double scale) {
  const char* op = "paged_decode_attention";
  kvmesh::check_same_dtype(query, out, op, "query", "out");
  kvmesh::check_same_dtype(query, key_cache, op, "query", "key_cache");
  kvmesh::check_same_dtype(query, value_cache, op, "query", "value_cache");
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3 && key_cache.dim() == 4,
              "paged_decode_attention: bad ranks");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(),
              "paged_decode_attention: caches must be contiguous");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(),
              "paged_decode_attention: key and value caches differ in shape");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1,
              "paged_decode_attention: head_dim must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong &&
                  rows.scalar_type() == at::kLong,
              "paged_decode_attention: index tensors must be int64");
  TORCH_CHECK(block_tables.is_contiguous() && context_lens.is_contiguous() && rows.is_contiguous(),
              "paged_decode_attention: index tensors must be contiguous");

  const int64_t num_decodes = rows.size(0);
  const int64_t num_heads = query.size(1);
  const int64_t head_dim = query.size(2);
  const int64_t num_blocks = key_cache.size(0);
  const int64_t block_size = key_cache.size(1);
  const int64_t num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim && out.size(2) == head_dim && out.size(1) == num_heads,
              "paged_decode_attention: head shape mismatch");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "paged_decode_attention: heads do not group");
  TORCH_CHECK(block_tables.size(0) == num_decodes && context_lens.size(0) == num_decodes,
              "paged_decode_attention: one block table and length per decode");
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t row_stride = num_kv_heads * head_dim;  // between tokens in a block
  const float scale_f = static_cast<float>(scale);

  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* row_ids = rows.data_ptr<int64_t>();

  // Validate every index once, outside the parallel region: a bad block id
  // would otherwise read outside the cache.
  int64_t max_len = 0;
  for (int64_t i = 0; i < num_decodes; ++i) {
    const int64_t len = lens[i];
    TORCH_CHECK(len >= 1 && len <= max_blocks * block_size, "paged_decode_attention: context length ",
                len, " out of range");
    TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < query.size(0) && row_ids[i] < out.size(0),
                "paged_decode_attention: row out of range");
    for (int64_t b = 0; b < (len + block_size - 1) / block_size; ++b) {
      const int64_t block = tables[i * max_blocks + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "paged_decode_attention: block id ", block,
                  " out of range");
    }
    max_len = std::max(max_len, len);
  }

  kvmesh::dispatch_float_or_bf16(query.scalar_type(), op, [&](auto tag) {
    using T = decltype(tag);
    attend_all<T>(out.data_ptr<T>(), query.data_ptr<T>(), key_cache.data_ptr<T>(),
                  value_cache.data_ptr<T>(), tables, lens, row_ids, num_decodes, num_kv_heads,
                  group, head_dim, max_blocks, max_len, block_size, row_stride, query.stride(0),
                  query.stride(1), out.stride(0), out.stride(1), scale_f);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor context_lens, Tensor rows, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
