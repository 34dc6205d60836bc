"""Triton attention backend: the device checks live here; kernels import triton lazily."""

from __future__ import annotations

import importlib.util
import os
from typing import ClassVar

import torch

from kernels.torch_reference_backend import TorchReferenceBackend


def triton_interpret_enabled() -> bool:
    """Whether Triton kernels run in its CPU interpreter (read when kernels are first imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class TritonAttentionBackend(TorchReferenceBackend):
    name: ClassVar[str] = "triton"

    @classmethod
    def unsupported_reason(cls, device: torch.device) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "the triton package is not installed"
        if device.type == "cuda":
            return None
        if device.type == "cpu" and triton_interpret_enabled():
            return None
        return f"device {device} is not CUDA and TRITON_INTERPRET is not set"
