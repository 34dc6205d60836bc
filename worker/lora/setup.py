"""Give a loaded model its adapter slots (``--enable-lora``)."""

from __future__ import annotations

import logging

import torch

from kernels import native
from services.lora_request import LoRARequest
from worker.lora.adapter import LoRAAdapter, load_adapter
from worker.lora.slots import LoRASlots
from worker.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


def native_lora_unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when the C++ LoRA kernel (kernels/csrc/lora_cpu.cpp) serves this
    model; otherwise why the torch path does, in words."""
    if device.type != "cpu":
        return f"the C++ kernel is for CPU, not {device.type}"
    if dtype not in native.NATIVE_DTYPES:
        return f"the C++ kernel takes float32 or bfloat16, not {dtype}"
    return native.unavailable_reason()


def attach_lora_slots(
    model: LlamaForCausalLM, max_loras: int, max_rank: int, device: torch.device
) -> LoRASlots:
    """Slots for ``max_loras`` adapters of rank <= ``max_rank``, wired into every layer.

    On CPU the deltas run in the C++ kernel where it loads and fits the dtype,
    decided here once (the reason logged when not); else torch matmuls, on a
    GPU the Triton kernels.
    """
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
    reason = native_lora_unavailable_reason(device, dtype)
    if reason is None:
        slots.set_native(True)
        logger.info("LoRA deltas: C++ kernel, one call per projection")
    elif device.type == "cpu":
        logger.warning("LoRA deltas: torch matmuls per adapter (%s)", reason)
    model.attach_lora(slots.layers)
    return slots
