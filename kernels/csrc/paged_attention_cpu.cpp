// Paged decode attention for CPU, float32 or bfloat16, as a torch custom op.
//
// One query token per sequence attends to its whole context, read in place
// from the paged KV cache through the sequence's block table: no gather into
// a padded tensor, no mask, no padding work. Work is split on torch's own
// intra-op thread pool (work_stealing.h), so it shares threads with the
// matmuls instead of competing with them. The query heads of a GQA group are
// done together so every K/V row is read from memory once per group, not once
// per query head.
//
// bfloat16 caches at a level with AVX512-BF16 (group sizes <= 8, head_dim 64
// or 128) take attend_all_bf16: items are runs of a sequence's context over
// all heads (whole cache rows, read front to back), vdpbf16ps dot products,
// an online softmax per block, long contexts split into runs and merged.
// Everything else takes the float path, one item per (sequence, KV head).
//
// Numerics: scores and the softmax are float32 with the max subtracted; the
// value sum accumulates in float32. Only the order of additions (and, in the
// bfloat16 path, exp's last ulp) differs from the PyTorch reference
// (kernels/reference.py). bfloat16 query and K/V are read as float; only the
// output is rounded to bfloat16, once.

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
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
// bfloat16 K/V at a level with AVX512-BF16 (kernels/cpu_isa.py).
//
// One work item is a run of one sequence's context, for every head: the
// cache rows of a token (all KV heads side by side) are contiguous, so an
// item reads whole blocks front to back. Reading one KV head's slice of each
// row instead (the item split this kernel had before) turns a block into
// block_size short strided reads; on the Zen 4 EPYC that ran at 8-13 GB/s
// from DRAM where whole blocks stream at 15-30 GB/s (more for larger blocks).
// A long context is cut into runs (split-K, "flash decoding") when the batch
// alone would leave threads idle; the runs' partial softmaxes are merged.
//
// Per block, per KV head: q·k by vdpbf16ps on the bfloat16 pairs as stored
// (products of two bfloat16 are exact in float32, sums float32), sixteen
// tokens' dot products summed across lanes together (sum16), then an online
// softmax over the block (running max, rescaled sums) and the value rows
// widened to float once for the whole GQA group. Only the order of additions
// and the exp's last ulp differ from the float path below.
using Bf16 = c10::BFloat16;

// r[j] = the sum of a[j]'s sixteen lanes, for sixteen vectors at once: a
// transposing tree (45 shuffles and adds instead of sixteen 8-step reductions).
inline __m512 sum16(const __m512* a) {
  __m512 t[8];
  for (int i = 0; i < 8; ++i) {
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  }
  __m512 u[4];
  for (int i = 0; i < 4; ++i) {
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
  }
  __m512 v[2];
  for (int i = 0; i < 2; ++i) {
    v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], 0x88),
                       _mm512_shuffle_f32x4(v[0], v[1], 0xDD));
}

// How far ahead: one default block (16 tokens) was best on the Zen 4 EPYC
// (batch 16 x 1,024 tokens, 30 layers' caches in turn: 0.80 ms per call at 16
// tokens, 0.81 at 48, 0.87 at 96, 0.90 at 192).
constexpr int64_t kPrefetchTokens = 16;

inline void prefetch_row(const Bf16* row, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(p + line, _MM_HINT_T1);
}

