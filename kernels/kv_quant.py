"""The quantized KV cache (``--kv-cache-dtype``): its formats, its pages and its torch reference.

``auto`` keeps the model dtype (plain ``[num_blocks, block_size, H_kv, D]``
tensors, today's cache). The other names are vLLM's:

- ``int8``: symmetric int8 codes, round to nearest (ties to even), one
  float32 scale per written token per KV head: ``scale = amax(|x|) / 127``
  over the head's ``head_dim`` values, ``code = round(x / scale)``. llama.cpp's
  ``q8_0`` cache keeps one scale per 32 values; one per head vector costs 4
  bytes per 64 (or 128) codes and lets a kernel apply the scale once per score
  (``q . k = scale_k * (q . codes_k)``) and once per probability (``p v =
  (p scale_v) codes_v``) instead of inside the dot product.
- ``fp8_e4m3`` (alias ``fp8``, as vLLM's) and ``fp8_e5m2``: torch's
  ``float8_e4m3fn`` / ``float8_e5m2`` codes with the same per-token-head scale,
  ``amax / 448`` and ``amax / 57344`` (each format's largest finite value),
  converted as torch's ``.to()`` rounds (nearest, ties to even). vLLM's default
  is one scale of 1.0 per tensor; a per-token-head scale shares every line of
  the int8 path (pages, kernels, store bytes) and cannot overflow e4m3's
  +-448, which a scale of 1.0 does for outliers. A row of zeros has scale 0 and
  codes 0.

Pages: a layer's K (and its V) is one ``[num_blocks, page_bytes]`` byte buffer;
each block's page holds its ``block_size x H_kv x D`` codes (the same order as
an ``auto`` cache's block) and ends with its ``block_size x H_kv`` float32
scales. The cache tensor a backend receives is the codes' view,
``[num_blocks, block_size, H_kv, D]`` in the code dtype with a block stride of
``page_bytes``: every caller keeps its ``(k_cache, v_cache)`` pair, prefix
caching and the store move whole pages, so a block's scales travel with its
codes (kvstore, offload, P/D transfer) without a second tensor anywhere.
``cache_scales`` finds the scales from the codes' view; the C++ and Triton
kernels find them at the end of each page (``page_bytes`` is the view's
``stride(0)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmesh.services.contracts.math_utils import cdiv
from kvmesh.services.runtime.config import KV_CACHE_DTYPES

AUTO = "auto"


@dataclass(frozen=True)
class KVCacheFormat:
    """One quantized cache format: its vLLM name, code dtype and largest code."""

    name: str
    code_dtype: torch.dtype
    max_code: float

    @property
    def store_name(self) -> str:
        """How the kvstore layout names blocks of this format (kvstore/layout.py)."""
        return f"{self.name}+scale_per_token_head"


INT8 = KVCacheFormat("int8", torch.int8, 127.0)
FP8_E4M3 = KVCacheFormat("fp8_e4m3", torch.float8_e4m3fn, 448.0)
FP8_E5M2 = KVCacheFormat("fp8_e5m2", torch.float8_e5m2, 57344.0)
FORMATS: dict[str, KVCacheFormat] = {f.name: f for f in (INT8, FP8_E4M3, FP8_E5M2)}
# vLLM's names, "fp8" its alias for e4m3.
ALIASES = {"fp8": FP8_E4M3.name}
CODE_DTYPES: dict[torch.dtype, KVCacheFormat] = {f.code_dtype: f for f in FORMATS.values()}
SCALE_BYTES = 4  # one float32 per token per KV head


def resolve(name: str | None) -> KVCacheFormat | None:
    """The format ``--kv-cache-dtype name`` asks for; None for ``auto`` (the model dtype)."""
    if name is None or name == AUTO:
        return None
    name = ALIASES.get(name, name)
    if name not in FORMATS:
        raise ValueError(
            f"kv_cache_dtype {name!r} is not supported (choose one of {', '.join(KV_CACHE_DTYPES)})"
        )
    return FORMATS[name]


def is_quantized(cache: torch.Tensor) -> bool:
    """Whether ``cache`` is a quantized cache's codes view (its scales live in its pages)."""
    return cache.dtype in CODE_DTYPES


def format_of(cache: torch.Tensor) -> KVCacheFormat:
    return CODE_DTYPES[cache.dtype]


def page_bytes(block_size: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes of one block's page in one layer's K (or V): codes, padding to 4, scales."""
    codes = block_size * num_kv_heads * head_dim
    return cdiv(codes, SCALE_BYTES) * SCALE_BYTES + block_size * num_kv_heads * SCALE_BYTES


def allocate_pages(
    fmt: KVCacheFormat,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """A zeroed page buffer, returned as its codes' view (see the module docstring)."""
    page = page_bytes(block_size, num_kv_heads, head_dim)
    buffer = torch.zeros((num_blocks, page), dtype=torch.uint8, device=device)
    codes = block_size * num_kv_heads * head_dim
    return buffer.view(fmt.code_dtype)[:, :codes].view(
        num_blocks, block_size, num_kv_heads, head_dim
    )


def cache_pages(cache: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, elements]``: each block's whole page (a view). A quantized
    cache's pages are bytes (codes and scales); a plain cache's its elements."""
    num_blocks = cache.shape[0]
    if not is_quantized(cache):
        return cache.view(num_blocks, -1)
    page = cache.stride(0)
    return torch.as_strided(cache.view(torch.uint8), (num_blocks, page), (page, 1))


def cache_scales(cache: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, block_size, H_kv]`` float32: the scales at the end of each page (a view)."""
    num_blocks, block_size, num_kv_heads = cache.shape[:3]
    page = cache.stride(0)
    start = cache.storage_offset() + page - block_size * num_kv_heads * SCALE_BYTES
    if page % SCALE_BYTES or start % SCALE_BYTES:
        raise ValueError("a quantized cache's pages must be whole float32 words")
    return torch.empty(0, dtype=torch.float32, device=cache.device).set_(
        cache.untyped_storage(),
        start // SCALE_BYTES,
        (num_blocks, block_size, num_kv_heads),
        (page // SCALE_BYTES, num_kv_heads, 1),
    )


def quantize(x: torch.Tensor, fmt: KVCacheFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[..., D]`` as (codes ``[..., D]``, float32 scales ``[...]``): the
    definition every kernel's cache write matches code for code."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / fmt.max_code
    scaled = x / torch.where(scale == 0, torch.ones_like(scale), scale)[..., None]
    if fmt is INT8:
        codes = torch.round(scaled).clamp(-127, 127).to(torch.int8)
    else:
        codes = scaled.to(fmt.code_dtype)
    return codes, scale


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``codes [..., D] * scales [...]`` in float32, returned as ``dtype``."""
    return (codes.float() * scales[..., None]).to(dtype)


def write_rows(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Quantize new K/V rows into their slots (negative slot: skip), in torch."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    fmt = format_of(k_cache)
    for rows, cache in ((key[keep], k_cache), (value[keep], v_cache)):
        codes, scales = quantize(rows, fmt)
        block_size = cache.shape[1]
        blocks, offsets = slots // block_size, slots % block_size
        cache[blocks, offsets] = codes
        cache_scales(cache)[blocks, offsets] = scales


def gather_rows(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``[len(slots), H_kv, D]`` of a quantized cache, dequantized to ``dtype``."""
    block_size = cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    return dequantize(cache[blocks, offsets], cache_scales(cache)[blocks, offsets], dtype)


def dequantize_cache(cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The whole cache dequantized (a contiguous copy): for references and tests."""
    return dequantize(cache, cache_scales(cache), dtype)
