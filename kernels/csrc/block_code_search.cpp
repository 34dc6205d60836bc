// Exact 8-bit block codes of a float32 weight, found in one pass over it.
//
// kernels/block_codes.py's torch version of the search makes a dozen passes
// over the whole tensor (a guess, its codes, the rebuilt weights, the compare,
// the masks), about 3 s per load of SmolLM2-135M, at every worker start. Here
// each 32-wide block is read once, tries the guesses in the caller's order
// while it is in L1, and stops at the first that rebuilds it exactly: the same
// per-block answer as the torch version (whose guess i only sees the blocks no
// earlier guess rebuilt).
//
// Built with -ffp-contract=off (kernels/native.py): every product is rounded
// before its sum, as torch's separate ops round them, so "exact" means what it
// means there. Rounding is std::nearbyint in the default mode, half to even, as
// torch.round.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;
// Three layouts (affine 4-bit, symmetric 8-bit, signed 4-bit) x four roundings
// of the scale (float16 nearest, as computed, float16 one ulp below, above),
// numbered as kernels/block_codes.py's _guesses lists them.
constexpr int64_t kNumGuesses = 12;
constexpr int64_t kMinBlocksPerTask = 2048;

float to_half(float value) { return static_cast<float>(c10::Half(value)); }

// torch.nextafter on a float16 value (given as float), one ulp toward +inf or -inf.
float half_next(float value, bool up) {
  if (std::isnan(value)) return value;
  c10::Half half(value);
  uint16_t bits = half.x;
  const bool negative = bits & 0x8000;
  const uint16_t magnitude = bits & 0x7fff;
  if (magnitude == 0) {
    bits = up ? 0x0001 : 0x8001;  // the smallest subnormal of the direction's sign
  } else if (magnitude == 0x7c00 && negative != up) {
    // +inf up, -inf down: stays.
  } else if (negative == up) {
    bits -= 1;  // toward zero
  } else {
    bits += 1;  // away from zero
  }
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

struct Guess {
  float scale, offset;
  int code_min, code_max;
};

Guess make_guess(int64_t index, float low, float high) {
  const int64_t layout = index / 4, rounding = index % 4;
  const float amax = std::max(std::fabs(high), std::fabs(low));
  const float signed_max = std::fabs(high) >= std::fabs(low) ? high : low;
  const float value = layout == 0 ? (high - low) / 15.0f : layout == 1 ? amax / 127.0f : signed_max / -8.0f;
  const float half = to_half(value);
  const float scale = rounding == 0 ? half : rounding == 1 ? value : half_next(half, rounding == 3);
  if (layout == 0) return {scale, low, 0, 15};
  if (layout == 1) return {scale, 0.0f, -128, 127};
  return {scale, -8.0f * scale, 0, 15};
}

// Codes of one block under ``guess`` into ``codes`` (stored form: code - code_min);
// false when some weight does not come back bit for bit.
bool try_guess(const float* block, const Guess& guess, uint8_t* codes) {
  const float safe = guess.scale == 0.0f ? 1.0f : guess.scale;
  for (int64_t i = 0; i < kBlock; ++i) {
    float code = std::nearbyint((block[i] - guess.offset) / safe);
    // torch.clamp: NaN stays NaN (and then fails the compare).
    if (code < guess.code_min) code = static_cast<float>(guess.code_min);
    if (code > guess.code_max) code = static_cast<float>(guess.code_max);
    if (guess.scale == 0.0f) code = 0.0f;
    const float rebuilt = code * guess.scale + guess.offset;
    if (!(rebuilt == block[i])) return false;
    codes[i] = static_cast<uint8_t>(static_cast<int>(code) - guess.code_min);
  }
  return true;
}

// weight [blocks, 32] float32 contiguous; order: guess indices to try, best first.
// Returns (codes [blocks, 32] uint8, scales [blocks], offsets [blocks] float32,
// solved): solved is false as soon as one block is no guess's exact image (or
// holds a non-finite weight), and the other outputs are then meaningless.
std::tuple<at::Tensor, at::Tensor, at::Tensor, bool> search_block_codes(const at::Tensor& blocks,
                                                                        at::IntArrayRef order) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.size(1) == kBlock && blocks.scalar_type() == at::kFloat &&
                  blocks.is_contiguous() && blocks.device().is_cpu(),
              "search_block_codes: blocks must be contiguous float32 [num_blocks, 32] on CPU");
  TORCH_CHECK(!order.empty(), "search_block_codes: no guess to try");
  for (int64_t index : order) {
    TORCH_CHECK(index >= 0 && index < kNumGuesses, "search_block_codes: guess ", index, " out of range");
  }
  const std::vector<int64_t> guesses(order.begin(), order.end());
  const int64_t num_blocks = blocks.size(0);
  at::Tensor codes = at::empty({num_blocks, kBlock}, blocks.options().dtype(at::kByte));
  at::Tensor scales = at::empty({num_blocks}, blocks.options());
  at::Tensor offsets = at::empty({num_blocks}, blocks.options());
  const float* in = blocks.data_ptr<float>();
  uint8_t* codes_out = codes.data_ptr<uint8_t>();
  float* scales_out = scales.data_ptr<float>();
  float* offsets_out = offsets.data_ptr<float>();
  std::atomic<bool> failed{false};
  at::parallel_for(0, num_blocks, kMinBlocksPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      if (failed.load(std::memory_order_relaxed)) return;
      const float* block = in + b * kBlock;
      float low = block[0], high = block[0];
      bool finite = true;
      for (int64_t i = 0; i < kBlock; ++i) {
        finite = finite && std::isfinite(block[i]);
        low = std::min(low, block[i]);
        high = std::max(high, block[i]);
      }
      bool solved = false;
      if (finite) {
        for (int64_t index : guesses) {
          const Guess guess = make_guess(index, low, high);
          if (try_guess(block, guess, codes_out + b * kBlock)) {
            scales_out[b] = guess.scale;
            offsets_out[b] = guess.offset + static_cast<float>(guess.code_min) * guess.scale;
            solved = true;
            break;
          }
        }
      }
      if (!solved) {
        failed.store(true, std::memory_order_relaxed);
        return;
      }
    }
  });
  return {codes, scales, offsets, !failed.load()};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("search_block_codes(Tensor blocks, int[] order) -> (Tensor, Tensor, Tensor, bool)");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("search_block_codes", &search_block_codes); }
