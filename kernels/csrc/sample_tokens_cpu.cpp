// Random sampling of each row of float32 logits, for CPU: temperature, min_p,
// top_k and top_p, from one uniform number per row, threads over rows.
//
// Why: the torch sampler drew an exponential per vocabulary entry
// (Tensor.exponential_, ~65 ns each on the 2-core Zen 2 EPYC: 52 ms for 16 x
// 49,152) and sorted the whole vocabulary for top_p (190 ms at batch 16).
// Here a row costs two vectorized passes over its logits (the maximum, then
// exp((x - max) / T) into a scratch row with partial sums), and the token is
// found by inverse transform sampling: the first index whose cumulative weight
// (in index order, over the kept tokens) passes u * total, for one u per row.
//
// Every filter keeps the tokens at or above a logit threshold, so they compose
// as one threshold plus, for top_p, a tie rule (tokens ordered by logit, then
// index, the nucleus being a prefix of that order):
// - min_p keeps exp((x - max) / T) >= min_p (p >= min_p * p_max);
// - top_k keeps x >= the k-th largest logit (ties at it kept). No sort: the
//   k-th largest of the rows' chunk maxima (kChunk tokens each) is a lower
//   bound for it (k distinct tokens reach it), so only the few chunks whose
//   maximum reaches that bound are searched, and nth_element picks the exact
//   value among their tokens;
// - top_p keeps a token when the kept mass strictly above it is < top_p times
//   the kept mass. The top 64 tokens (found as for top_k) are sorted (as far
//   as the walk goes) and walked: a peaked row's nucleus ends there. Past
//   them (flat rows: random-weight models, temperature 1, nuclei of thousands
//   of tokens) a radix selection finds the nucleus exactly without a sort
//   (nucleus_by_buckets): one pass sums the weights into 4,096 slices of
//   (x - max) / T, the slice where the mass reaches the target is found from
//   the top, and only its tokens are sorted. (It replaced a guess at the top
//   512 and a bisection over the weights' float bits, ~30 passes over the
//   row: 0.30 ms a flat row against 0.04 ms for plain temperature.)
// Greedy rows (temperature <= 0) take the first maximum, as greedy_argmax.
// A row with a NaN returns its first NaN, a row of -inf returns 0 and a row
// with +inf its first +inf: the argmax rules, as no distribution exists.
//
// Not built with -ffast-math: the -inf of masked tokens must compare as -inf.
// The two passes are written on Vec16 (vec16.h: exp16) from the avx2 level up
// (GCC left them scalar: 860 us a row of 49,152 instead of ~30); the generic
// level runs them as plain loops.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "work_stealing.h"

#if defined(__AVX2__) && defined(__FMA__)
#include "vec16.h"
#define KVMESH_SAMPLE_VEC16 1
#endif

