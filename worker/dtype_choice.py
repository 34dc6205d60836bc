"""``--dtype auto``: the compute dtype the hardware runs fastest, and why.

On CPU the choice follows the matmul instructions the CPU has, read from
``/proc/cpuinfo``'s flags (what the kernel reports the CPU and hypervisor
allow, which is what oneDNN dispatches on too):

- AMX-BF16 tiles (Sapphire Rapids and later Xeons): bfloat16. oneDNN's AMX
  kernels run a bf16 linear 2.4-3.7x faster than float32 there.
- AVX512-BF16 (Cooper Lake, Zen 4/5): bfloat16. oneDNN's bf16 dot products
  ran a 2,048-row SmolLM2 projection 2x faster than float32 on the AVX512-BF16
  EPYC (benchmarks/README.md).
- Neither (AVX2 or plain AVX-512): float32. bf16 would be emulated with
  conversions and run slower than float32.

Small decode batches keep the exact 8-bit block-code kernels in either dtype
(worker/models/linear.py), so bfloat16 costs decode nothing on a checkpoint
that has them. On CUDA, auto is the checkpoint's dtype when it is 16-bit and
bfloat16 otherwise (float32 halves the throughput of every tensor core).
An explicit ``--dtype`` always wins.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmesh.services.runtime.config import AUTO_DTYPE
from kvmesh.services.runtime.cpu_features import CpuFeatures


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    # One sentence for the worker's log and /v1/models: why this dtype.
    reason: str


def choose_dtype(
    requested: str | None,
    device: str,
    checkpoint_dtype: torch.dtype,
    features: CpuFeatures | None = None,
) -> DtypeChoice | None:
    """The dtype for ``requested`` when it is "auto" (by the hardware); None for
    anything else (an explicit dtype, or None: the caller decides)."""
    if requested != AUTO_DTYPE:
        return None
    if torch.device(device).type == "cuda":
        if checkpoint_dtype in (torch.bfloat16, torch.float16):
            return DtypeChoice(
                checkpoint_dtype, f"auto on CUDA: the checkpoint's {checkpoint_dtype}"
            )
        return DtypeChoice(torch.bfloat16, "auto on CUDA: bfloat16 for a float32 checkpoint")
    if torch.device(device).type != "cpu":
        return DtypeChoice(checkpoint_dtype, f"auto on {device}: the checkpoint's dtype")
    cpu = features or CpuFeatures.detect()
    where = f"{cpu.model_name} ({cpu.isa_summary()})"
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return DtypeChoice(torch.float32, f"auto: float32, oneDNN has no bf16 kernels on {where}")
    if cpu.amx_bf16:
        return DtypeChoice(torch.bfloat16, f"auto: bfloat16, AMX-BF16 tiles on {where}")
    if cpu.avx512_bf16:
        return DtypeChoice(torch.bfloat16, f"auto: bfloat16, AVX512-BF16 on {where}")
    return DtypeChoice(
        torch.float32, f"auto: float32, no bf16 matmul instructions (AMX/AVX512-BF16) on {where}"
    )
