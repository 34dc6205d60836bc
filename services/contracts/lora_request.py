"""Which LoRA adapter a request runs with (mirrors protos LoRARequest)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter as the scheduler and worker see it.

    ``lora_id`` is content-derived (SHA-256 over the adapter's config and
    weights), so it is the identity everything keys on: the prefix-cache hash,
    the per-step adapter count and the worker's slots. ``lora_name`` is only
    what clients call it.
    """

    lora_name: str
    lora_id: str
    lora_path: str