namespace {

constexpr int64_t kChunk = 32;  // tokens per chunk maximum (candidate pre-selection)
constexpr int64_t kBlock = 512;  // tokens per partial sum (the inverse-CDF search)
// top_p's guess at the nucleus: the top 64 tokens (a peaked row's nucleus).
constexpr int64_t kTopPCandidates = 64;
// top_p's radix selection past the guess (nucleus_by_buckets): slices of z.
constexpr int32_t kBuckets = 4096;
constexpr int32_t kSubBuckets = 256;  // per bucket, at the second level
// exp(-87) ~ 1.6e-38 is a normal float; weights below it count as 0.
constexpr float kExpFloor = -87.f;
constexpr float kInf = std::numeric_limits<float>::infinity();
// The lowest finite float: a threshold that never keeps a -inf logit.
constexpr float kNoThreshold = -std::numeric_limits<float>::max();
constexpr float kBucketsPerUnit = kBuckets / -kExpFloor;

inline float bits_float(uint32_t bits) { return __builtin_bit_cast(float, bits); }

// exp(z) for z in [kExpFloor, 0]: z = n ln2 + r, |r| <= ln2 / 2, exp(r) by its
// degree-6 Taylor polynomial (relative error < 2e-7), times 2^n built in the
// exponent bits: exp16<true>'s steps, one lane at a time (the generic level).
inline float exp_nonpositive(float z) {
  const float n = (z * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round to nearest
  float r = z - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  return p * bits_float(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);
}

struct RowRequest {
  float inv_temperature;  // 0: greedy
  int64_t top_k;  // off when <= 0 or >= vocab
  float top_p;  // off at 1
  float min_p;  // off at 0
  double u;  // uniform in [0, 1)
};

// Per-thread scratch, grown once to the vocabulary.
struct Scratch {
  std::vector<float> weights;
  std::vector<float> chunk_max;
  std::vector<double> block_sum;
  std::vector<int32_t> candidates;
  std::vector<float> candidate_weights;
  std::vector<float> values;
  std::vector<int32_t> order;
  std::vector<int32_t> boundary_tokens;
  std::vector<float> boundary_weights;
  std::vector<int32_t> buckets;
  std::vector<double> bucket_mass;
  std::vector<int32_t> sub_buckets;
};

thread_local Scratch scratch;

// The nucleus as a prefix of the (logit descending, index ascending) order:
// the last token in it. Kept(i) iff x[i] > value or (x[i] == value and i <= index).
struct Cut {
  float value = -kInf;
  int64_t index = std::numeric_limits<int64_t>::max();
  bool keeps(float x, int64_t i) const { return x > value || (x == value && i <= index); }
};

#if defined(KVMESH_SAMPLE_VEC16)
using kvmesh::Vec16;

// e where x >= tau, z >= kExpFloor and e >= min_p; 0 in the other lanes.
inline Vec16 kept(Vec16 e, Vec16 x, Vec16 z, Vec16 tau, Vec16 floor, Vec16 min_p) {
#if defined(__AVX512F__)
  const __mmask16 keep = _mm512_cmp_ps_mask(x.v, tau.v, _CMP_GE_OQ) &
                         _mm512_cmp_ps_mask(z.v, floor.v, _CMP_GE_OQ) &
                         _mm512_cmp_ps_mask(e.v, min_p.v, _CMP_GE_OQ);
  return {_mm512_maskz_mov_ps(keep, e.v)};
#else
  auto half = [](__m256 e, __m256 x, __m256 z, __m256 t, __m256 f, __m256 p) {
    const __m256 keep = _mm256_and_ps(
        _mm256_and_ps(_mm256_cmp_ps(x, t, _CMP_GE_OQ), _mm256_cmp_ps(z, f, _CMP_GE_OQ)),
        _mm256_cmp_ps(e, p, _CMP_GE_OQ));
    return _mm256_and_ps(e, keep);
  };
  return {half(e.lo, x.lo, z.lo, tau.lo, floor.lo, min_p.lo),
          half(e.hi, x.hi, z.hi, tau.hi, floor.hi, min_p.hi)};
#endif
}
#endif

// Pass 1: each chunk's maximum; whether a NaN is in the row.
bool chunk_maxima(const float* x, int64_t vocab, Scratch& s) {
  const int64_t chunks = (vocab + kChunk - 1) / kChunk;
  s.chunk_max.resize(chunks);
  int64_t c = 0;
  bool suspect = false;  // a NaN or an infinity somewhere
#if defined(KVMESH_SAMPLE_VEC16)
  static_assert(kChunk == 32, "two Vec16 per chunk");
  // x * 0 is 0 for every finite x and NaN for NaN and both infinities.
  Vec16 poison = Vec16::zero();
  const Vec16 zero = Vec16::zero();
  for (const int64_t full = vocab / kChunk; c < full; ++c) {
    const Vec16 a = Vec16::load(x + c * kChunk), b = Vec16::load(x + c * kChunk + 16);
    s.chunk_max[c] = Vec16::max(a, b).reduce_max();
    poison = Vec16::fma(b, zero, Vec16::fma(a, zero, poison));
  }
  suspect = std::isnan(poison.reduce_add());
#endif
  for (; c < chunks; ++c) {
    const int64_t begin = c * kChunk, end = std::min(vocab, begin + kChunk);
    float m = -kInf;
    for (int64_t i = begin; i < end; ++i) {
      m = x[i] > m ? x[i] : m;
      suspect |= !std::isfinite(x[i]);
    }
    s.chunk_max[c] = m;
  }
  if (!suspect) return false;
  for (int64_t i = 0; i < vocab; ++i) {
    if (std::isnan(x[i])) return true;
  }
  return false;
}

// The first index whose logit equals `target` (present in the row; not NaN).
int64_t first_equal(const float* x, int64_t vocab, float target, const Scratch& s) {
  for (int64_t c = 0; c < static_cast<int64_t>(s.chunk_max.size()); ++c) {
    if (s.chunk_max[c] != target) continue;
    const int64_t begin = c * kChunk, end = std::min(vocab, begin + kChunk);
    for (int64_t i = begin; i < end; ++i) {
      if (x[i] == target) return i;
    }
  }
  return 0;
}

int64_t first_nan(const float* x, int64_t vocab) {
  for (int64_t i = 0; i < vocab; ++i) {
    if (std::isnan(x[i])) return i;
  }
  return 0;
}

// Fills s.candidates (index order) with every token whose logit is >= a bound
// that at least k tokens reach, and returns the k-th largest logit (kNoThreshold
// when fewer than k tokens are finite: then top_k keeps them all).
float select_top(const float* x, int64_t vocab, int64_t k, Scratch& s) {
  const int64_t chunks = static_cast<int64_t>(s.chunk_max.size());
  float bound = kNoThreshold;
  if (k <= chunks) {
    s.values.assign(s.chunk_max.begin(), s.chunk_max.end());
    std::nth_element(s.values.begin(), s.values.begin() + (k - 1), s.values.end(),
                     std::greater<float>());
    bound = std::max(s.values[k - 1], kNoThreshold);
  }
  s.candidates.clear();
  for (int64_t c = 0; c < chunks; ++c) {
    if (s.chunk_max[c] < bound) continue;
    const int64_t begin = c * kChunk, end = std::min(vocab, begin + kChunk);
    for (int64_t i = begin; i < end; ++i) {
      if (x[i] >= bound) s.candidates.push_back(static_cast<int32_t>(i));
    }
  }
  if (static_cast<int64_t>(s.candidates.size()) < k) return kNoThreshold;
  s.values.resize(s.candidates.size());
  for (size_t j = 0; j < s.candidates.size(); ++j) s.values[j] = x[s.candidates[j]];
  std::nth_element(s.values.begin(), s.values.begin() + (k - 1), s.values.end(),
                   std::greater<float>());
  return s.values[k - 1];
}

// Walks s.candidates (their weights in `weights`) by logit descending, index
// ascending, while the mass above stays below `target`. Returns the mass
// walked; `cut` is the last token taken.
double walk_nucleus(const float* x, const std::vector<int32_t>& tokens,
                    const std::vector<float>& weights, double target, Cut& cut, Scratch& s) {
  s.order.resize(tokens.size());
  for (size_t j = 0; j < tokens.size(); ++j) s.order[j] = static_cast<int32_t>(j);
  const auto before = [&](int32_t a, int32_t b) {
    const float xa = x[tokens[a]], xb = x[tokens[b]];
    return xa > xb || (xa == xb && tokens[a] < tokens[b]);
  };
  // Sorted only as far as the walk goes: a nucleus is often a few tokens.
  double above = 0;
  size_t sorted = 0;
  for (size_t j = 0; j < s.order.size(); ++j) {
    if (above >= target) break;
    if (j == sorted) {
      sorted = std::min(s.order.size(), std::max<size_t>(16, 4 * sorted));
      std::partial_sort(s.order.begin() + j, s.order.begin() + sorted, s.order.end(), before);
    }
    const int32_t k = s.order[j];
    cut.value = x[tokens[k]];
    cut.index = tokens[k];
    above += weights[k];
  }
  return above;
}

// The first token (in `tokens`' order, index ascending) whose cumulative weight
// among those `cut` keeps passes r; the last such token when rounding leaves
// the sum at r.
int64_t pick_among(const float* x, const std::vector<int32_t>& tokens,
                   const std::vector<float>& weights, const Cut& cut, double r) {
  double cumulative = 0;
  int64_t last = tokens.empty() ? 0 : tokens[0];
  for (size_t j = 0; j < tokens.size(); ++j) {
    const int64_t i = tokens[j];
    if (weights[j] <= 0.f || !cut.keeps(x[i], i)) continue;
    cumulative += weights[j];
    last = i;
    if (cumulative > r) return i;
  }
  return last;
}

// The first index whose cumulative weight passes r, by the block sums.
int64_t pick_in_row(const float* w, int64_t vocab, const Scratch& s, double r) {
  double cumulative = 0;
  int64_t last = -1;
  const int64_t blocks = static_cast<int64_t>(s.block_sum.size());
  for (int64_t b = 0; b < blocks; ++b) {
    if (s.block_sum[b] <= 0) continue;
    if (cumulative + s.block_sum[b] <= r && b + 1 < blocks) {
      cumulative += s.block_sum[b];
      continue;
    }
    const int64_t begin = b * kBlock, end = std::min(vocab, begin + kBlock);
    for (int64_t i = begin; i < end; ++i) {
      if (w[i] <= 0.f) continue;
      cumulative += w[i];
      last = i;
      if (cumulative > r) return i;
    }
  }
  if (last >= 0) return last;
  for (int64_t i = vocab - 1; i > 0; --i) {
    if (w[i] > 0.f) return i;
  }
  return 0;
}

// The weights of the tokens whose logit is >= `value`, in float lanes, summed
// in double.
double mass_at_or_above(const float* x, const float* w, int64_t n, float value) {
  double total = 0;
  int64_t i = 0;
#if defined(KVMESH_SAMPLE_VEC16)
  const __m256 tv = _mm256_set1_ps(value);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 keep = _mm256_cmp_ps(_mm256_loadu_ps(x + i), tv, _CMP_GE_OQ);
    acc = _mm256_add_ps(acc, _mm256_and_ps(_mm256_loadu_ps(w + i), keep));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (const float lane : lanes) total += lane;
#endif
  for (; i < n; ++i) total += x[i] >= value ? w[i] : 0.f;
  return total;
}

// Each token's bucket: floor((max - x) / T * kBucketsPerUnit), at most kBuckets - 1
// (monotone in x: the heaviest tokens in bucket 0).
void bucket_indices(const float* x, int64_t vocab, float m, float inv_t, int32_t* bucket) {
  int64_t i = 0;
  constexpr float last = kBuckets - 1;
#if defined(KVMESH_SAMPLE_VEC16)
  const __m256 mv = _mm256_set1_ps(m), inv_tv = _mm256_set1_ps(inv_t);
  const __m256 scale = _mm256_set1_ps(kBucketsPerUnit), lastv = _mm256_set1_ps(last);
  for (; i + 8 <= vocab; i += 8) {
    // -inf logits: (m - x) is +inf, clamped to the last bucket (they weigh 0).
    const __m256 v = _mm256_mul_ps(
        _mm256_mul_ps(_mm256_sub_ps(mv, _mm256_loadu_ps(x + i)), inv_tv), scale);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(bucket + i),
                        _mm256_cvttps_epi32(_mm256_min_ps(v, lastv)));
  }
#endif
  for (; i < vocab; ++i) {
    bucket[i] = static_cast<int32_t>(std::min((m - x[i]) * inv_t * kBucketsPerUnit, last));
  }
}

// The indices i with bucket[i] == b and a weight, appended to `tokens` (index order).
void tokens_in_bucket(const int32_t* bucket, const float* w, int64_t vocab, int32_t b,
                      std::vector<int32_t>& tokens) {
  int64_t i = 0;
#if defined(KVMESH_SAMPLE_VEC16)
  const __m256i bv = _mm256_set1_epi32(b);
  for (; i + 8 <= vocab; i += 8) {
    const __m256i eq =
        _mm256_cmpeq_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bucket + i)), bv);
    for (uint32_t bits = _mm256_movemask_ps(_mm256_castsi256_ps(eq)); bits; bits &= bits - 1) {
      const int64_t j = i + __builtin_ctz(bits);
      if (w[j] > 0.f) tokens.push_back(static_cast<int32_t>(j));
    }
  }
