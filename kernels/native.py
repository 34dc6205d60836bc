"""Build and load kvmesh's C++ CPU kernels (``kernels/csrc``) as torch custom ops.

The ops are compiled with the machine's g++ against the installed torch, once
per instruction-set level (``kernels/cpu_isa.py``: generic, avx2, avx512,
avx512_bf16, amx on x86), each level into its own library in a cache folder keyed
by everything that binary depends on (sources, torch version, compiler and
level flags). The flags are fixed per level rather than ``-march=native``, so
one build serves every CPU (a container image carries all levels) and a
process loads the best level its CPU runs (``KVMESH_CPU_ISA`` may ask for a
lower one), logged with the reason. One library is loaded per process: every
level registers the same ``torch.ops.kvmesh`` ops. ``make install`` builds
the levels this CPU runs (``python -m kvmesh.kernels.native build``; ``--all`` builds
every level, as the Dockerfile does); a process that finds no binary builds
its level on first use, under a file lock so that concurrent workers build
once. The cache folder is ``KVMESH_KERNEL_CACHE`` (services/runtime/config/process.py).

``-ffast-math`` only for the sources that need a vectorized ``exp``
(``SOURCES``), and only at compile time: the link step omits it, so
``crtfastmath.o`` never flips the whole process into flush-to-zero mode.
Inline functions of the headers are compiled into each level's library with
hidden visibility, so no level's library can bind another level's copy.

The elementwise ops and decode attention take float32 or bfloat16 tensors
(``NATIVE_DTYPES``: bfloat16 is computed in float32 and rounded where torch's
bfloat16 ops round); the block-code linear takes float32 activations, and
bfloat16 ones at a level with AVX512-BF16 (``IsaLevel.bf16_dot_products``;
on AMX tiles at ``amx``);
batched LoRA (``add_lora``) takes either and accumulates in float32.
Prefill attention (``paged_prefill_attention``) exists from the avx2 level up
and takes float32 there, and bfloat16 too at levels with bfloat16 dot
products (``IsaLevel.bf16_dot_products``: vdpbf16ps, or AMX tiles at ``amx``).

``KVMESH_NATIVE_KERNELS=0`` turns the ops off (the attention registry then
says so and falls back to the torch path), for A/B benchmarks.
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kvmesh.kernels.cpu_isa import IsaLevel, all_levels, choose_level, level_named, runnable_levels
from kvmesh.services.runtime.config.process import CPU_ISA, CXX, KERNEL_CACHE, NATIVE_KERNELS
from kvmesh.services.runtime.cpu_features import CpuFeatures

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
# Each source with its own extra flags: -ffast-math where a vectorized exp
# matters and a few ulps do not; none where results must round like torch's.
FAST_MATH = ("-ffast-math",)
SOURCES: dict[str, tuple[str, ...]] = {
    "isa_level.cpp": (),
    "paged_attention_cpu.cpp": FAST_MATH,
    "block_code_linear.cpp": (),
    # Exact-rebuild checks: every product rounded before its sum, as torch's.
    "block_code_search.cpp": ("-ffp-contract=off",),
    # GGUF blocks rebuilt as gguf's dequantization rounds them (product, then sum).
    "ggml_block_linear.cpp": ("-ffp-contract=off",),
    # ... and dequantized a k slice at a time into panels for the float32 GEMM.
    "ggml_float_gemm.cpp": ("-ffp-contract=off",),
    # The same blocks times int8 activations (--quantization w8a8): integer sums.
    "ggml_q8_linear.cpp": (),
    # ... and for decode batches of 2 rows and more: codes unpacked once per call.
    "ggml_q8_panel.cpp": (),
    # ... and its loops for one row of x (a batch-1 decode step).
    "ggml_q8_row.cpp": (),
    "int8_linear.cpp": (),
    # Its exp is written out in intrinsics: no -ffast-math needed.
    "prefill_attention_cpu.cpp": (),
    "amx_linear.cpp": (),
    "bf16_pair_linear.cpp": (),
    # Explicit fused multiply-adds at every level: bitwise the same results.
    "bf16_weight_linear.cpp": (),
    "rms_norm_cpu.cpp": (),
    # Its exp is Vec16's from the avx2 level up; -ffast-math would let gcc turn
    # gate / (1 + exp(-gate)) into a reciprocal estimate that makes NaN of inf.
    "silu_and_mul_cpu.cpp": (),
    "rotary_cpu.cpp": ("-ffp-contract=off",),
    # Sums of products: fused multiply-adds are both faster and closer.
    "lora_cpu.cpp": ("-ffp-contract=fast",),
    # Vectorized only under it; finds NaNs from their bits.
    "greedy_argmax_cpu.cpp": FAST_MATH,
    # Its -inf logits must stay -inf; its loops vectorize by `omp simd`.
    "sample_tokens_cpu.cpp": (),
    # Torch's float operations, one by one: no contraction into fused multiply-adds.
    "penalties_cpu.cpp": ("-ffp-contract=off",),
    "kv_cache_write_cpu.cpp": (),
    # Its dot products are intrinsics; exp and tanh must stay libm's (no -ffast-math).
    "fused_moe_cpu.cpp": (),
}
# Sources whose every line is under an AMX (AVX2, AVX512-BF16) guard, empty at other
# levels: those levels skip them instead of spending seconds per file
# compiling nothing.
AMX_ONLY_SOURCES = frozenset({"amx_linear.cpp"})
AVX2_ONLY_SOURCES = frozenset({"prefill_attention_cpu.cpp"})
BF16_DOT_ONLY_SOURCES = frozenset({"bf16_pair_linear.cpp"})
# Compiled once per level and put in front of every source whose extra flags
# are in PCH_NEUTRAL_FLAGS. GCC refuses a precompiled header built under other
# predefined macros (-ffast-math defines __FAST_MATH__), so those sources parse
# the headers themselves. A failed or refused precompile only costs time.
PRECOMPILED_HEADER = "precompiled_torch.h"
PCH_NEUTRAL_FLAGS = frozenset({"-ffp-contract=off", "-ffp-contract=fast"})
LIBRARY_NAME = "kvmesh_cpu_ops.so"
# Element types of rms_norm, add_rms_norm, silu_and_mul, rotary_embedding and
# paged_decode_attention (kernels/csrc/float_or_bf16.h).
NATIVE_DTYPES = frozenset({torch.float32, torch.bfloat16})

COMPILE_FLAGS = (
    "-O3",
    "-fopenmp",
    "-fvisibility=hidden",
    "-fvisibility-inlines-hidden",
    "-std=c++20",
    "-fPIC",
    "-w",  # torch's headers warn a lot under -std=c++20; our own code is tested instead
)
# -fopenmp links libgomp.so.1, which resolves to the copy torch already loaded:
# at::parallel_for then runs on torch's own thread pool.
LINK_FLAGS = ("-shared", "-fopenmp")


class NativeKernelsUnavailable(RuntimeError):
    """The C++ ops cannot be built or loaded here; the message says why."""


def build_key(level: IsaLevel) -> str:
    digest = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):  # sources and the headers they include
        digest.update(path.name.encode() + path.read_bytes())
    for part in (
        torch.__version__,
        sys.version,
        platform.machine(),
        level.name,
        *level.compile_flags,
        *COMPILE_FLAGS,
        *LINK_FLAGS,
        *(flag for flags in SOURCES.values() for flag in flags),
    ):
        digest.update(part.encode())
    return digest.hexdigest()[:20]


def library_path(level: IsaLevel) -> Path:
    return KERNEL_CACHE.get() / f"{level.name}-{build_key(level)}" / LIBRARY_NAME


def _compiler() -> str:
    compiler = CXX.get() or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise NativeKernelsUnavailable("no C++ compiler found (install g++ or set CXX)")
    return compiler


def _run(cmd: list[str]) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise NativeKernelsUnavailable(
            f"{Path(cmd[0]).name} failed ({result.returncode}): {result.stderr.strip()[-2000:]}"
        )


def _precompile(cmd: list[str]) -> None:
    """Precompile the shared header; on failure the sources include it as text."""
    try:
        _run(cmd)
    except NativeKernelsUnavailable as exc:
        Path(cmd[-1]).unlink(missing_ok=True)
        logger.info("precompiled header not built, sources parse it themselves: %s", exc)


def build(level: IsaLevel, force: bool = False) -> Path:
    """Compile the ops for ``level`` into the cache (if not there yet); returns the library."""
    from torch.utils import cpp_extension

    target = library_path(level)
    if target.exists() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    compiler = _compiler()
    with open(target.parent / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same key
        if target.exists() and not force:
            return target
        includes = [f"-I{path}" for path in cpp_extension.include_paths()]
        lib_dirs = cpp_extension.library_paths()
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            objects = []
            abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}"
            flags = [*COMPILE_FLAGS, *level.compile_flags, abi, f'-DKVMESH_ISA="{level.name}"']
            header = Path(scratch) / PRECOMPILED_HEADER
            shutil.copyfile(CSRC / PRECOMPILED_HEADER, header)
            precompile = [*flags, *includes, "-x", "c++-header", str(header), "-o", f"{header}.gch"]
            alone, after_header = [], []
            for name, extra in SOURCES.items():
                if name in AMX_ONLY_SOURCES and not level.amx_tiles:
                    continue
                if name in AVX2_ONLY_SOURCES and not level.avx2:
                    continue
                if name in BF16_DOT_ONLY_SOURCES and not level.bf16_dot_products:
                    continue
                obj = Path(scratch) / f"{Path(name).stem}.o"
                source = ["-c", str(CSRC / name), "-o", str(obj)]
                if PCH_NEUTRAL_FLAGS.issuperset(extra):
                    after_header.append(
                        [compiler, "-include", str(header), *flags, *extra, *includes, *source]
                    )
                else:
                    alone.append([compiler, *flags, *extra, *includes, *source])
                objects.append(str(obj))
            # One compiler per core: the header first, the sources that cannot use it
            # while it compiles, then the rest.
            with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
                header_done = pool.submit(_precompile, [compiler, *precompile])
                waiting = [pool.submit(_run, command) for command in alone]

                def _run_after_header(command: list[str]) -> None:
                    header_done.result()
                    _run(command)

                waiting += [pool.submit(_run_after_header, command) for command in after_header]
                for future in waiting:
                    future.result()
            partial = Path(scratch) / LIBRARY_NAME
            _run(
                [
                    compiler,
                    *LINK_FLAGS,
                    *objects,
                    "-o",
                    str(partial),
                    *[f"-L{path}" for path in lib_dirs],
                    "-lc10",
                    "-ltorch_cpu",
                    *[f"-Wl,-rpath,{path}" for path in lib_dirs],
                ]
            )
            os.replace(partial, target)  # atomic: readers see all of it or nothing
    logger.info("built native kernels (%s) into %s", level.name, target)
    return target


@functools.cache
def _load() -> str | None:
    """Build if needed and load into torch.ops.kvmesh; the reason on failure, else None."""
    if not NATIVE_KERNELS.get():
        return f"turned off by {NATIVE_KERNELS.name}=0"
    if platform.system() != "Linux":
        return f"built for Linux only, not {platform.system()}"
    try:
        choice = choose_level(CpuFeatures.detect(), CPU_ISA.get())
        path = build(choice.level)
        torch.ops.load_library(str(path))
    except ValueError as exc:  # an unknown or unrunnable KVMESH_CPU_ISA
        logger.warning("native CPU kernels unavailable: %s", exc)
        return f"{CPU_ISA.name}: {exc}"
    except (NativeKernelsUnavailable, OSError, RuntimeError) as exc:
        logger.warning("native CPU kernels unavailable: %s", exc)
        return str(exc)
    logger.info("native CPU kernels: %s level, %s", choice.level.name, choice.reason)
    return None


@functools.cache
def loaded_level() -> IsaLevel | None:
    """The instruction-set level of the loaded ops (None when they are unavailable)."""
    if _load() is not None:
        return None
    return level_named(str(torch.ops.kvmesh.isa_level()))


def prefill_attention_dtypes() -> frozenset[torch.dtype]:
    """The dtypes the loaded ops' ``paged_prefill_attention`` takes: float32 from
    the avx2 level up, bfloat16 too where bfloat16 pairs multiply in hardware
    (vdpbf16ps or AMX tiles); none at generic or without the ops."""
    level = loaded_level()
    if level is None or not level.avx2:
        return frozenset()
    if level.bf16_dot_products:
        return frozenset({torch.float32, torch.bfloat16})
    return frozenset({torch.float32})


def blocked_gemm_loaded() -> bool:
    """Whether ``bf16_weight_linear`` and ``float_panel_linear`` run batches of 32
    rows and more as their cache-blocked GEMM (built at the avx2 level only:
    kernels/csrc/bf16_weight_linear.cpp), which beats oneDNN there."""
    level = loaded_level()
    return level is not None and level.name == "avx2"


def amx_tiles_loaded() -> bool:
    """Whether the loaded ops' level has the AMX-tile paths (the block-code
    linear's bfloat16 rows and paged_prefill_attention on tiles, amx_linear)."""
    level = loaded_level()
    return level is not None and level.amx_tiles


def unavailable_reason() -> str | None:
    """None when ``torch.ops.kvmesh.*`` is usable; otherwise why not, in words."""
    return _load()


def ensure_loaded() -> None:
    reason = _load()
    if reason is not None:
        raise NativeKernelsUnavailable(reason)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build kvmesh's C++ CPU kernels.")
    parser.add_argument("command", choices=["build", "path"])
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    parser.add_argument(
        "--all",
        action="store_true",
        help="every level of this architecture, not only those this CPU runs (images)",
    )
    args = parser.parse_args(argv)
    cpu = CpuFeatures.detect()
    levels = all_levels() if args.all else runnable_levels(cpu)
    if args.command == "path":
        print("\n".join(str(library_path(level)) for level in levels))
        return 0
    try:
        for level in levels:
            path = build(level, force=args.force)
            print(f"{level.name}: {path}")
        chosen = choose_level(cpu, CPU_ISA.get()).level
        torch.ops.load_library(str(library_path(chosen)))
    except (NativeKernelsUnavailable, ValueError) as exc:
        print(f"native CPU kernels not built: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
