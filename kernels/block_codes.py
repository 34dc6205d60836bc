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
* symmetric 4-bit (Q4_0): scale = the largest-magnitude weight / -8 (signed),
  codes 0..15 with offset = -8 * scale;

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

from kvmesh.kernels import native
from kvmesh.services.contracts.math_utils import cdiv

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
    signed_max = torch.where(high.abs() >= low.abs(), high, low)
    return [
        # Affine 4-bit (Q4_1): the minimum is the offset, code 15 the maximum.
        *((low, scale, 0, 15) for scale in _float16_candidates((high - low) / 15)),
        # Symmetric 8-bit (Q8_0): codes -127..127 stored shifted by 128.
        *((zero, scale, -128, 127) for scale in _float16_candidates(amax / 127)),
        # Symmetric 4-bit (Q4_0): code 0 is the largest-magnitude weight.
        *((-8 * scale, scale, 0, 15) for scale in _float16_candidates(signed_max / -8)),
    ]


def find_block_codes(weight: torch.Tensor, use_native: bool = True) -> BlockCodes | None:
    """Exact 8-bit block codes for a 2-D float32 CPU weight, or None if it has none.

    ``use_native``: search in C++ (kernels/csrc/block_code_search.cpp: one pass,
    same answer) where the ops are loaded; False forces the torch search (tests).
    """
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    out_features, in_features = weight.shape
    if in_features % BLOCK:
        return None
    blocks = weight.reshape(-1, BLOCK)  # every 32-wide block of every row
    # Guesses go in the order they fare on a sample: one of them solves (nearly)
    # every block of a quantized checkpoint, and it should run first. A non-finite
    # weight is no guess's exact image (NaN != NaN; an infinite scale gives NaN).
    sample = blocks[:: max(1, blocks.shape[0] // 256)]
    sample_exact = [_try_layout(sample, *guess)[2] for guess in _guesses(sample)]
    if not bool(torch.stack(sample_exact).any(dim=0).all()):
        # A sampled block no layout rebuilds: the tensor cannot be all codes
        # (the usual answer for a float checkpoint, found in a few microseconds).
        return None
    order = sorted(range(len(sample_exact)), key=lambda i: -int(sample_exact[i].sum()))
    if use_native and native.unavailable_reason() is None:
        codes, scales, offsets, solved = torch.ops.kvmesh.search_block_codes(
            blocks.contiguous(), order
        )
        if not solved:
            return None
    else:
        found = _search_with_torch(blocks, order)
        if found is None:
            return None
        codes, scales, offsets = found
    num_blocks = in_features // BLOCK
    return RowCodes(
        codes.view(out_features, in_features),
        scales.view(out_features, num_blocks),
        offsets.view(out_features, num_blocks),
    ).to_panels()


def _search_with_torch(
    blocks: torch.Tensor, order: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Codes, scales and offsets of every block, trying the guesses in ``order``
    (each only on the blocks no earlier guess rebuilt); None if some block is no
    guess's exact image."""
    if not bool(torch.isfinite(blocks).all()):
        return None
    codes = torch.empty(blocks.shape, dtype=torch.uint8)
    scales = torch.empty(blocks.shape[0], dtype=torch.float32)
    offsets = torch.empty(blocks.shape[0], dtype=torch.float32)
    unsolved = torch.arange(blocks.shape[0])
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
            return codes, scales, offsets
    return None  # some block is no layout's exact image: keep the dense weight


@dataclass(frozen=True)
class RowCodes:
    """Weights ``[out_features, in_features]`` as codes in plain row-major order.

    The form a weight has between reading and packing: rows can be sliced
    (tensor-parallel shards, a GGUF file's q/k row permutation), concatenated
    (fused q/k/v, gate/up) and looked up (an embedding) like a dense weight's,
    and ``to_panels`` lays them out for the kernel. ``code * scale + offset``
    is computed exactly as GGUF's own dequantization computes it (the product
    is exact, the sum rounds once), so the weights are the file's, bit for bit.
    """

    codes: torch.Tensor  # [out_features, in_features] uint8
    scales: torch.Tensor  # [out_features, in_features / 32] float32
    offsets: torch.Tensor  # [out_features, in_features / 32] float32

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.offsets))

    def __getitem__(self, key: slice | torch.Tensor | tuple[slice, slice]) -> RowCodes:
        """Rows (``w[rows]``), or whole 32-wide blocks of columns (``w[:, cols]``)."""
        if not isinstance(key, tuple):
            return RowCodes(self.codes[key], self.scales[key], self.offsets[key])
        rows, cols = key
        start, stop, step = cols.indices(self.codes.shape[1])
        if step != 1 or start % BLOCK or stop % BLOCK:
            raise ValueError(f"columns {cols} do not fall on {BLOCK}-wide code blocks")
        blocks = slice(start // BLOCK, stop // BLOCK)
        return RowCodes(
            self.codes[rows, cols], self.scales[rows, blocks], self.offsets[rows, blocks]
        )

    @staticmethod
    def cat(parts: list[RowCodes]) -> RowCodes:
        return RowCodes(
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scales for p in parts]),
            torch.cat([p.offsets for p in parts]),
        )

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """The float32 rows ``ids`` (an embedding lookup without a dense table)."""
        codes = self.codes[ids].float().unflatten(-1, (-1, BLOCK))
        weight = codes.mul_(self.scales[ids].unsqueeze(-1)).add_(self.offsets[ids].unsqueeze(-1))
        return weight.flatten(-2)

    def dequantize(self) -> torch.Tensor:
        """The float32 weights (mixing with a dense part of a fused weight, tests)."""
        return self.embedding(torch.arange(self.codes.shape[0]))

    def to_panels(self) -> BlockCodes:
        out_features = self.codes.shape[0]
        panels = cdiv(out_features, LANES)
        pad = panels * LANES - out_features

        def panel(t: torch.Tensor) -> torch.Tensor:
            if pad:
                t = torch.cat([t, t.new_zeros(pad, t.shape[1])])
            return t.view(panels, LANES, -1).permute(0, 2, 1).contiguous()

        return BlockCodes(
            codes=panel(self.codes),
            scales=panel(self.scales.float()),
            offsets=panel(self.offsets.float()),
            out_features=out_features,
        )


