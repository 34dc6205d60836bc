// A GGUF file's quantized blocks, as both GGUF kernels read them: the float
// one that rebuilds weights (ggml_block_linear.cpp) and the one that dots the
// weights' integer codes with int8 activations (ggml_q8_linear.cpp).
//
// One owner per fact of the file format: the ggml type numbers, each type's
// block size, the float16 scales, the K-quants' packed 6-bit sub-block scales
// and minimums, and where each weight's code sits in a block (its nibble and
// its fifth or sixth bit). The kernels differ only in what they do with them.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace kvmesh::ggml {

// ggml_type numbers (the GGUF file's tensor types).
enum Kind : int64_t {
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
};

struct Format {
  int64_t weights;  // per block
  int64_t bytes;    // per block
};

// The block format of a ggml type; {0, 0} for a type no kernel reads.
constexpr Format block_format(int64_t kind) {
  switch (kind) {
    case kQ4_0: return {32, 18};
    case kQ4_1: return {32, 20};
    case kQ5_0: return {32, 22};
    case kQ5_1: return {32, 24};
    case kQ8_0: return {32, 34};
    case kQ4_K: return {256, 144};
    case kQ5_K: return {256, 176};
    case kQ6_K: return {256, 210};
    default: return {0, 0};
  }
}

// block_format of a type from a caller's tensor list: an error naming `op`
// for a type no kernel reads.
inline Format format_of(int64_t kind, const char* op) {
  const Format f = block_format(kind);
  TORCH_CHECK(f.weights > 0, op, ": unsupported ggml type ", kind);
  return f;
}

// One segment of a caller's weights: uint8 [rows, K / weights * bytes], the
// blocks of each row back to back as in the file.
inline void check_segment(const at::Tensor& blocks, int64_t kind, int64_t K, const char* op) {
  const Format f = format_of(kind, op);
  TORCH_CHECK(K % f.weights == 0, op, ": K ", K, " is not a multiple of ", f.weights,
              " for ggml type ", kind);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous() &&
                  blocks.size(1) == K / f.weights * f.bytes,
              op, ": blocks must be contiguous uint8 [rows, ", K / f.weights * f.bytes, "]");
}

// A fused projection's output rows (its segments one after the other) cut
// into work items of at most `rows_per_item` rows, none across two segments
// (a segment has one type).
class SegmentItems {
 public:
  struct Item {
    size_t segment;
    int64_t row0;  // within the segment
    int64_t rows;
  };

  SegmentItems(at::TensorList blocks, int64_t rows_per_item)
      : first_item_(blocks.size() + 1, 0),
        first_row_(blocks.size() + 1, 0),
        rows_per_item_(rows_per_item) {
    for (size_t s = 0; s < blocks.size(); ++s) {
      const int64_t rows = blocks[s].size(0);
      first_item_[s + 1] = first_item_[s] + (rows + rows_per_item - 1) / rows_per_item;
      first_row_[s + 1] = first_row_[s] + rows;
    }
  }

  int64_t items() const { return first_item_.back(); }
  int64_t rows() const { return first_row_.back(); }
  // The output row (column of y) where segment s starts.
  int64_t first_row(size_t s) const { return first_row_[s]; }

  Item item(int64_t i) const {
    const size_t s =
        std::upper_bound(first_item_.begin(), first_item_.end(), i) - first_item_.begin() - 1;
    const int64_t row0 = (i - first_item_[s]) * rows_per_item_;
    return {s, row0, std::min(rows_per_item_, first_row_[s + 1] - first_row_[s] - row0)};
  }

 private:
  std::vector<int64_t> first_item_;  // [segments + 1]
  std::vector<int64_t> first_row_;   // [segments + 1]
  int64_t rows_per_item_;
};

// How far ahead of the row being dotted the decode kernels ask for weight
// bytes. A batch-1 step reads every weight once, from DRAM, and the hardware
// prefetcher alone kept too little in flight: measured on the 2-core Zen 2
// (benchmarks/decode_bandwidth.py's projections), one thread over Q5_0 rows
// went from 6.5 GB/s to 9.5 GB/s at 2-4 KiB ahead (a row-sized stride the
// prefetcher follows late), and further ahead gained nothing.
constexpr int64_t kPrefetchAheadBytes = 4096;

// Asks for the bytes of row r + ahead of a [rows, row_bytes] block tensor,
// ahead chosen so that they lie ~kPrefetchAheadBytes past row r; nothing
// past the last row. A hint only: results never depend on it.
inline void prefetch_row_ahead(const uint8_t* base, int64_t row_bytes, int64_t r, int64_t rows) {
  const int64_t ahead = (kPrefetchAheadBytes + row_bytes - 1) / row_bytes;
  if (r + ahead >= rows) return;
  const uint8_t* p = base + (r + ahead) * row_bytes;
  for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(p + o);
}

