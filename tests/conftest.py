"""Set-up that must happen before any test module is imported.

``triton.jit`` reads TRITON_INTERPRET when a Triton kernel module is first
imported, and any test module may import one indirectly (worker ->
kvmesh.kernels.registry -> kvmesh.kernels.triton_backend), so on a machine without CUDA the
interpreter is switched on here, before collection, for the Triton kernel
tests (tests/kernels/test_kernels_triton_backend.py, test_kernels_lora.py).
The CPU backends' default order never picks Triton, so nothing else changes.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