#endif
  for (; i < vocab; ++i) {
    if (bucket[i] == b && w[i] > 0.f) tokens.push_back(static_cast<int32_t>(i));
  }
}

// The first bucket where the running mass (from bucket 0) reaches `target`, and
// the mass before it in `above`; `n` when rounding left the whole mass short.
int32_t boundary_bucket(const double* mass, int32_t n, double target, double& above) {
  above = 0;
  for (int32_t b = 0; b < n; ++b) {
    if (above + mass[b] >= target) return b;
    above += mass[b];
  }
  return n;
}

// top_p when the nucleus is past the candidates (flat rows: thousands of
// tokens), exactly and without a sort of the row: a two-level radix
// selection on (max - x) / T, which orders the tokens as their logits do.
// Level 1 files every token into one of kBuckets equal slices of it (a
// vectorized pass) and sums each slice's weight in double (one scalar pass,
// into two copies so that runs of one bucket do not wait on each other); the
// slices, heaviest first, give the one where the mass reaches the target.
// Level 2 does the same over that slice's tokens only (a few hundred on a
// flat row of 49,152) with kSubBuckets finer slices, and only the tokens of
// the sub-slice reached (a handful) are sorted, by logit and index, and
// walked. The nucleus is every token before that sub-slice plus the walk's
// prefix: the tokens at or above the cut's logit, less its ties past the cut's
// index. The token is then picked in index order, by blocks of kept mass.
int64_t nucleus_by_buckets(const float* x, const float* w, int64_t vocab, float m, float inv_t,
                           double total, double target, double u, Scratch& s) {
  s.buckets.resize(vocab);
  int32_t* bucket = s.buckets.data();
  bucket_indices(x, vocab, m, inv_t, bucket);
  s.bucket_mass.assign(2 * kBuckets, 0.0);
  double* even = s.bucket_mass.data();
  double* odd = even + kBuckets;
  int64_t i = 0;
  for (; i + 1 < vocab; i += 2) {
    even[bucket[i]] += w[i];
    odd[bucket[i + 1]] += w[i + 1];
  }
  if (i < vocab) even[bucket[i]] += w[i];
  for (int32_t b = 0; b < kBuckets; ++b) even[b] += odd[b];
  double above = 0;
  const int32_t b = boundary_bucket(even, kBuckets, target, above);
  if (b == kBuckets) return pick_in_row(w, vocab, s, u * total);  // everything kept

  // Level 2: the slice's tokens, by kSubBuckets slices of its width.
  s.boundary_tokens.clear();
  tokens_in_bucket(bucket, w, vocab, b, s.boundary_tokens);
  s.sub_buckets.resize(s.boundary_tokens.size());
  double sub_mass[kSubBuckets] = {};
  for (size_t j = 0; j < s.boundary_tokens.size(); ++j) {
    const int32_t t = s.boundary_tokens[j];
    const float v = (m - x[t]) * inv_t * kBucketsPerUnit - static_cast<float>(b);
    const int32_t sub = std::clamp(static_cast<int32_t>(v * kSubBuckets), 0, kSubBuckets - 1);
    s.sub_buckets[j] = sub;
    sub_mass[sub] += w[t];
  }
  double above_sub = 0;
  const int32_t sb = boundary_bucket(sub_mass, kSubBuckets, target - above, above_sub);
  const bool short_of_target = sb == kSubBuckets;  // rounding: the whole slice is kept
  s.candidates.clear();
  s.candidate_weights.clear();
  for (size_t j = 0; j < s.boundary_tokens.size(); ++j) {
    if (short_of_target || s.sub_buckets[j] == sb) {
      s.candidates.push_back(s.boundary_tokens[j]);
      s.candidate_weights.push_back(w[s.boundary_tokens[j]]);
    }
  }
  if (short_of_target) above_sub = 0;
  Cut cut;
  const double walked =
      walk_nucleus(x, s.candidates, s.candidate_weights,
                   short_of_target ? kInf : target - above - above_sub, cut, s);
  const double kept = above + above_sub + walked;
  // Ties at the cut's logit past its index: in the walked sub-slice, left out.
  s.boundary_weights.clear();
  s.boundary_tokens.clear();
  for (size_t j = 0; j < s.candidates.size(); ++j) {
    const int32_t t = s.candidates[j];
    if (x[t] == cut.value && t > cut.index) {
      s.boundary_tokens.push_back(t);
      s.boundary_weights.push_back(w[t]);
    }
  }

  const double r = u * kept;
  double cumulative = 0;
  int64_t last = cut.index;
  const int64_t blocks = (vocab + kBlock - 1) / kBlock;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t begin = blk * kBlock, end = std::min(vocab, begin + kBlock);
    double block = mass_at_or_above(x + begin, w + begin, end - begin, cut.value);
    for (size_t j = 0; j < s.boundary_tokens.size(); ++j) {
      const int32_t t = s.boundary_tokens[j];
      if (t >= begin && t < end) block -= s.boundary_weights[j];
    }
    if (block <= 0 || (cumulative + block <= r && blk + 1 < blocks)) {
      cumulative += block;
      continue;
    }
    for (int64_t t = begin; t < end; ++t) {
      if (w[t] <= 0.f || !cut.keeps(x[t], t)) continue;
      cumulative += w[t];
      last = t;
      if (cumulative > r) return t;
    }
  }
  return last;
}

