"""Read one PEFT adapter's tensors from its folder, checked against the model.

PEFT saves ``base_model.model.model.layers.{i}.{path}.lora_A.weight`` ([r, in])
and ``...lora_B.weight`` ([out, r]), ``path`` a module of the layer
(``self_attn.q_proj``); the forward it trained with is ``y = W x + scaling * B (A x)``.
Which modules exist, their shapes and how they shard come from the model
family's declaration (worker/models/declaration.py).

A rank of a tensor/pipeline-parallel replica keeps its part (``shard_adapter``):
its stage's layers, and per module the half that meets its weight shard. A
column-parallel projection (q/k/v, gate/up) computes some output rows: B is
cut to those rows, A stays whole (the rank has the whole input). A
row-parallel one (o, down) multiplies a slice of the input: A is cut to those
columns and B stays whole, so each rank adds ``B (A_r x_r)`` to its partial
output and the all-reduce that sums the partial outputs sums the deltas too:
``sum_r B (A_r x_r) = B (A x)``. No collective of its own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from kvmesh.services.contracts.lora_files import (
    ADAPTER_WEIGHTS,
    ALL_LINEAR,
    AdapterConfig,
    read_adapter_config,
)
from kvmesh.worker.models.declaration import ModelDeclaration
from kvmesh.worker.parallel.sharding import ShardPlan

_KEY = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.([\w.]+)\.lora_([AB])\.weight")


@dataclass(frozen=True)
class LoRAAdapter:
    """One adapter in memory: (layer, module) -> (A [r, in], B [out, r])."""

    config: AdapterConfig
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def load_adapter(
    folder: str | Path,
    num_layers: int,
    declaration: ModelDeclaration,
    full_plan: ShardPlan,
    hidden_size: int,
    max_rank: int,
    dtype: torch.dtype,
) -> LoRAAdapter:
    """The adapter's tensors in ``dtype``; ValueError if it does not fit the model
    (its family's LoRA targets, shaped by the unsharded ``full_plan``) or the slots."""
    config = read_adapter_config(folder)
    module_shapes = declaration.lora_module_shapes(full_plan, hidden_size)
    by_path = {target.path: module for module, target in declaration.lora_targets.items()}
    unknown = sorted(set(config.target_modules) - {*module_shapes, ALL_LINEAR})
    if unknown:
        raise ValueError(
            f"target_modules {unknown} are not projections of this model; "
            f"it has {', '.join(module_shapes)}"
        )
    if config.rank > max_rank:
        raise ValueError(f"adapter rank {config.rank} exceeds --max-lora-rank {max_rank}")
    halves: dict[tuple[int, str, str], torch.Tensor] = {}
    with safe_open(str(Path(folder) / ADAPTER_WEIGHTS), framework="pt", device="cpu") as file:
        for key in file.keys():  # noqa: SIM118 - safe_open is not a mapping
            match = _KEY.fullmatch(key)
            module = None if match is None else by_path.get(match.group(2))
            if match is None or module is None:
                raise ValueError(f"unsupported adapter tensor {key!r}")
            layer, half = int(match.group(1)), match.group(3)
            if layer >= num_layers:
                raise ValueError(f"adapter tensor {key!r} is past the model's {num_layers} layers")
            halves[(layer, module, half)] = file.get_tensor(key).to(dtype)
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module, half), tensor in halves.items():
        if half == "B":
            continue
        lora_b = halves.get((layer, module, "B"))
        if lora_b is None:
            raise ValueError(f"layer {layer} {module}: lora_A without lora_B")
        in_features, out_features = module_shapes[module]
        expected_a, expected_b = (config.rank, in_features), (out_features, config.rank)
        if tuple(tensor.shape) != expected_a or tuple(lora_b.shape) != expected_b:
            raise ValueError(
                f"layer {layer} {module}: A {tuple(tensor.shape)} / B {tuple(lora_b.shape)}, "
                f"expected {expected_a} / {expected_b}"
            )
        modules[(layer, module)] = (tensor, lora_b)
    if len(modules) * 2 != len(halves):
        raise ValueError("adapter has lora_B tensors without their lora_A")
    return LoRAAdapter(config, modules)


def shard_adapter(
    adapter: LoRAAdapter, declaration: ModelDeclaration, plan: ShardPlan, hidden_size: int
) -> LoRAAdapter:
    """The part of a whole-model adapter one rank applies (see the module docstring):
    the layers of its pipeline stage, numbered from 0 as the stage's model numbers
    them, each module's A or B cut like the weight it adapts."""
    layers = plan.layers
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), (lora_a, lora_b) in adapter.modules.items():
        if layer not in layers:
            continue
        modules[(layer - layers.start, module)] = declaration.shard_lora(
            module, lora_a, lora_b, plan, hidden_size
        )
    return LoRAAdapter(adapter.config, modules)
