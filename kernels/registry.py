"""Pick an attention backend for a device, and say why each candidate was taken or refused.

Default order: on CUDA, Triton then the torch path then the reference; on CPU,
the C++ decode kernels, then the torch CPU path, then the reference. Triton's
interpreter also runs on CPU but is far too slow to serve, so it is only used
there when asked for by name.
"""

from __future__ import annotations

import logging

import torch

from kvmesh.kernels import batch_invariant
from kvmesh.kernels.backend import AttentionBackend
from kvmesh.kernels.cpu_attention import CpuAttentionBackend
from kvmesh.kernels.cpu_native_backend import NativeCpuAttentionBackend
from kvmesh.kernels.torch_reference_backend import TorchReferenceBackend
from kvmesh.kernels.triton_backend import TritonAttentionBackend

logger = logging.getLogger(__name__)

BACKENDS: dict[str, type[AttentionBackend]] = {
    TorchReferenceBackend.name: TorchReferenceBackend,
    CpuAttentionBackend.name: CpuAttentionBackend,
    NativeCpuAttentionBackend.name: NativeCpuAttentionBackend,
    TritonAttentionBackend.name: TritonAttentionBackend,
}


def _default_order(device: torch.device) -> list[str]:
    if batch_invariant.enabled():
        # The one backend with a fixed reduction order per row (kernels/batch_invariant.py).
        return [NativeCpuAttentionBackend.name]
    if device.type == "cuda":
        return ["triton", "cpu", "torch_reference"]
    return ["cpu_native", "cpu", "torch_reference"]


def _as_device(device: torch.device | str) -> torch.device:
    return device if isinstance(device, torch.device) else torch.device(device)


def explain_backend_choice(device: torch.device | str, preferred: str | None = None) -> list[str]:
    """One line per known backend: chosen, refused (with the reason) or not tried."""
    device = _as_device(device)
    order = [preferred] if preferred is not None else _default_order(device)
    lines: list[str] = []
    chosen: str | None = None
    for name in order:
        if name not in BACKENDS:
            lines.append(f"{name}: refused: unknown backend (known: {', '.join(BACKENDS)})")
            continue
        reason = BACKENDS[name].unsupported_reason(device)
        if reason is not None:
            lines.append(f"{name}: refused: {reason}")
        elif chosen is None:
            chosen = name
            how = "forced by preferred" if preferred is not None else "first supported"
            lines.append(f"{name}: chosen for device {device} ({how})")
        else:
            lines.append(f"{name}: supported, not needed (already chose {chosen})")
    for name in BACKENDS:
        if name not in order:
            why = (
                f"not requested (preferred={preferred!r})"
                if preferred is not None
                else f"not in the default order for device type {device.type}"
            )
            lines.append(f"{name}: skipped: {why}")
    return lines


def select_attention_backend(
    device: torch.device | str, preferred: str | None = None
) -> AttentionBackend:
    """The backend to use on ``device``; ``preferred`` forces one by name or raises why not."""
    device = _as_device(device)
    if batch_invariant.enabled() and preferred not in (None, NativeCpuAttentionBackend.name):
        raise ValueError(
            f"attention backend {preferred!r} is not batch-invariant: batch-invariant mode "
            f"runs {NativeCpuAttentionBackend.name!r} (or leave the backend unset)"
        )
    lines = explain_backend_choice(device, preferred)
    for line in lines:
        logger.info("attention backend: %s", line)
    order = [preferred] if preferred is not None else _default_order(device)
    for name in order:
        backend_cls = BACKENDS.get(name)
        if backend_cls is not None and backend_cls.supports_device(device):
            return backend_cls()
    raise ValueError(
        f"no attention backend for device {device} (preferred={preferred!r}): " + "; ".join(lines)
    )