def quantize_int8(weight: torch.Tensor) -> RowCodes:
    """Symmetric int8 per 32 input features, as GGUF Q8_0 stores it.

    scale = max |w| / 127 rounded up to a float16 (Q8_0's stored scale: it also
    keeps ``code * scale`` exact, so the kernel and the dequantized prefill
    weight agree bit for bit); codes -127..127 stored as code + 128 with
    offset = -128 * scale. Weight-only: activations stay in float.

    Rounding the scale up, not to nearest, keeps every |w| / scale <= 127, so no
    code clamps and the error stays within half a step. It matters for small
    blocks: below max |w| ~ 0.008 the scale is a float16 subnormal, whose
    rounding to nearest can shrink it by several percent (the largest weights
    then clamped, a third of a step off).
    """
    out_features, in_features = weight.shape
    if in_features % BLOCK:
        raise ValueError(f"in_features {in_features} is not a multiple of {BLOCK}")
    blocks = weight.detach().float().reshape(out_features, -1, BLOCK)
    exact = blocks.abs().amax(dim=-1) / 127
    scale = exact.half()
    below = scale.float() < exact
    scale = torch.where(below, torch.nextafter(scale, torch.full_like(scale, torch.inf)), scale)
    scale = scale.float()
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = (blocks / safe.unsqueeze(-1)).round_().clamp_(-127, 127).add_(128)
    return RowCodes(codes.to(torch.uint8).view(out_features, in_features), scale, -128 * scale)
