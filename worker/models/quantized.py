"""Projections whose weights arrive (or end up) as 8-bit block codes.

A GGUF file's Q4_0/Q4_1/Q8_0 tensors load as ``RowCodes`` (worker/gguf_weights.py)
and must never become a dense float32 tensor: the model holds a weightless
*placeholder* parameter for such a projection (its shape, for the loader's checks
and anyone asking for sizes, on a zero-stride view of one element) and collects
the pieces (q, k and v of a fused qkv; a TP shard) as they arrive. At packing,
``assemble`` joins them: codes when every piece is codes, else one dense weight
(a file mixing types within one fused projection).

``--quantization int8`` takes the other road: a float checkpoint loads dense as
usual and ``quantize_int8`` turns each projection into codes at packing, after
which its dense parameter is swapped for a placeholder too.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.block_codes import RowCodes

# A checkpoint tensor as the loader hands it over: dense, or codes.
WeightPiece = torch.Tensor | RowCodes


def placeholder(rows: int, cols: int, dtype: torch.dtype) -> nn.Parameter:
    """A parameter with the shape of ``[rows, cols]`` and the memory of one element."""
    return nn.Parameter(torch.zeros((), dtype=dtype).expand(rows, cols), requires_grad=False)


def is_placeholder(tensor: torch.Tensor) -> bool:
    return tensor.dim() == 2 and tensor.numel() > 1 and tensor.stride() == (0, 0)


def release(param: nn.Parameter) -> None:
    """Drop a parameter's dense weight once its codes replace it; keep its shape."""
    param.data = torch.zeros((), dtype=param.dtype).expand(param.shape)


def assemble(pieces: dict[int, WeightPiece], rows: int) -> WeightPiece:
    """The pieces (by first row) of one parameter, joined in row order."""
    ordered = [pieces[row] for row in sorted(pieces)]
    if sum(p.shape[0] for p in ordered) != rows:
        raise ValueError(f"pieces cover {sum(p.shape[0] for p in ordered)} of {rows} rows")
    if all(isinstance(p, RowCodes) for p in ordered):
        return RowCodes.cat(ordered)  # type: ignore[arg-type]
    return torch.cat([p.dequantize() if isinstance(p, RowCodes) else p for p in ordered])
