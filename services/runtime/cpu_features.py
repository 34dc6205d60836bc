"""The CPU's model name and instruction-set flags, as Linux reports them.

``/proc/cpuinfo``'s flags are what the kernel and the hypervisor let this
process use (a VM may hide extensions the silicon has), which is also what
oneDNN dispatches on: both the dtype choice (``worker/dtype_choice.py``) and
the C++ kernels' instruction-set level (``kernels/cpu_isa.py``) read them here.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

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