int64_t sample_row(const float* x, int64_t vocab, const RowRequest& rq, Scratch& s) {
  if (chunk_maxima(x, vocab, s)) return first_nan(x, vocab);
  const float m = *std::max_element(s.chunk_max.begin(), s.chunk_max.end());
  if (m == -kInf) return 0;
  if (rq.inv_temperature <= 0.f || m == kInf) return first_equal(x, vocab, m, s);

  const float inv_t = rq.inv_temperature, min_p = rq.min_p;
  const bool top_k = rq.top_k > 0 && rq.top_k < vocab;
  const bool top_p = rq.top_p < 1.f;
  const int64_t chunks = static_cast<int64_t>(s.chunk_max.size());

  if (top_k && rq.top_k <= chunks) {
    // Everything kept is among the candidates: weigh only them.
    const float tau = std::max(select_top(x, vocab, rq.top_k, s), kNoThreshold);
    s.candidate_weights.resize(s.candidates.size());
    double total = 0;
    for (size_t j = 0; j < s.candidates.size(); ++j) {
      const float xi = x[s.candidates[j]], z = (xi - m) * inv_t;
      float w = xi >= tau && z >= kExpFloor ? std::exp(z) : 0.f;
      w = w >= min_p ? w : 0.f;
      s.candidate_weights[j] = w;
      total += w;
    }
    Cut cut;
    double mass = total;
    if (top_p) {
      mass = walk_nucleus(x, s.candidates, s.candidate_weights, rq.top_p * total, cut, s);
    }
    return pick_among(x, s.candidates, s.candidate_weights, cut, rq.u * mass);
  }

  // Pass 2: every token's weight and the block sums.
  const float tau = top_k ? std::max(select_top(x, vocab, rq.top_k, s), kNoThreshold)
                          : kNoThreshold;
  s.weights.resize(vocab);
  float* w = s.weights.data();
  const int64_t blocks = (vocab + kBlock - 1) / kBlock;
  s.block_sum.resize(blocks);
  double total = 0;
#if defined(KVMESH_SAMPLE_VEC16)
  const Vec16 mv = Vec16::splat(m), inv_tv = Vec16::splat(inv_t), tauv = Vec16::splat(tau);
  const Vec16 floorv = Vec16::splat(kExpFloor), min_pv = Vec16::splat(min_p);
#endif
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * kBlock, end = std::min(vocab, begin + kBlock);
    int64_t i = begin;
    float sum = 0.f;
#if defined(KVMESH_SAMPLE_VEC16)
    Vec16 acc = Vec16::zero();
    for (; i + 16 <= end; i += 16) {
      const Vec16 xv = Vec16::load(x + i);
      const Vec16 z = (xv - mv) * inv_tv;
      const Vec16 e = kept(kvmesh::exp16<true>(z), xv, z, tauv, floorv, min_pv);
      e.store(w + i);
      acc = acc + e;
    }
    sum = acc.reduce_add();
#endif
    for (; i < end; ++i) {
      const float z = (x[i] - m) * inv_t;
      float weight = x[i] >= tau && z >= kExpFloor ? exp_nonpositive(z) : 0.f;
      weight = weight >= min_p ? weight : 0.f;
      w[i] = weight;
      sum += weight;
    }
    s.block_sum[b] = sum;
    total += sum;
  }
  if (!top_p) return pick_in_row(w, vocab, s, rq.u * total);

  // top_p: a peaked row's nucleus is within the top few dozen tokens.
  const double target = rq.top_p * total;
  select_top(x, vocab, std::min(kTopPCandidates, chunks), s);
  s.candidate_weights.resize(s.candidates.size());
  for (size_t j = 0; j < s.candidates.size(); ++j) s.candidate_weights[j] = w[s.candidates[j]];
  Cut cut;
  const double mass = walk_nucleus(x, s.candidates, s.candidate_weights, target, cut, s);
  if (mass >= target) return pick_among(x, s.candidates, s.candidate_weights, cut, rq.u * mass);
  return nucleus_by_buckets(x, w, vocab, m, inv_t, total, target, rq.u, s);
}

