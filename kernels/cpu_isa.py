"""Instruction-set levels of the C++ CPU kernels, and which one this CPU runs.

The kernels are compiled once per level into separate libraries
(``kernels/native.py``) with fixed ``-march`` flags instead of
``-march=native``, so one build (a container image, a shared cache) serves
every x86 server, and a process loads the best level its CPU has:

=============  ===========================================  ==========================
level          compiler flags                               CPUs
=============  ===========================================  ==========================
generic        ``-march=x86-64-v2`` (SSE4.2)                any x86-64 server since ~2009
avx2           ``-march=x86-64-v3`` (AVX2, FMA, F16C)       Haswell+, Zen 1+
avx512         ``-march=x86-64-v4`` (AVX-512 F/BW/CD/DQ/VL) Skylake-SP+, Zen 4+
avx512_bf16    ``x86-64-v4`` + AVX512-BF16 + VNNI           Cooper Lake, Zen 4+
amx            ``avx512_bf16`` + AMX-TILE/BF16/INT8         Sapphire Rapids+
=============  ===========================================  ==========================

What changes between levels: the compiler's auto-vectorization width in every
op, and the block-code linear's hand-written paths (AVX2: two 8-lane halves
per 16-output panel; AVX-512: one register; AVX512-BF16: bfloat16 activations
multiplied with ``vdpbf16ps``, two input features per instruction; AMX:
bfloat16 activations multiplied on AMX tiles with ``tdpbf16ps``, 16 rows x 32
input features x 16 outputs per instruction, so that decode batches of many
rows still only read the codes; float32 activations as at ``avx512_bf16``).
The W8A8 linear (``--quantization w8a8``, kernels/csrc/int8_linear.cpp)
multiplies int8 activations with the codes by ``vpdpbusd`` at the levels with
AVX512-VNNI, on AMX-INT8 tiles (``tdpbsud``) at ``amx`` from 16 rows, and in
portable C++ below (same results on every level, bit for bit).

Other architectures (aarch64) have one level, ``native``, built for the
machine that builds it. ``KVMESH_CPU_ISA`` picks a lower level than the best,
for tests and A/B benchmarks; a level the CPU lacks is refused with its
missing flags, never loaded (it would die on an illegal instruction).
"""

from __future__ import annotations

import platform
from dataclasses import dataclass

from kvmesh.services.runtime.cpu_features import CpuFeatures


@dataclass(frozen=True)
class IsaLevel:
    """One build of the kernels: its compiler flags and the CPU flags it needs."""

    name: str
    compile_flags: tuple[str, ...]
    required_cpu_flags: frozenset[str]
    # bfloat16 pairs multiply in hardware (vdpbf16ps): the block-code linear
    # takes bfloat16 activations and paged_prefill_attention is built.
    bf16_dot_products: bool = False
    # ... and multiplies them on AMX tiles (tdpbf16ps).
    amx_tiles: bool = False

    @property
    def avx2(self) -> bool:
        """Whether the level's code may use AVX2 and FMA."""
        return {"avx2", "fma"} <= self.required_cpu_flags

    def missing(self, cpu: CpuFeatures) -> list[str]:
        """The flags this level needs that the CPU lacks (empty: it runs here)."""
        return sorted(self.required_cpu_flags - cpu.flags)


# Lowest first. The required flags are /proc/cpuinfo's names for what each
# -march level lets the compiler emit.
_X86_V2 = frozenset({"sse4_1", "sse4_2", "ssse3", "popcnt", "cx16"})
_X86_V3 = _X86_V2 | {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"}
_X86_V4 = _X86_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
X86_LEVELS: tuple[IsaLevel, ...] = (
    IsaLevel("generic", ("-march=x86-64-v2",), _X86_V2),
    IsaLevel("avx2", ("-march=x86-64-v3",), _X86_V3),
    IsaLevel("avx512", ("-march=x86-64-v4",), _X86_V4),
    IsaLevel(
        "avx512_bf16",
        ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"),
        _X86_V4 | {"avx512_bf16", "avx512_vnni"},
        bf16_dot_products=True,
    ),
    IsaLevel(
        "amx",
        (
            "-march=x86-64-v4",
            "-mavx512bf16",
            "-mavx512vnni",
            "-mamx-tile",
            "-mamx-bf16",
            "-mamx-int8",
        ),
        _X86_V4 | {"avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8"},
        bf16_dot_products=True,
        amx_tiles=True,
    ),
)
NATIVE_LEVEL = IsaLevel("native", ("-march=native",), frozenset())


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def level_named(name: str) -> IsaLevel:
    for level in all_levels():
        if level.name == name:
            return level
    raise ValueError(f"unknown CPU ISA level {name!r}")


def all_levels() -> tuple[IsaLevel, ...]:
    """Every level this architecture's builds have, lowest first."""
    return X86_LEVELS if is_x86() else (NATIVE_LEVEL,)


def runnable_levels(cpu: CpuFeatures) -> tuple[IsaLevel, ...]:
    """The levels this CPU can run, lowest first."""
    return tuple(level for level in all_levels() if not level.missing(cpu))


@dataclass(frozen=True)
class IsaChoice:
    level: IsaLevel
    reason: str


def choose_level(cpu: CpuFeatures, requested: str = "auto") -> IsaChoice:
    """The best level the CPU runs, or ``requested`` if it runs here; why, in words.

    Raises ValueError for an unknown level or one the CPU cannot run.
    """
    levels = {level.name: level for level in all_levels()}
    runnable = runnable_levels(cpu)
    if requested == "auto":
        if not runnable:
            raise ValueError(
                f"{cpu.model_name} lacks even the {all_levels()[0].name} level's flags: "
                + ", ".join(all_levels()[0].missing(cpu))
            )
        best = runnable[-1]
        return IsaChoice(best, f"best level {cpu.model_name} runs ({cpu.isa_summary()})")
    level = levels.get(requested)
    if level is None:
        raise ValueError(f"unknown CPU ISA level {requested!r}; one of auto, {', '.join(levels)}")
    if missing := level.missing(cpu):
        raise ValueError(f"{cpu.model_name} cannot run the {requested} level: no {missing}")
    return IsaChoice(level, f"requested (best here: {runnable[-1].name})")
