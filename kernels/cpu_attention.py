"""Fast CPU attention path (placeholder: delegates to the reference for now)."""

from __future__ import annotations

from typing import ClassVar

from kernels.torch_reference_backend import TorchReferenceBackend


class CpuAttentionBackend(TorchReferenceBackend):
    name: ClassVar[str] = "cpu"
