"""Every layer of a batch-1 decode step in one C++ call (kvmesh::ggml_llama_layers_row).

Each Llama layer on GGUF blocks with int8 activations already runs in one
C++ call (``DecoderLayer.forward_row``: kvmesh::ggml_llama_layer_row). Called
once per layer from Python, each call still parses its ~25 arguments (three
lists of block tensors among them): ~25 us a layer on the 2-core Zen 2, ~0.8
ms of a 30-layer step that is ~10 ms in all. ``RowStack`` lists the layers'
arguments once, flattened, and hands the whole stack to one call per step,
which runs each layer exactly as ggml_llama_layer_row does: the same bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

KVCache = tuple[torch.Tensor, torch.Tensor]


class RowLayer(Protocol):
    """What ``RowStack`` reads of a ``DecoderLayer``."""

    row_args: tuple[object, ...] | None
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None
    attn_softcap: float | None
    rope_index: int


@dataclass(frozen=True)
class RowStack:
    """The layers' ``row_args``, flattened as ggml_llama_layers_row takes them."""

    # Each layer's row_args as listed: the stack runs only while they are
    # still the layers' own (a benchmark may turn a layer's off).
    layer_args: tuple[tuple[object, ...], ...]
    norms: list[torch.Tensor]  # input_norm, pre_mlp_norm of each layer
    eps: float
    blocks: list[torch.Tensor]  # qkv, o, gate_up, down block tensors of each layer
    kinds: list[int]  # the ggml type of each block tensor
    segments: list[int]  # block tensors per projection, 4 per layer
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_index: list[int]
    scale: float
    sliding_windows: list[int]  # 0: none
    softcap: float  # 0.0: none

    @classmethod
    def of(cls, layers: Sequence[RowLayer]) -> RowStack | None:
        """The stack of ``layers`` when every one runs in one C++ call
        (``row_args``) with the same eps, head shapes, scale and soft-cap, else None."""
        if not layers or any(layer.row_args is None for layer in layers):
            return None
        first = layers[0]
        shared = {
            (
                layer.row_args[2],  # type: ignore[index]
                layer.num_heads,
                layer.num_kv_heads,
                layer.head_dim,
                layer.scale,
                layer.attn_softcap or 0.0,
            )
            for layer in layers
        }
        if len(shared) != 1:
            return None
        norms: list[torch.Tensor] = []
        blocks: list[torch.Tensor] = []
        kinds: list[int] = []
        segments: list[int] = []
        for layer in layers:
            args = layer.row_args
            assert args is not None
            norms += [args[0], args[1]]  # type: ignore[list-item]
            # Then (blocks, kinds) of qkv, o, gate_up and down.
            for projection_blocks, projection_kinds in zip(args[3::2], args[4::2], strict=True):
                blocks += projection_blocks  # type: ignore[arg-type]
                kinds += projection_kinds  # type: ignore[arg-type]
                segments.append(len(projection_blocks))  # type: ignore[arg-type]
        return cls(
            layer_args=tuple(layer.row_args for layer in layers),  # type: ignore[misc]
            norms=norms,
            eps=float(first.row_args[2]),  # type: ignore[index, arg-type]
            blocks=blocks,
            kinds=kinds,
            segments=segments,
            num_heads=first.num_heads,
            num_kv_heads=first.num_kv_heads,
            head_dim=first.head_dim,
            rope_index=[layer.rope_index for layer in layers],
            scale=first.scale,
            sliding_windows=[layer.sliding_window or 0 for layer in layers],
            softcap=first.attn_softcap or 0.0,
        )

    def current(self, layers: Sequence[RowLayer]) -> bool:
        """Whether every layer still has the ``row_args`` listed here."""
        return all(
            layer.row_args is args for layer, args in zip(layers, self.layer_args, strict=True)
        )

    def forward(
        self,
        hidden: torch.Tensor,
        rotary_tables: Sequence[tuple[torch.Tensor, torch.Tensor]],
        kv_caches: Sequence[KVCache],
        slot_mapping: torch.Tensor,
        attention: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """Every layer's ``forward_row``, in order, in one call."""
        return torch.ops.kvmesh.ggml_llama_layers_row(
            hidden,
            self.norms,
            self.eps,
            self.blocks,
            self.kinds,
            self.segments,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            [cos for cos, _ in rotary_tables],
            [sin for _, sin in rotary_tables],
            self.rope_index,
            [cache for kv in kv_caches for cache in kv],
            slot_mapping,
            *attention,
            self.scale,
            self.sliding_windows,
            self.softcap,
        )
