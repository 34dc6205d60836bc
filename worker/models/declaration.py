"""What a model family declares once, and what everything else reads.

A family's file in ``worker/models/`` declares its per-layer parameters (each
a stack of named row runs, ``Part``, over a column kind), how checkpoint
tensor names (safetensors and GGUF) land in them, which projections LoRA may
target, and its per-layer KV-cache spec. The loader, the GGUF reader, LoRA
and tensor-parallel sharding read only this (vLLM's ``packed_modules_mapping``
and ``WeightsMapper`` are the idea): no other module knows a family's names.

Sharding follows from the kinds. Every run of rows and every column range has
a ``Split``; a rank keeps, of each, the range its ``ShardPlan`` gives that
split (its query heads, its KV heads, its slice of the MLP or of the vocab,
or everything for a replicated one). A checkpoint tensor that stacks several
runs (a fused ``qkv_proj``) is cut run by run, so a fused checkpoint and a
split one shard alike.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kvmesh.worker.models.quantized import join_rows
from kvmesh.worker.parallel.sharding import ShardPlan


class Split(enum.Enum):
    """How a run of rows (or a parameter's columns) is cut over TP ranks."""

    HIDDEN = "hidden"  # the hidden size, replicated
    HEAD_DIM = "head_dim"  # one head's width, replicated (per-head q/k norms)
    Q_HEADS = "q_heads"  # query heads x head_dim, split by this rank's query heads
    KV_HEADS = "kv_heads"  # KV heads x head_dim, split by this rank's KV heads
    INTERMEDIATE = "intermediate"  # the MLP's width, split in contiguous slices
    VOCAB = "vocab"  # vocabulary rows, split in equal shards
    EXPERTS = "experts"  # one row per expert (a router), replicated
    EXPERT_INTERMEDIATE = "expert_intermediate"  # an expert's MLP width, split like the MLP's

    @property
    def sharded(self) -> bool:
        return self not in (Split.HIDDEN, Split.HEAD_DIM, Split.EXPERTS)


def split_full_size(split: Split, plan: ShardPlan, hidden_size: int) -> int:
    """Rows of ``split`` in the whole model."""
    return {
        Split.HIDDEN: hidden_size,
        Split.HEAD_DIM: plan.head_dim,
        Split.Q_HEADS: plan.num_heads * plan.head_dim,
        Split.KV_HEADS: plan.num_kv_heads * plan.head_dim,
        Split.INTERMEDIATE: plan.intermediate_size,
        Split.VOCAB: plan.vocab_size,
        Split.EXPERTS: plan.num_experts,
        Split.EXPERT_INTERMEDIATE: plan.expert_intermediate_size,
    }[split]


def split_keep(split: Split, plan: ShardPlan, hidden_size: int) -> range:
    """The rows of ``split`` this rank keeps (all of them when replicated)."""
    if split is Split.Q_HEADS:
        heads = plan.heads.q_heads
        return range(heads.start * plan.head_dim, heads.stop * plan.head_dim)
    if split is Split.KV_HEADS:
        heads = plan.heads.kv_heads
        return range(heads.start * plan.head_dim, heads.stop * plan.head_dim)
    if split is Split.INTERMEDIATE:
        return plan.intermediate
    if split is Split.VOCAB:
        return plan.vocab
    if split is Split.EXPERT_INTERMEDIATE:
        return plan.expert_intermediate
    return range(split_full_size(split, plan, hidden_size))


@dataclass(frozen=True)
class Part:
    """A run of a parameter's rows: its label (``q``, ``gate``...) and split."""

    label: str
    split: Split


@dataclass(frozen=True)
class ParamDecl:
    """One per-layer parameter: runs of rows stacked, over one column split
    (None: a vector). ``projection``: a matmul weight, packed for inference
    (and weightless until packing when the checkpoint is a GGUF file)."""

    rows: tuple[Part, ...]
    cols: Split | None = None
    projection: bool = False
    # One such matrix per expert, stacked in a leading dimension; checkpoint
    # tensors name the expert (``mlp.experts.{e}.gate_proj.weight``).
    experts: bool = False

    def part(self, label: str) -> Part:
        for part in self.rows:
            if part.label == label:
                return part
        raise KeyError(label)


@dataclass(frozen=True)
class CheckpointTensor:
    """Where one checkpoint tensor (a per-layer name, after ``model.layers.N.``)
    goes: a parameter and the consecutive runs of it the tensor holds."""

    param: str
    labels: tuple[str, ...]


@dataclass(frozen=True)
class LoRATarget:
    """A PEFT module an adapter may target: its path in a layer
    (``self_attn.q_proj``) and the runs of a projection parameter it adapts."""

    path: str
    param: str
    labels: tuple[str, ...]


@dataclass(frozen=True)
class LayerKVSpec:
    """The KV cache one layer writes and reads (vLLM's per-layer kv-cache spec)."""

    num_kv_heads: int
    head_dim: int
    # Attention over the last ``sliding_window`` tokens only (None: every token).
    sliding_window: int | None = None


# A GGUF file's metadata (key -> value, e.g. ``qwen3.block_count`` -> 28) and
# tensor names -> shapes (Hugging Face order), as a family's config hook reads them.
GGUFMetadata = Mapping[str, Any]
GGUFShapes = Mapping[str, tuple[int, ...]]
GGUFConfigHook = Callable[[GGUFMetadata, GGUFShapes, dict[str, Any]], None]


@dataclass(frozen=True)
class GGUFLayout:
    """How llama.cpp's converter (convert_hf_to_gguf.py) writes one family:
    the names, the layout quirks the loader undoes, and the metadata keys that
    become config.json fields (worker/gguf_config.py reads the keys every
    architecture shares; these are the family's own)."""

    # ``general.architecture`` and the Hugging Face names it stands for.
    architecture: str
    hf_architecture: str
    model_type: str
    # llama.cpp's per-layer tensor names (``blk.N.<name>``) -> the checkpoint
    # suffix. A suffix with ``experts.{e}`` names a stack of every expert's
    # matrix (``ffn_gate_exps``: [experts, rows, cols]), read expert by expert.
    layer_names: Mapping[str, str]
    # The converter permuted q/k rows (Llama-style rope as interleaved halves).
    permuted_qk: bool = False
    # The converter stored ``w + norm_offset`` for every ``*norm.weight``
    # (Gemma's (1 + w) RMSNorms): the loader subtracts it back.
    norm_offset: float = 0.0
    # ``<arch>.<key>`` -> config.json field, for the family's own facts.
    config_keys: Mapping[str, str] = field(default_factory=dict)
    # config.json fields llama.cpp never stores but assumes for the architecture.
    config_fixed: Mapping[str, Any] = field(default_factory=dict)
    # Facts that need more than a key (layer patterns, model-size rules).
    config_hook: GGUFConfigHook | None = None
    # Whether this layout is the architecture's mixture-of-experts reading
    # (Mixtral is llama.cpp's "llama" with ``llama.expert_count`` set).
    experts: bool = False


@dataclass(frozen=True)
class ModelDeclaration:
    """Everything about a family's layout that is not its forward."""

    # Per-layer parameters by name (the decoder layer's attribute names).
    params: Mapping[str, ParamDecl]
    # Per-layer checkpoint tensor names (after ``model.layers.N.``) -> destination.
    layer_tensors: Mapping[str, CheckpointTensor]
    # PEFT module name -> what it adapts.
    lora_targets: Mapping[str, LoRATarget]
    # How llama.cpp writes the family as GGUF (None: llama.cpp has no such architecture).
    gguf: GGUFLayout | None = None
    # Global checkpoint names (embedding, final norm, LM head): fixed by the HF layout.
    embed_name: str = "model.embed_tokens.weight"
    norm_name: str = "model.norm.weight"
    lm_head_name: str = "lm_head.weight"
    layer_prefix: str = "model.layers."
    # Checkpoint tensors that carry nothing the model reads (e.g. rotary caches).
    ignored_suffixes: tuple[str, ...] = ("rotary_emb.inv_freq",)

    def __post_init__(self) -> None:
        for name, target in self.layer_tensors.items():
            decl = self.params[target.param]
            labels = [p.label for p in decl.rows]
            start = labels.index(target.labels[0])
            if tuple(labels[start : start + len(target.labels)]) != target.labels:
                raise ValueError(f"{name}: runs {target.labels} are not consecutive in {labels}")
        for module, lora in self.lora_targets.items():
            if not self.params[lora.param].projection:
                raise ValueError(f"LoRA target {module} adapts {lora.param}, not a projection")

    # -- shapes --------------------------------------------------------------

    def param_shape(self, name: str, plan: ShardPlan, hidden_size: int) -> tuple[int, ...]:
        """The parameter's shape on this rank."""
        decl = self.params[name]
        rows = sum(len(split_keep(p.split, plan, hidden_size)) for p in decl.rows)
        shape: tuple[int, ...] = (rows,)
        if decl.cols is not None:
            shape = (rows, len(split_keep(decl.cols, plan, hidden_size)))
        return (plan.num_experts, *shape) if decl.experts else shape

    def local_offset(self, name: str, label: str, plan: ShardPlan, hidden_size: int) -> int:
        """First local row of run ``label`` in parameter ``name`` on this rank."""
        offset = 0
        for part in self.params[name].rows:
            if part.label == label:
                return offset
            offset += len(split_keep(part.split, plan, hidden_size))
        raise KeyError(label)

    # -- sharding ------------------------------------------------------------

    def shard_rows(
        self,
        name: str,
        labels: tuple[str, ...],
        tensor: torch.Tensor,
        plan: ShardPlan,
        hidden_size: int,
    ) -> torch.Tensor:
        """This rank's rows of a tensor that stacks the whole runs ``labels`` of ``name``."""
        decl = self.params[name]
        splits = [decl.part(label).split for label in labels]
        if plan.tp_size == 1 or not any(s.sharded for s in splits):
            return tensor
        sizes = [split_full_size(s, plan, hidden_size) for s in splits]
        if sum(sizes) != tensor.shape[0]:
            raise ValueError(f"{name} runs {labels}: {tensor.shape[0]} rows, expected {sum(sizes)}")
        pieces, start = [], 0
        for split, size in zip(splits, sizes, strict=True):
            keep = split_keep(split, plan, hidden_size)
            pieces.append(tensor[start + keep.start : start + keep.stop])
            start += size
        # One run slices (a GGUF file's codes too); the runs of a fused tensor
        # join again (a GGUF file's fused blocks stay blocks: Phi-3's attn_qkv).
        return pieces[0] if len(pieces) == 1 else join_rows(pieces)

    def shard_cols(
        self, name: str, tensor: torch.Tensor, plan: ShardPlan, hidden_size: int
    ) -> torch.Tensor:
        """This rank's columns of a matrix whose columns are ``name``'s column split."""
        cols = self.params[name].cols
        if plan.tp_size == 1 or cols is None or not cols.sharded:
            return tensor
        keep = split_keep(cols, plan, hidden_size)
        return tensor[:, keep.start : keep.stop]

    def layer_tensor(self, suffix: str) -> tuple[CheckpointTensor, int | None] | None:
        """(destination, expert index or None) of a per-layer checkpoint name
        (None: not one of the family's): an expert's tensor names its expert,
        the declaration says ``experts.{e}``."""
        target = self.layer_tensors.get(suffix)
        if target is not None:
            return target, None
        head, found, tail = suffix.partition(".experts.")
        index, _, rest = tail.partition(".")
        if not found or not index.isdigit():
            return None
        target = self.layer_tensors.get(f"{head}.experts.{{e}}.{rest}")
        return None if target is None else (target, int(index))

    def shard_layer_tensor(
        self, suffix: str, tensor: torch.Tensor, plan: ShardPlan, hidden_size: int
    ) -> torch.Tensor:
        """This rank's part of a per-layer checkpoint tensor."""
        found = self.layer_tensor(suffix)
        if found is None:
            raise KeyError(suffix)
        target = found[0]
        tensor = self.shard_rows(target.param, target.labels, tensor, plan, hidden_size)
        if len(tensor.shape) == 2:  # a matrix (or a GGUF file's RowCodes)
            tensor = self.shard_cols(target.param, tensor, plan, hidden_size)
        return tensor

    # -- LoRA ----------------------------------------------------------------

    def lora_module_shapes(self, plan: ShardPlan, hidden_size: int) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each PEFT module of the whole model."""
        shapes = {}
        for module, target in self.lora_targets.items():
            decl = self.params[target.param]
            assert decl.cols is not None
            out = sum(
                split_full_size(decl.part(label).split, plan, hidden_size)
                for label in target.labels
            )
            shapes[module] = (split_full_size(decl.cols, plan, hidden_size), out)
        return shapes

    def shard_lora(
        self,
        module: str,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        plan: ShardPlan,
        hidden_size: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One rank's (A, B) of a whole-model module: A's columns cut like the
        weight's input (row-parallel), B's rows like its output runs."""
        target = self.lora_targets[module]
        lora_a = self.shard_cols(target.param, lora_a, plan, hidden_size)
        lora_b = self.shard_rows(target.param, target.labels, lora_b, plan, hidden_size)
        return lora_a.contiguous(), lora_b.contiguous()

    # -- GGUF ----------------------------------------------------------------

    def gguf_name(self, gguf_name: str) -> str | None:
        """The checkpoint name of a GGUF tensor (None: not a model weight); an
        expert stack's name keeps ``{e}`` for the reader to fill."""
        globals_ = {
            "token_embd.weight": self.embed_name,
            "output_norm.weight": self.norm_name,
            "output.weight": self.lm_head_name,
        }
        if gguf_name in globals_:
            return globals_[gguf_name]
        pieces = gguf_name.split(".")
        if len(pieces) != 4 or pieces[0] != "blk" or not pieces[1].isdigit():
            return None
        suffix = None if self.gguf is None else self.gguf.layer_names.get(pieces[2])
        if suffix is None:
            return None
        return f"{self.layer_prefix}{pieces[1]}.{suffix}.{pieces[3]}"


def proj(*rows: tuple[str, Split], cols: Split) -> ParamDecl:
    """A projection parameter (shorthand for family declarations)."""
    return ParamDecl(tuple(Part(label, split) for label, split in rows), cols, projection=True)


def vector(*rows: tuple[str, Split]) -> ParamDecl:
    """A vector parameter: a norm's weight, a bias."""
    return ParamDecl(tuple(Part(label, split) for label, split in rows))