// The float16 at p (block scales sit at any byte offset: memcpy, not a cast).
inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
#if defined(__F16C__)
  return _cvtsh_ss(bits);  // one instruction; c10::Half's is a dozen, same value
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// Byte offsets in a legacy 32-weight block: the float16 d, then m (Q4_1,
// Q5_1), then Q5's 32 fifth bits (qh, 4 bytes), then 16 bytes of nibbles (qs).
struct LegacyLayout {
  bool five;  // a fifth bit per weight (Q5_0, Q5_1)
  int qh;     // where the fifth bits start (Q5 only)
  int qs;     // where the nibbles start
};

constexpr LegacyLayout legacy_layout(int64_t kind) {
  const bool five = kind == kQ5_0 || kind == kQ5_1;
  const int head = (kind == kQ4_0 || kind == kQ5_0) ? 2 : 4;  // d, or d and m
  return {five, head, head + (five ? 4 : 0)};
}

// Where a Q4_K/Q5_K super-block's 128 bytes of nibbles start: after d, dmin,
// the 12 bytes of scales and (Q5_K) 32 bytes of fifth bits at byte 16.
constexpr int kquant_nibbles_at(int64_t kind) { return kind == kQ4_K ? 16 : 48; }

// The 6-bit scale and minimum of sub-block j of a Q4_K/Q5_K super-block from
// its 12 packed bytes q (llama.cpp's get_scale_min_k4): sub-blocks 0-3 in the
// low 6 bits of bytes 0-7, sub-blocks 4-7 in nibbles of bytes 8-11 with their
// top 2 bits in the top bits of bytes 0-7.
inline void scale_min_k4(int j, const uint8_t* q, uint8_t& sc, uint8_t& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// The 32 codes of run r (weights 32 r .. 32 r + 31) of a block: unsigned,
// before any offset (Q4_0's -8, Q5_0's -16, Q6_K's -32), and Q8_0's signed
// int8 codes. Legacy blocks are one run (r = 0).
template <int64_t kind>
inline void run_codes(const uint8_t* blk, int r, int16_t* c) {
  if constexpr (kind == kQ4_0 || kind == kQ4_1 || kind == kQ5_0 || kind == kQ5_1) {
    // Weight l: nibble of qs[l % 16] (low for l < 16); Q5's fifth bit: bit l of qh.
    constexpr LegacyLayout at = legacy_layout(kind);
    uint32_t qh = 0;
    if constexpr (at.five) std::memcpy(&qh, blk + at.qh, sizeof(qh));
    const uint8_t* qs = blk + at.qs;
    for (int l = 0; l < 32; ++l) {
      const int nibble = l < 16 ? qs[l] & 0xF : qs[l - 16] >> 4;
      c[l] = static_cast<int16_t>(nibble | (((qh >> l) & 1u) << 4));
    }
  } else if constexpr (kind == kQ8_0) {
    const auto* qs = reinterpret_cast<const int8_t*>(blk + 2);
    for (int l = 0; l < 32; ++l) c[l] = qs[l];
  } else if constexpr (kind == kQ4_K || kind == kQ5_K) {
    // Byte l of 64-weight chunk r / 2: run r's weight l in the low nibble
    // (r even) or the high one; Q5_K's fifth bit of run r: bit r of qh[l].
    const uint8_t* qs = blk + kquant_nibbles_at(kind) + 32 * (r / 2);
    const uint8_t* qh = blk + 16;
    for (int l = 0; l < 32; ++l) {
      int v = r % 2 ? qs[l] >> 4 : qs[l] & 0xF;
      if (kind == kQ5_K) v |= ((qh[l] >> r) & 1) << 4;
      c[l] = static_cast<int16_t>(v);
    }
  } else {
    static_assert(kind == kQ6_K);
    // Run r: half h = r / 4, g = r % 4; low 4 bits in ql[64 h + 32 (g % 2) + l]
    // (nibble g / 2), high 2 bits in qh[32 h + l] (bits 2 g).
    const int h = r / 4, g = r % 4;
    const uint8_t* ql = blk + 64 * h + 32 * (g % 2);
    const uint8_t* qh = blk + 128 + 32 * h;
    for (int l = 0; l < 32; ++l) {
      const int low = g < 2 ? ql[l] & 0xF : ql[l] >> 4;
      c[l] = static_cast<int16_t>(low | (((qh[l] >> (2 * g)) & 3) << 4));
    }
  }
}

}  // namespace kvmesh::ggml
