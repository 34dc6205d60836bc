"""Give a loaded model its adapter slots (``--enable-lora``)."""

from __future__ import annotations

import logging

import torch

from kvmesh.kernels import native
from kvmesh.services.contracts.lora_request import LoRARequest
from kvmesh.worker.lora.adapter import LoRAAdapter, load_adapter, shard_adapter
from kvmesh.worker.lora.slots import AgreeOnFailures, LoRASlots
from kvmesh.worker.models.decoder import DecoderForCausalLM, full_plan

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
    model: DecoderForCausalLM,
    max_loras: int,
    max_rank: int,
    device: torch.device,
    agree_on_failures: AgreeOnFailures | None = None,
) -> LoRASlots:
    """Slots for ``max_loras`` adapters of rank <= ``max_rank``, wired into every layer.

    On a rank of a tensor/pipeline-parallel replica (``model.plan``) each
    adapter is read whole, checked against the whole model, and cut to the
    rank's part (``shard_adapter``); ``agree_on_failures`` makes every rank
    fail an adapter that failed to load on any of them (LoRASlots).
    On CPU the deltas run in the C++ kernel where it loads and fits the dtype,
    decided here once (the reason logged when not); else torch matmuls, on a
    GPU the Triton kernels.
    """
    config, plan, declaration = model.config, model.plan, model.declaration
    whole = full_plan(config)
    dtype = config.dtype

    def load(lora: LoRARequest) -> LoRAAdapter:
        adapter = load_adapter(
            lora.lora_path,
            config.num_layers,
            declaration,
            whole,
            config.hidden_size,
            max_rank,
            dtype,
        )
        return shard_adapter(adapter, declaration, plan, config.hidden_size)

    slots = LoRASlots(
        model.lora_shapes(), max_loras, max_rank, load, dtype, device, agree_on_failures
    )
    reason = native_lora_unavailable_reason(device, dtype)
    if reason is None:
        slots.set_native(True)
        logger.info("LoRA deltas: C++ kernel, one call per projection")
    elif device.type == "cpu":
        logger.warning("LoRA deltas: torch matmuls per adapter (%s)", reason)
    model.attach_lora(slots.layers)
    return slots