inline __m512 widen_bf16(const Bf16* p) {
  return kvmesh::bf16_bits_to_float(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// A run's state per query head: running max, sum of exp(score - max), and the
// exp-weighted value sum (HEAD_DIM floats).
struct RunState {
  float* max;
  float* sum;
  float* acc;
};

// Tokens [begin, end) of one sequence, all heads. `scores`: GROUP x
// round_up(block_size, 16) floats of scratch.
template <int HEAD_DIM, int GROUP>
void attend_run_bf16(const Bf16* q, int64_t q_head, const Bf16* k_cache, const Bf16* v_cache,
                     const int64_t* table, int64_t begin, int64_t end, int64_t block_size,
                     int64_t num_kv_heads, float scale, float* scores, RunState state) {
  constexpr int kPairs = HEAD_DIM / 32;   // zmm of bfloat16 pairs per head row
  constexpr int kFloats = HEAD_DIM / 16;  // zmm of float per head row
  const int64_t row_stride = num_kv_heads * HEAD_DIM;
  const int64_t tile_stride = (block_size + 15) / 16 * 16;
  const int64_t num_heads = num_kv_heads * GROUP;
  for (int64_t h = 0; h < num_heads; ++h) {
    state.max[h] = -INFINITY;
    state.sum[h] = 0.f;
    std::fill(state.acc + h * HEAD_DIM, state.acc + (h + 1) * HEAD_DIM, 0.f);
  }
  const int64_t row_bytes = row_stride * static_cast<int64_t>(sizeof(Bf16));
  int64_t fetched = begin;
  for (int64_t start = begin; start < end;) {
    const int64_t offset = start % block_size;
    const int64_t n = std::min(block_size - offset, end - start);
    const int64_t first_row = table[start / block_size] * block_size + offset;
    const Bf16* k_block = k_cache + first_row * row_stride;
    const Bf16* v_block = v_cache + first_row * row_stride;
    // Rows kPrefetchTokens ahead, asked for (into L2) while this block is
    // computed: blocks are scattered through the cache, so the hardware
    // prefetcher stops at each block's end.
    const int64_t fetch_to = std::min(end, start + n + kPrefetchTokens);
    const int64_t fetch_from = std::max(fetched, start + n);
    fetched = std::max(fetched, fetch_to);
    for (int64_t kv = 0; kv < num_kv_heads; ++kv) {
      // This head's share of the prefetching.
      const int64_t count = std::max<int64_t>(0, fetch_to - fetch_from);
      const int64_t lo = fetch_from + count * kv / num_kv_heads;
      const int64_t hi = fetch_from + count * (kv + 1) / num_kv_heads;
      for (int64_t t = lo; t < hi; ++t) {
        const int64_t row = table[t / block_size] * block_size + t % block_size;
        prefetch_row(k_cache + row * row_stride, row_bytes);
        prefetch_row(v_cache + row * row_stride, row_bytes);
      }
      const Bf16* k_head = k_block + kv * HEAD_DIM;
      const Bf16* v_head = v_block + kv * HEAD_DIM;
      // Scores for the block: s[g][j] = q_g · k_j * scale.
      __m512bh qv[GROUP][kPairs];
      for (int g = 0; g < GROUP; ++g) {
        const Bf16* qg = q + (kv * GROUP + g) * q_head;
        for (int c = 0; c < kPairs; ++c) qv[g][c] = (__m512bh)_mm512_loadu_si512(qg + 32 * c);
      }
      for (int64_t t0 = 0; t0 < n; t0 += 16) {
        const int m = static_cast<int>(std::min<int64_t>(16, n - t0));
        for (int g = 0; g < GROUP; ++g) {
          __m512 dots[16];
          for (int j = 0; j < 16; ++j) {
            if (j < m) {
              const Bf16* k = k_head + (t0 + j) * row_stride;
              __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0],
                                            (__m512bh)_mm512_loadu_si512(k));
              for (int c = 1; c < kPairs; ++c) {
                acc = _mm512_dpbf16_ps(acc, qv[g][c], (__m512bh)_mm512_loadu_si512(k + 32 * c));
              }
              dots[j] = acc;
            } else {
              dots[j] = _mm512_setzero_ps();
            }
          }
          _mm512_storeu_ps(scores + g * tile_stride + t0,
                           _mm512_mul_ps(sum16(dots), _mm512_set1_ps(scale)));
        }
      }
      // Online softmax over the block: p = exp(s - new max), the old sums
      // rescaled by exp(old max - new max).
      __m512 acc[GROUP][kFloats];
      for (int g = 0; g < GROUP; ++g) {
        const int64_t h = kv * GROUP + g;
        float* s = scores + g * tile_stride;
        __m512 vmax = _mm512_set1_ps(-INFINITY);
        for (int64_t t0 = 0; t0 < n; t0 += 16) {
          const __mmask16 valid = n - t0 >= 16 ? 0xFFFF : (__mmask16)((1u << (n - t0)) - 1);
          vmax = _mm512_mask_max_ps(vmax, valid, vmax, _mm512_loadu_ps(s + t0));
        }
        const float block_max = _mm512_reduce_max_ps(vmax);
        const float new_max = std::max(state.max[h], block_max);
        const float rescale = state.max[h] == -INFINITY ? 0.f : std::exp(state.max[h] - new_max);
        const kvmesh::Vec16 shift = kvmesh::Vec16::splat(new_max);
        __m512 vsum = _mm512_setzero_ps();
        for (int64_t t0 = 0; t0 < n; t0 += 16) {
          const __mmask16 valid = n - t0 >= 16 ? 0xFFFF : (__mmask16)((1u << (n - t0)) - 1);
          const kvmesh::Vec16 p =
              kvmesh::exp16<true>(kvmesh::Vec16{_mm512_loadu_ps(s + t0)} - shift);
          const __m512 kept = _mm512_maskz_mov_ps(valid, p.v);
          _mm512_storeu_ps(s + t0, kept);
          vsum = _mm512_add_ps(vsum, kept);
        }
        state.sum[h] = state.sum[h] * rescale + _mm512_reduce_add_ps(vsum);
        state.max[h] = new_max;
        const __m512 r = _mm512_set1_ps(rescale);
        for (int i = 0; i < kFloats; ++i) {
          acc[g][i] = _mm512_mul_ps(_mm512_loadu_ps(state.acc + h * HEAD_DIM + 16 * i), r);
        }
      }
      // Values: each row widened once for the group.
      for (int64_t j = 0; j < n; ++j) {
        const Bf16* v = v_head + j * row_stride;
        __m512 vf[kFloats];
        for (int i = 0; i < kFloats; ++i) vf[i] = widen_bf16(v + 16 * i);
        for (int g = 0; g < GROUP; ++g) {
          const __m512 p = _mm512_set1_ps(scores[g * tile_stride + j]);
          for (int i = 0; i < kFloats; ++i) acc[g][i] = _mm512_fmadd_ps(p, vf[i], acc[g][i]);
        }
      }
      for (int g = 0; g < GROUP; ++g) {
        float* a = state.acc + (kv * GROUP + g) * HEAD_DIM;
        for (int i = 0; i < kFloats; ++i) _mm512_storeu_ps(a + 16 * i, acc[g][i]);
      }
    }
    start += n;
  }
}

