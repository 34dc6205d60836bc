"""Give a loaded model its adapter slots (``--enable-lora``)."""

from __future__ import annotations

import torch

from services.lora_request import LoRARequest
from worker.lora.adapter import LoRAAdapter, load_adapter
from worker.lora.slots import LoRASlots
from worker.models.llama import LlamaForCausalLM


def attach_lora_slots(
    model: LlamaForCausalLM, max_loras: int, max_rank: int, device: torch.device
) -> LoRASlots:
    """Slots for ``max_loras`` adapters of rank <= ``max_rank``, wired into every layer."""
    layer_shapes = model.lora_shapes()
    module_shapes = {
        (layer, module): (shape.in_features, size)
        for layer, projections in enumerate(layer_shapes)
        for shape in projections.values()
        for module, _, size in shape.slices
    }
    dtype = model.config.dtype

    def load(lora: LoRARequest) -> LoRAAdapter:
        return load_adapter(
            lora.lora_path,
            len(layer_shapes),
            lambda layer, module: module_shapes[(layer, module)],
            max_rank,
            dtype,
        )

    slots = LoRASlots(layer_shapes, max_loras, max_rank, load, dtype, device)
    model.attach_lora(slots.layers)
    return slots
