"""Read a GGUF file's tensors as the Hugging Face names and layouts the model loads.

Q4_0, Q4_1 and Q8_0 tensors become ``RowCodes`` (kernels/block_codes.py)
straight from their blocks, never a dense float32 tensor: a block of 32
weights is a float16 scale (and, for Q4_1, a float16 minimum) and 32 codes,
which is the kernel's ``code * scale + offset`` with

* Q8_0: int8 codes c, stored as c + 128 with offset = -128 * scale;
* Q4_0: codes 0..15 with offset = -8 * scale;
* Q4_1: codes 0..15 with offset = the block's minimum.

Each rebuilds exactly the float32 value gguf's (and so transformers') own
dequantization gives.

A file with K-quants (Q4_K, Q5_K, Q6_K: Q4_K_M / Q5_K_M / Q6_K files) or
Q5_0 / Q5_1 (llama.cpp's fallback for rows whose width is no multiple of 256)
keeps *every* quantized tensor as the file's own blocks, ``GGMLRows``
(kernels/ggml_blocks.py), which kernels/csrc/ggml_block_linear.cpp multiplies
directly: resident weights stay the file's size (a fused q/k/v mixing Q5_0
and Q8_0 is one weight of two segments; a tied embedding and LM head share
one copy). So does a file whose quantized tensors are all Q8_0 when its
projections take int8 activations (``int8_activations``: --quantization
w8a8): there the blocks' own int8 kernels (ggml_q8_row.cpp at batch 1, with
the whole Llama layer in one C++ call, and ggml_q8_linear/ggml_q8_panel.cpp
for decode batches) read the file's 34 bytes per 32 weights, where the panel
codes hold 40 (a float32 scale and offset per block) and run no fused layer.
llama.cpp's own Q8_0 file of the default model, 1 thread of a Zen 2 (AVX2, no
VNNI): a batch-1 step 27.1 -> 14.1 ms, every projection once on 4-48 rows
2.1-2.2x faster, on a 128-token prefill chunk 3.7x (docs/performance.md).
Any other file of Q4_0/Q4_1/Q8_0 only reads as
``RowCodes``, as above, for the panel kernels' bfloat16, AMX and W8A8 paths.

F32, F16 and BF16 tensors are dense (read in the load dtype). Any other type
(IQ-quants, Q2_K, Q3_K, ...) is refused with its name, unless the caller
allows dense weights (an explicit ``--dtype``): then the ``gguf`` package
dequantizes it to a dense tensor, said so in the log.

Names and layout quirks are the family's (its declaration's ``GGUFLayout``,
worker/models/<family>.py); this module only applies them: q/k rows the
converter permuted for a Llama-style rope (interleaved rotary halves) are put
back, on the codes' rows; a norm stored as ``w + offset`` (Gemma) gets its
offset back; an expert stack (``ffn_*_exps``, [experts, rows, cols]) is read
as one matrix per expert. The MoE path multiplies dense expert stacks
(torch._grouped_mm), so a quantized expert stack is dequantized to the load
dtype, said so in the log; every other projection stays blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize

from kvmesh.kernels.block_codes import BLOCK, RowCodes
from kvmesh.kernels.ggml_blocks import BLOCK_FORMATS, GGMLRows
from kvmesh.worker.models.declaration import ModelDeclaration

logger = logging.getLogger(__name__)

GGUFTensor = torch.Tensor | RowCodes | GGMLRows

# Tensors llama.cpp adds that the model does not load (rotary factors come from config.json).
_SKIPPED = ("rope_freqs.weight",)
EXPERT = "{e}"  # in a checkpoint name: the expert index of a stack's slice

# Bytes of one 32-weight block: (type, float16 fields before the codes, code bytes).
_Q8_0, _Q4_0, _Q4_1 = (
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
)
_BLOCK_FIELDS = {_Q8_0: (1, 32), _Q4_0: (1, 16), _Q4_1: (2, 16)}
CODE_TYPES = tuple(_BLOCK_FIELDS)
# Read as they are stored in the file (GGMLRows), never as dense floats.
BLOCK_TYPES = tuple(BLOCK_FORMATS)
DENSE_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


class UnsupportedGGUFType(ValueError):
    """A GGUF tensor type kvmesh does not run as blocks, refused by name."""


def block_codes(data: np.ndarray, kind: GGMLQuantizationType, rows: int, cols: int) -> RowCodes:
    """A Q8_0/Q4_0/Q4_1 tensor's raw bytes ``[rows, bytes per row]`` as row codes."""
    halves, code_bytes = _BLOCK_FIELDS[kind]
    blocks = np.ascontiguousarray(data).reshape(rows, cols // BLOCK, 2 * halves + code_bytes)
    fields = torch.from_numpy(blocks[..., : 2 * halves].copy().view(np.float16)).float()
    raw = torch.from_numpy(blocks[..., 2 * halves :].copy())
    scales = fields[..., 0].contiguous()
    if kind == _Q8_0:
        codes = (raw.view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        offsets = -128 * scales
    else:
        # Byte j holds weight j in its low nibble and weight j + 16 in its high one.
        codes = torch.cat([raw & 0x0F, raw >> 4], dim=-1)
        offsets = fields[..., 1].contiguous() if kind == _Q4_1 else -8 * scales
    return RowCodes(codes.reshape(rows, cols), scales, offsets)


def reads_as_blocks(kinds: list[GGMLQuantizationType], int8_activations: bool) -> bool:
    """Whether a file of tensors of these types reads as ``GGMLRows`` (every
    quantized tensor the file's own blocks) rather than ``RowCodes``."""
    quantized = {kind for kind in kinds if kind not in DENSE_TYPES}
    if int8_activations and quantized == {_Q8_0}:
        return True
    return not quantized <= set(CODE_TYPES)


def _unpermute_rows(tensor: GGUFTensor, num_heads: int) -> GGUFTensor:
    """Undo llama.cpp's q/k row permutation (transformers' reverse_permute_weights)."""
    rows = tensor.shape[0]
    order = torch.arange(rows).view(num_heads, rows // num_heads // 2, 2).transpose(1, 2)
    return tensor[order.reshape(-1)]


def _dense(
    tensor: ReaderTensor, kind: GGMLQuantizationType, shape: tuple[int, ...]
) -> torch.Tensor:
    """The tensor in float32 (a writable copy)."""
    dense = dequantize(tensor.data, kind).reshape(shape)
    return torch.from_numpy(np.array(dense, dtype=np.float32))


def iterate_gguf_weights(
    path: Path,
    declaration: ModelDeclaration,
    num_heads: int,
    num_kv_heads: int,
    dense_dtype: torch.dtype = torch.float32,
    allow_dense: bool = False,
    int8_activations: bool = False,
) -> Iterator[tuple[str, GGUFTensor]]:
    """(checkpoint name, dense tensor in ``dense_dtype``, RowCodes or GGMLRows)
    for every weight, named by the family's declaration (``gguf_name``).
    ``allow_dense``: dequantize types without a block kernel (else they are
    refused with their name: UnsupportedGGUFType). ``int8_activations``: the
    projections will take int8 activations (--quantization w8a8), so a file
    of Q8_0 blocks stays blocks (see the module docstring)."""
    layout = declaration.gguf
    reader = GGUFReader(str(path))
    architecture = str(reader.fields["general.architecture"].contents())
    if layout is None or architecture != layout.architecture:
        raise ValueError(
            f"GGUF architecture {architecture!r} in {path} is not one this model family reads "
            f"(it reads {layout.architecture if layout else 'no GGUF files'!r})"
        )
    # One representation per file (see the module docstring).
    as_blocks = reads_as_blocks(
        [GGMLQuantizationType(t.tensor_type) for t in reader.tensors], int8_activations
    )
    for tensor in reader.tensors:
        name = declaration.gguf_name(tensor.name)
        if name is None:
            if tensor.name not in _SKIPPED:
                raise ValueError(f"unexpected tensor {tensor.name!r} in {path}")
            continue
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists ne: innermost first
        kind = GGMLQuantizationType(tensor.tensor_type)
        if EXPERT in name:
            if len(shape) != 3:
                raise ValueError(
                    f"{tensor.name} in {path}: shape {shape}, not [experts, rows, cols]"
                )
            if kind not in DENSE_TYPES:
                logger.info(
                    "%s: %s is %s: dequantized to %s (the expert path runs dense weights)",
                    path.name,
                    tensor.name,
                    kind.name,
                    dense_dtype,
                )
            stack = _dense(tensor, kind, shape).to(dense_dtype)
            for expert in range(shape[0]):
                yield name.replace(EXPERT, str(expert)), stack[expert]
            continue
        value: GGUFTensor
        if kind in CODE_TYPES and len(shape) == 2 and not as_blocks:
            value = block_codes(tensor.data, kind, *shape)
        elif kind in BLOCK_TYPES and len(shape) == 2:
            value = GGMLRows.from_file(tensor.data, kind, *shape)
        else:
            if kind not in DENSE_TYPES:
                if not allow_dense:
                    raise UnsupportedGGUFType(
                        f"{path.name}: tensor {tensor.name!r} is {kind.name}, which kvmesh "
                        f"does not run as blocks (supported: "
                        f"{', '.join(k.name for k in BLOCK_TYPES + DENSE_TYPES)}); "
                        "pass an explicit --dtype to dequantize it to dense weights"
                    )
                logger.warning(
                    "%s: %s is %s: dequantized to dense %s (--dtype)",
                    path.name,
                    tensor.name,
                    kind.name,
                    dense_dtype,
                )
            value = _dense(tensor, kind, shape)
            if layout.norm_offset and name.endswith("norm.weight"):
                value = value - layout.norm_offset  # in float32, as it was added
            value = value.to(dense_dtype)
        if layout.permuted_qk and (".q_proj." in name or ".k_proj." in name):
            value = _unpermute_rows(value, num_heads if "q_proj" in name else num_kv_heads)
        yield name, value