template <int HEAD_DIM>
using RunBf16Fn = void (*)(const Bf16*, int64_t, const Bf16*, const Bf16*, const int64_t*, int64_t,
                           int64_t, int64_t, int64_t, float, float*, RunState);

template <int HEAD_DIM>
RunBf16Fn<HEAD_DIM> run_bf16_for(int64_t group) {
  switch (group) {
    case 1: return &attend_run_bf16<HEAD_DIM, 1>;
    case 2: return &attend_run_bf16<HEAD_DIM, 2>;
    case 3: return &attend_run_bf16<HEAD_DIM, 3>;
    case 4: return &attend_run_bf16<HEAD_DIM, 4>;
    case 5: return &attend_run_bf16<HEAD_DIM, 5>;
    case 6: return &attend_run_bf16<HEAD_DIM, 6>;
    case 7: return &attend_run_bf16<HEAD_DIM, 7>;
    case 8: return &attend_run_bf16<HEAD_DIM, 8>;
    default: return nullptr;
  }
}

// Tokens per run: whole blocks, long enough that a run's merge and prefetch
// start-up are noise, short enough that the batch makes a few runs per thread.
inline int64_t run_length(const int64_t* lens, int64_t num_decodes, int64_t block_size) {
  constexpr int64_t kMinRun = 256;
  constexpr int64_t kRunsPerThread = 4;
  int64_t total = 0;
  for (int64_t i = 0; i < num_decodes; ++i) total += lens[i];
  const int64_t wanted = kRunsPerThread * std::max<int64_t>(1, at::get_num_threads());
  const int64_t tokens = std::max(kMinRun, (total + wanted - 1) / wanted);
  return (tokens + block_size - 1) / block_size * block_size;
}

