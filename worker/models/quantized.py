"""Projections whose weights arrive (or end up) as 8-bit block codes.

A GGUF file's quantized tensors load as ``RowCodes`` (a file of Q4_0/Q4_1/Q8_0
only) or ``GGMLRows`` (a file with K-quants or Q5_0/Q5_1; worker/gguf_weights.py)
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

from kvmesh.kernels.block_codes import RowCodes
from kvmesh.kernels.ggml_blocks import GGMLRows

# A checkpoint tensor as the loader hands it over: dense, or codes.
WeightPiece = torch.Tensor | RowCodes | GGMLRows
# The pieces that are codes of some kind (never a dense tensor).
CODE_PIECES = (RowCodes, GGMLRows)


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
    return join_rows(ordered)


def join_rows(ordered: list[WeightPiece]) -> WeightPiece:
    """Pieces stacked by rows: codes when every piece is codes of one kind
    (a TP shard of a fused GGUF tensor stays blocks), else dense."""
    if all(isinstance(p, RowCodes) for p in ordered):
        return RowCodes.cat(ordered)  # type: ignore[arg-type]
    if all(isinstance(p, GGMLRows) for p in ordered):
        # The file's blocks, types mixed by segment (a Q4_K_M file's q/k/v).
        return GGMLRows.cat(ordered)  # type: ignore[arg-type]
    return torch.cat([p.dequantize() if isinstance(p, CODE_PIECES) else p for p in ordered])
