"""Build and load kvmesh's C++ CPU kernels (``kernels/csrc``) as torch custom ops.

The ops are compiled with the machine's g++ against the installed torch, once,
into a cache folder keyed by everything the binary depends on (source, torch
version, compiler flags, the CPU's instruction-set flags), so a checkout
upgrade, a torch upgrade or a container moved to another CPU rebuilds instead
of loading a stale or illegal binary. ``make install`` builds ahead of time
(``python -m kernels.native build``); a process that finds no binary builds it
on first use, under a file lock so that concurrent workers build once. The
cache folder is ``KVMESH_KERNEL_CACHE`` (services/config/process.py).

``-march=native`` because the binary is built where it runs; ``-ffast-math``
only for the sources that need a vectorized ``exp`` (``SOURCES``), and only at
compile time: the link step omits it, so ``crtfastmath.o`` never flips the
whole process into flush-to-zero mode.

The elementwise ops and decode attention take float32 or bfloat16 tensors
(``NATIVE_DTYPES``: bfloat16 is computed in float32 and rounded where torch's
bfloat16 ops round); the block-code linear is float32 only; batched LoRA
(``add_lora``) takes either and accumulates in float32.

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

from services.config.process import CXX, KERNEL_CACHE, NATIVE_KERNELS

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
# Each source with its own extra flags: -ffast-math where a vectorized exp
# matters and a few ulps do not; none where results must round like torch's.
FAST_MATH = ("-ffast-math",)
SOURCES: dict[str, tuple[str, ...]] = {
    "paged_attention_cpu.cpp": FAST_MATH,
    "block_code_linear.cpp": (),
    "rms_norm_cpu.cpp": ("-fno-math-errno",),
    "silu_and_mul_cpu.cpp": FAST_MATH,
    "rotary_cpu.cpp": ("-ffp-contract=off",),
    # Sums of products: fused multiply-adds are both faster and closer.
    "lora_cpu.cpp": ("-ffp-contract=fast",),
}
LIBRARY_NAME = "kvmesh_cpu_ops.so"
# Element types of rms_norm, add_rms_norm, silu_and_mul, rotary_embedding and
# paged_decode_attention (kernels/csrc/float_or_bf16.h).
NATIVE_DTYPES = frozenset({torch.float32, torch.bfloat16})

COMPILE_FLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp",
    "-std=c++20",
    "-fPIC",
    "-w",  # torch's headers warn a lot under -std=c++20; our own code is tested instead
)
# -fopenmp links libgomp.so.1, which resolves to the copy torch already loaded:
# at::parallel_for then runs on torch's own thread pool.
LINK_FLAGS = ("-shared", "-fopenmp")


class NativeKernelsUnavailable(RuntimeError):
    """The C++ ops cannot be built or loaded here; the message says why."""


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return platform.processor()


def build_key() -> str:
    digest = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):  # sources and the headers they include
        digest.update(path.name.encode() + path.read_bytes())
    for part in (
        torch.__version__,
        sys.version,
        platform.machine(),
        _cpu_flags(),
        *COMPILE_FLAGS,
        *LINK_FLAGS,
        *(flag for flags in SOURCES.values() for flag in flags),
    ):
        digest.update(part.encode())
    return digest.hexdigest()[:20]


def library_path() -> Path:
    return KERNEL_CACHE.get() / build_key() / LIBRARY_NAME


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


def build(force: bool = False) -> Path:
    """Compile the ops into the cache (if not there yet); returns the library's path."""
    from torch.utils import cpp_extension

    target = library_path()
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
            commands = []
            for name, extra in SOURCES.items():
                obj = Path(scratch) / f"{Path(name).stem}.o"
                source = str(CSRC / name)
                commands.append(
                    [compiler, *COMPILE_FLAGS, *extra, abi, *includes, "-c", source, "-o", str(obj)]
                )
                objects.append(str(obj))
            # One compiler per core: each file spends seconds in torch's headers.
            with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
                list(pool.map(_run, commands))
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
    logger.info("built native kernels into %s", target)
    return target


@functools.cache
def _load() -> str | None:
    """Build if needed and load into torch.ops.kvmesh; the reason on failure, else None."""
    if not NATIVE_KERNELS.get():
        return f"turned off by {NATIVE_KERNELS.name}=0"
    if platform.system() != "Linux":
        return f"built for Linux only, not {platform.system()}"
    try:
        path = build()
        torch.ops.load_library(str(path))
    except (NativeKernelsUnavailable, OSError, RuntimeError) as exc:
        logger.warning("native CPU kernels unavailable: %s", exc)
        return str(exc)
    return None


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
    args = parser.parse_args(argv)
    if args.command == "path":
        print(library_path())
        return 0
    try:
        path = build(force=args.force)
        torch.ops.load_library(str(path))
    except NativeKernelsUnavailable as exc:
        print(f"native CPU kernels not built: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
