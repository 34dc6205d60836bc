"""Find, prove and pack the 8-bit block codes hidden in float32 weights.

A checkpoint converted from a block-quantized file (GGUF Q4_1, Q8_0, ...) has
float32 weights that are exactly ``code * scale + offset`` with one scale and
offset per 32 consecutive input features and small integer codes. Storing the
codes (1 byte) instead of the floats (4 bytes) is lossless for such weights,
and it is what makes small-batch decode matmuls faster: they are bound by
reading the weights (kernels/csrc/block_code_linear.cpp).

``find_block_codes`` tries, for every 32-wide block at once, the two layouts
such files use, with the scale as stored (float16) or as computed:

* affine, codes 0..15 (Q4_1): offset = the block's minimum, scale = range / 15;
* symmetric, codes -127..127 (Q8_0): scale = max |w| / 127, stored as
  code + 128 with offset = -128 * scale;

then rebuilds every weight as ``code * scale + offset`` in float32 — the
product is exact (at most 19 significant bits), so the one rounding of the sum
is what the kernel's fused multiply-add computes too — and keeps the result
only if *every* weight of the tensor comes back bit-for-bit. Anything else
(a weight fine-tuned after quantization, a checkpoint that never was
quantized) returns None and stays on the dense path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.math_utils import cdiv

BLOCK = 32  # input features per scale/offset
LANES = 16  # output features per kernel panel


@dataclass(frozen=True)
class BlockCodes:
    """Weights ``[out_features, in_features]`` as codes in the kernel's panel layout."""

    codes: torch.Tensor  # [panels, in_features, 16] uint8
    scales: torch.Tensor  # [panels, in_features / 32, 16] float32
    offsets: torch.Tensor  # [panels, in_features / 32, 16] float32
    out_features: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.offsets))

    def dequantize(self) -> torch.Tensor:
        """The float32 weights these codes stand for (for tests and checks)."""
        panels, in_features, _ = self.codes.shape
        scales = self.scales.repeat_interleave(BLOCK, dim=1)
        offsets = self.offsets.repeat_interleave(BLOCK, dim=1)
        weight = torch.addcmul(offsets.double(), self.codes.double(), scales.double()).float()
        weight = weight.permute(0, 2, 1).reshape(panels * LANES, in_features)
        return weight[: self.out_features]


def _float16_candidates(value: torch.Tensor) -> list[torch.Tensor]:
    """``value`` itself and its float16 roundings one ulp apart: the stored scale."""
    half = value.half()
    below = torch.nextafter(half, torch.full_like(half, float("-inf")))
    above = torch.nextafter(half, torch.full_like(half, float("inf")))
    return [half.float(), value, below.float(), above.float()]


def _try_layout(
    blocks: torch.Tensor,
    offset: torch.Tensor,
    scale: torch.Tensor,
    code_min: int,
    code_max: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes, stored offsets and a per-block "rebuilt exactly" mask for one layout guess."""
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = ((blocks - offset) / safe).round_().clamp_(code_min, code_max)
    codes = torch.where(scale == 0, torch.zeros_like(codes), codes)
    rebuilt = codes * scale + offset  # exact product, one rounding: the kernel's fma
    exact = (rebuilt == blocks).all(dim=-1)
    return codes - code_min, offset + code_min * scale, exact


Guess = tuple[torch.Tensor, torch.Tensor, int, int]  # offset, scale, code_min, code_max


def _guesses(blocks: torch.Tensor) -> list[Guess]:
    """One guess per layout and scale rounding, for every block at once."""
    low = blocks.amin(dim=-1, keepdim=True)
    high = blocks.amax(dim=-1, keepdim=True)
    amax = torch.maximum(high.abs(), low.abs())
    zero = torch.zeros_like(low)
    return [
        # Affine 4-bit (Q4_1): the minimum is the offset, code 15 the maximum.
        *((low, scale, 0, 15) for scale in _float16_candidates((high - low) / 15)),
        # Symmetric 8-bit (Q8_0): codes -127..127 stored shifted by 128.
        *((zero, scale, -128, 127) for scale in _float16_candidates(amax / 127)),
    ]


def find_block_codes(weight: torch.Tensor) -> BlockCodes | None:
    """Exact 8-bit block codes for a 2-D float32 CPU weight, or None if it has none."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    out_features, in_features = weight.shape
    if in_features % BLOCK or not bool(torch.isfinite(weight).all()):
        return None
    blocks = weight.reshape(-1, BLOCK)  # every 32-wide block of every row
    codes = torch.empty(blocks.shape, dtype=torch.uint8)
    scales = torch.empty(blocks.shape[0], dtype=torch.float32)
    offsets = torch.empty(blocks.shape[0], dtype=torch.float32)
    unsolved = torch.arange(blocks.shape[0])
    # Each guess looks only at the blocks no earlier guess rebuilt. Guesses go
    # in the order they fare on a sample: one of them solves (nearly) every
    # block of a quantized checkpoint, and it should run first.
    sample = blocks[:: max(1, blocks.shape[0] // 256)]
    sample_guesses = _guesses(sample)
    order = sorted(
        range(len(sample_guesses)),
        key=lambda i: -int(_try_layout(sample, *sample_guesses[i])[2].sum()),
    )
    for step, index in enumerate(order):
        rest = blocks if step == 0 else blocks[unsolved]
        offset, scale, code_min, code_max = _guesses(rest)[index]
        found, stored_offset, exact = _try_layout(rest, offset, scale, code_min, code_max)
        done = unsolved[exact]
        codes[done] = found[exact].to(torch.uint8)
        scales[done] = scale[exact].squeeze(-1)
        offsets[done] = stored_offset[exact].squeeze(-1)
        unsolved = unsolved[~exact]
        if unsolved.numel() == 0:
            break
    else:
        return None  # some block is no layout's exact image: keep the dense weight
    num_blocks = in_features // BLOCK
    return _to_panels(
        codes.view(out_features, in_features),
        scales.view(out_features, num_blocks),
        offsets.view(out_features, num_blocks),
    )


def _to_panels(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> BlockCodes:
    out_features = codes.shape[0]
    panels = cdiv(out_features, LANES)
    pad = panels * LANES - out_features

    def panel(t: torch.Tensor) -> torch.Tensor:
        t = t.reshape(out_features, -1)
        if pad:
            t = torch.cat([t, t.new_zeros(pad, t.shape[1])])
        return t.view(panels, LANES, -1).permute(0, 2, 1).contiguous()

    return BlockCodes(
        codes=panel(codes),
        scales=panel(scales),
        offsets=panel(offsets),
        out_features=out_features,
    )
