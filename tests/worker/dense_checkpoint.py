"""A dense copy of a checkpoint: its projections plus a little noise, so no block codes apply.

The default model came from a GGUF Q8_0 file, so every projection weight is
exactly 8-bit block codes (kernels/block_codes.py), and kvmesh runs those on
its block-code kernels. Issue 13 asks that a general (dense) checkpoint stay
as fast as vLLM at the same dtype: this makes one from the default model by
adding Gaussian noise of ``--relative-noise`` x each projection's mean |w|
(1e-4 by default: the outputs barely move, but no block of 32 weights is
codes any more), then checks that ``find_block_codes`` finds none.

Made by ``benchmarks/dense_checkpoint.py`` (its command line) and checked by
tests/worker/test_worker_dense_checkpoint.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kvmesh.kernels.block_codes import find_block_codes

# The linear layers' weights in a Llama-family checkpoint (embeddings and norms stay).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def is_projection(name: str) -> bool:
    return name.endswith(".weight") and any(f".{part}." in name for part in PROJECTIONS)


def perturb(
    weight: torch.Tensor, relative_noise: float, generator: torch.Generator
) -> torch.Tensor:
    noise = torch.randn(weight.shape, generator=generator, dtype=torch.float32)
    scale = relative_noise * weight.float().abs().mean()
    return (weight.float() + noise * scale).to(weight.dtype)


def make_dense(source: Path, out: Path, relative_noise: float, seed: int) -> int:
    """Writes the dense copy; returns how many projections were perturbed."""
    weight_files = sorted(source.glob("*.safetensors"))
    if not weight_files:
        raise SystemExit(f"no *.safetensors in {source}")
    out.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and not path.name.startswith("."):
            shutil.copy2(path, out / path.name)
    generator = torch.Generator().manual_seed(seed)
    perturbed = 0
    for path in weight_files:
        tensors = load_file(path)
        for name, tensor in tensors.items():
            if is_projection(name):
                tensors[name] = perturb(tensor, relative_noise, generator)
                if find_block_codes(tensors[name]) is not None:
                    raise SystemExit(f"{name} still holds block codes: raise --relative-noise")
                perturbed += 1
        save_file(tensors, out / path.name, metadata={"format": "pt"})
    return perturbed
