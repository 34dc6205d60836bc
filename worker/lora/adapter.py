"""Read one PEFT adapter's tensors from its folder, checked against the model.

PEFT saves ``base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_A.weight``
([r, in]) and ``...lora_B.weight`` ([out, r]); the forward it trained with is
``y = W x + scaling * B (A x)``.

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
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from services.lora_files import ADAPTER_WEIGHTS, AdapterConfig, read_adapter_config
from worker.parallel.sharding import ShardPlan

_KEY = re.compile(
    r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.lora_([AB])\.weight"
)

# PEFT module name -> (in_features, out_features) of the whole model's projection
# (every decoder layer alike).
ModuleShapes = Mapping[str, tuple[int, int]]

_ATTENTION_MODULES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj"})
# Projections whose input, not output, is split over the TP ranks.
_ROW_PARALLEL_MODULES = frozenset({"o_proj", "down_proj"})


@dataclass(frozen=True)
class LoRAAdapter:
    """One adapter in memory: (layer, module) -> (A [r, in], B [out, r])."""

    config: AdapterConfig
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def load_adapter(
    folder: str | Path,
    num_layers: int,
    module_shapes: ModuleShapes,
    max_rank: int,
    dtype: torch.dtype,
) -> LoRAAdapter:
    """The adapter's tensors in ``dtype``; ValueError if it does not fit the model or the slots."""
    config = read_adapter_config(folder)
    if config.rank > max_rank:
        raise ValueError(f"adapter rank {config.rank} exceeds --max-lora-rank {max_rank}")
    halves: dict[tuple[int, str, str], torch.Tensor] = {}
    with safe_open(str(Path(folder) / ADAPTER_WEIGHTS), framework="pt", device="cpu") as file:
        for key in file.keys():  # noqa: SIM118 - safe_open is not a mapping
            match = _KEY.fullmatch(key)
            if match is None:
                raise ValueError(f"unsupported adapter tensor {key!r}")
            layer, module, half = int(match.group(1)), match.group(2), match.group(3)
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


def shard_adapter(adapter: LoRAAdapter, plan: ShardPlan) -> LoRAAdapter:
    """The part of a whole-model adapter one rank applies (see the module docstring):
    the layers of its pipeline stage, numbered from 0 as the stage's model numbers
    them, each module's A or B cut like the weight it adapts."""
    layers = plan.layers
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), (lora_a, lora_b) in adapter.modules.items():
        if layer not in layers:
            continue
        name = f"{'self_attn' if module in _ATTENTION_MODULES else 'mlp'}.{module}.weight"
        if module in _ROW_PARALLEL_MODULES:
            lora_a = plan.shard(name, lora_a).contiguous()
        else:
            lora_b = plan.shard(name, lora_b).contiguous()
        modules[(layer - layers.start, module)] = (lora_a, lora_b)
    return LoRAAdapter(adapter.config, modules)
