"""Process settings: environment variables that are not per-service flags.

Where caches live and which kernels run are properties of a machine or an
experiment, not of one service, so they are plain variables that every
process of the stack reads (``kvmesh up`` and :class:`LocalStack` hand them
to their children unchanged). Each is declared here once, with its type,
default and meaning, and read through :meth:`EnvSetting.get`; nothing else in
the code base reads ``os.environ``.

Variables the launcher *sets* for its children and never reads
(``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``, ``TOKENIZERS_PARALLELISM``,
``PYTHONUNBUFFERED``) are documented where it sets them, in
``services/cli/launcher.py``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from kvmesh.services.runtime.config.options import ENV_PREFIX, converter

T = TypeVar("T")


@dataclass(frozen=True)
class EnvSetting(Generic[T]):
    """One environment variable: its name, type, default (as text, as it would be set) and use."""

    name: str
    type: type[T]
    default: str
    help: str

    def get(self, environ: Mapping[str, str] | None = None) -> T:
        """The typed value; unset or empty means the default."""
        environ = os.environ if environ is None else environ
        raw = environ.get(self.name) or self.default
        try:
            return converter(self.type)(raw)
        except ValueError as e:
            raise ValueError(f"{self.name}={raw!r}: {e}") from e


# Read inside the stack's processes, which no flag reaches.
MODEL_CACHE = EnvSetting(
    "KVMESH_MODEL_CACHE",
    Path,
    "~/.cache/kvmesh/models",
    "folder of prepared models; the default model is converted into it once",
)
KERNEL_CACHE = EnvSetting(
    "KVMESH_KERNEL_CACHE",
    Path,
    "~/.cache/kvmesh/kernels",
    "folder of the compiled C++ CPU kernels, one subfolder per build key",
)
NATIVE_KERNELS = EnvSetting(
    "KVMESH_NATIVE_KERNELS",
    bool,
    "1",
    "0 turns the C++ CPU kernels off (attention falls back to the torch path): an A/B switch",
)
CPU_ISA = EnvSetting(
    "KVMESH_CPU_ISA",
    str,
    "auto",
    "instruction-set level of the C++ CPU kernels: auto (the best this CPU runs) or one of "
    "generic, avx2, avx512, avx512_bf16, amx (kernels/cpu_isa.py): an A/B and test switch",
)
DENSE_LINEAR = EnvSetting(
    "KVMESH_DENSE_LINEAR",
    bool,
    "0",
    "1 keeps plain F.linear for every projection (no oneDNN, no C++ ops): an A/B switch",
)
AMX_LINEAR = EnvSetting(
    "KVMESH_AMX_LINEAR",
    bool,
    "1",
    "0 packs dense bfloat16 projections for oneDNN instead of running small batches on "
    "kernels/csrc/amx_linear.cpp over the plain weight (AMX level only): an A/B switch",
)
BATCH_INVARIANT = EnvSetting(
    "VLLM_BATCH_INVARIANT",
    bool,
    "0",
    "1 turns the worker's batch-invariant mode on, as --batch-invariant does (vLLM's name, "
    "which its users already set): a request's logits do not depend on its batch "
    "(kernels/batch_invariant.py)",
)
CXX = EnvSetting(
    "CXX", str, "", "C++ compiler for the native kernels (default: g++, then c++, on PATH)"
)
TRITON_INTERPRET = EnvSetting(
    "TRITON_INTERPRET",
    bool,
    "0",
    "Triton's own switch to its CPU interpreter; the triton backend then accepts CPU tensors",
)

# Read by tools around the stack.
OPENAI_API_KEY = EnvSetting(
    "OPENAI_API_KEY", str, "", "default --api-key of `kvmesh bench` (as OpenAI's clients)"
)
GPU_CHECK_ALLOW_CPU = EnvSetting(
    "KVMESH_GPU_CHECK_ALLOW_CPU",
    bool,
    "0",
    "1 lets benchmarks/gpu_check.sh dry-run on CPU (Triton interpreter, tiny shapes)",
)

PROCESS_SETTINGS: tuple[EnvSetting[Any], ...] = (
    MODEL_CACHE,
    KERNEL_CACHE,
    NATIVE_KERNELS,
    CPU_ISA,
    DENSE_LINEAR,
    AMX_LINEAR,
    BATCH_INVARIANT,
    CXX,
    TRITON_INTERPRET,
)
TOOL_SETTINGS: tuple[EnvSetting[Any], ...] = (OPENAI_API_KEY, GPU_CHECK_ALLOW_CPU)
ENV_SETTINGS: dict[str, EnvSetting[Any]] = {s.name: s for s in (*PROCESS_SETTINGS, *TOOL_SETTINGS)}


def environment_without_options() -> dict[str, str]:
    """This process's environment for a child, minus every ``KVMESH_*`` service option.

    Process settings pass (the child's processes read them themselves);
    service options do not, so that the child is configured by what its
    parent says (flags, or :func:`config_to_env`), not by a stray variable.
    """
    return {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(ENV_PREFIX) or name in ENV_SETTINGS
    }