// Every decode over its runs, then the runs of each split sequence merged.
// Returns false (nothing written) when this path does not cover the shape.
template <int HEAD_DIM>
bool attend_all_bf16(Bf16* out_base, const Bf16* q_base, const Bf16* k_cache, const Bf16* v_cache,
                     const int64_t* tables, const int64_t* lens, const int64_t* row_ids,
                     int64_t num_decodes, int64_t num_kv_heads, int64_t group, int64_t max_blocks,
                     int64_t block_size, int64_t q_tok, int64_t q_head, int64_t o_tok,
                     int64_t o_head, float scale) {
  const RunBf16Fn<HEAD_DIM> fn = run_bf16_for<HEAD_DIM>(group);
  if (fn == nullptr) return false;
  const int64_t num_heads = num_kv_heads * group;
  const int64_t run = run_length(lens, num_decodes, block_size);
  // Run i covers tokens [(i - first_run[seq]) * run, ...) of its sequence.
  std::vector<int64_t> first_run(num_decodes + 1, 0);
  for (int64_t i = 0; i < num_decodes; ++i) {
    first_run[i + 1] = first_run[i] + (lens[i] + run - 1) / run;
  }
  const int64_t num_runs = first_run[num_decodes];
  // Per run and head: max, sum, and HEAD_DIM floats of weighted values.
  const int64_t state_floats = num_heads * (HEAD_DIM + 2);
  std::vector<float> states(num_runs * state_floats);
  std::vector<int64_t> seq_of(num_runs);
  for (int64_t i = 0; i < num_decodes; ++i) {
    std::fill(seq_of.begin() + first_run[i], seq_of.begin() + first_run[i + 1], i);
  }
  const int64_t tile_stride = (block_size + 15) / 16 * 16;
  kvmesh::parallel_items(num_runs, [&](int64_t item, bool) {
    thread_local std::vector<float> scores;
    scores.resize(group * tile_stride);
    const int64_t seq = seq_of[item];
    const int64_t begin = (item - first_run[seq]) * run;
    const int64_t end = std::min(lens[seq], begin + run);
    float* state = states.data() + item * state_floats;
    fn(q_base + row_ids[seq] * q_tok, q_head, k_cache, v_cache, tables + seq * max_blocks, begin,
       end, block_size, num_kv_heads, scale, scores.data(),
       RunState{state, state + num_heads, state + 2 * num_heads});
  });
  // out = sum_r exp(max_r - M) acc_r / sum_r exp(max_r - M) sum_r, M = max_r max_r.
  kvmesh::parallel_items(num_decodes * num_heads, [&](int64_t item, bool) {
    const int64_t seq = item / num_heads, h = item % num_heads;
    float global_max = -INFINITY;
    for (int64_t r = first_run[seq]; r < first_run[seq + 1]; ++r) {
      global_max = std::max(global_max, states[r * state_floats + h]);
    }
    float total = 0.f;
    __m512 acc[HEAD_DIM / 16];
    for (auto& a : acc) a = _mm512_setzero_ps();
    for (int64_t r = first_run[seq]; r < first_run[seq + 1]; ++r) {
      const float* state = states.data() + r * state_floats;
      const float weight = std::exp(state[h] - global_max);
      total += weight * state[num_heads + h];
      const float* a = state + 2 * num_heads + h * HEAD_DIM;
      for (int i = 0; i < HEAD_DIM / 16; ++i) {
        acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(weight), _mm512_loadu_ps(a + 16 * i), acc[i]);
      }
    }
    Bf16* o = out_base + row_ids[seq] * o_tok + h * o_head;
    const __m512 inv = _mm512_set1_ps(1.f / total);
    for (int i = 0; i < HEAD_DIM / 16; ++i) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16 * i),
                          kvmesh::float_to_bf16_bits(_mm512_mul_ps(acc[i], inv)));
    }
  });
  return true;
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

#if defined(__AVX512BF16__)
  if (query.scalar_type() == at::kBFloat16) {
    auto* out_ptr = out.data_ptr<Bf16>();
    const auto* q_ptr = query.data_ptr<Bf16>();
    const auto* k_ptr = key_cache.data_ptr<Bf16>();
    const auto* v_ptr = value_cache.data_ptr<Bf16>();
    const bool done =
        head_dim == 64
            ? attend_all_bf16<64>(out_ptr, q_ptr, k_ptr, v_ptr, tables, lens, row_ids, num_decodes,
                                  num_kv_heads, group, max_blocks, block_size, query.stride(0),
                                  query.stride(1), out.stride(0), out.stride(1), scale_f)
        : head_dim == 128
            ? attend_all_bf16<128>(out_ptr, q_ptr, k_ptr, v_ptr, tables, lens, row_ids,
                                   num_decodes, num_kv_heads, group, max_blocks, block_size,
                                   query.stride(0), query.stride(1), out.stride(0),
                                   out.stride(1), scale_f)
            : false;
    if (done) return;
  }
#endif
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
