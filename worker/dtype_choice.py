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

import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from services.config import AUTO_DTYPE

CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class CpuFeatures:
    """The CPU's model name and instruction-set flags (lower case, as Linux names them)."""

    model_name: str
    flags: frozenset[str]

    @property
    def amx_bf16(self) -> bool:
        return "amx_bf16" in self.flags and "amx_tile" in self.flags

    @property
    def avx512_bf16(self) -> bool:
        return "avx512_bf16" in self.flags

    def isa_summary(self) -> str:
        """The matmul-relevant extensions present, best first (for logs)."""
        names = ("amx_bf16", "amx_int8", "avx512_bf16", "avx512_vnni", "avx512f", "avx2")
        present = [name for name in names if name in self.flags]
        return ", ".join(present) or "none of AVX2/AVX-512/AMX"

    @classmethod
    def parse(cls, cpuinfo_text: str) -> CpuFeatures:
        """From the text of /proc/cpuinfo (the first processor's entries)."""
        model_name, flags = "", frozenset[str]()
        for line in cpuinfo_text.splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and not model_name:
                model_name = value.strip()
            elif key == "flags" and not flags:
                flags = frozenset(value.split())
        return cls(model_name or platform.processor() or "unknown CPU", flags)

    @classmethod
    def detect(cls, cpuinfo: Path = CPUINFO) -> CpuFeatures:
        """This machine's CPU; no flags where /proc/cpuinfo is missing (not Linux)."""
        try:
            return cls.parse(cpuinfo.read_text())
        except OSError:
            return cls(platform.processor() or "unknown CPU", frozenset())


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