// u in [0, 1) from a key's low 63 bits (torch's random_() fills [0, 2^63)).
inline double uniform_from_key(int64_t key) {
  const uint64_t bits = static_cast<uint64_t>(key) & ((uint64_t{1} << 63) - 1);
  return static_cast<double>(bits >> 10) * 0x1.0p-53;
}

template <typename T>
const T* optional_column(const std::optional<at::Tensor>& column, at::ScalarType type,
                         int64_t rows, const char* name) {
  if (!column.has_value()) return nullptr;
  TORCH_CHECK(column->scalar_type() == type && column->dim() == 1 && column->size(0) == rows &&
                  column->is_contiguous(),
              "sample_tokens: ", name, " must be a contiguous [rows] tensor of ", type);
  return column->data_ptr<T>();
}

// logits [rows, vocab] float32 (unit vocab stride); temperature [rows] float32
// (<= 0: greedy); top_k [rows] int64, top_p and min_p [rows] float32, each
// optional; keys [rows] int64 (each row's uniform). -> [rows] int64.
at::Tensor sample_tokens(const at::Tensor& logits, const at::Tensor& temperature,
                         const std::optional<at::Tensor>& top_k,
                         const std::optional<at::Tensor>& top_p,
                         const std::optional<at::Tensor>& min_p, const at::Tensor& keys) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "sample_tokens: logits must be a float32 [rows, vocab] tensor with unit vocab "
              "stride");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab > 0 && vocab < (int64_t{1} << 31), "sample_tokens: vocabulary size ", vocab);
  const float* temp = optional_column<float>(temperature, at::kFloat, rows, "temperature");
  const int64_t* key = optional_column<int64_t>(keys, at::kLong, rows, "keys");
  const int64_t* k = optional_column<int64_t>(top_k, at::kLong, rows, "top_k");
  const float* p = optional_column<float>(top_p, at::kFloat, rows, "top_p");
  const float* mp = optional_column<float>(min_p, at::kFloat, rows, "min_p");
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* base = logits.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  int64_t* op = out.data_ptr<int64_t>();
  kvmesh::parallel_items(rows, [&](int64_t row, bool) {
    const RowRequest rq{
        temp[row] > 0.f ? 1.f / temp[row] : 0.f,
        k != nullptr ? k[row] : 0,
        p != nullptr ? p[row] : 1.f,
        mp != nullptr ? mp[row] : 0.f,
        uniform_from_key(key[row]),
    };
    op[row] = sample_row(base + row * stride, vocab, rq, scratch);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def(
      "sample_tokens(Tensor logits, Tensor temperature, Tensor? top_k, Tensor? top_p, "
      "Tensor? min_p, Tensor keys) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("sample_tokens", &sample_tokens); }
