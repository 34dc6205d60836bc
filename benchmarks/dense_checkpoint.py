"""A dense copy of a checkpoint: its projections plus a little noise, so no block codes apply.

The default model came from a GGUF Q8_0 file, so every projection weight is
exactly 8-bit block codes (kernels/block_codes.py), and kvmesh runs those on
its block-code kernels. Issue 13 asks that a general (dense) checkpoint stay
as fast as vLLM at the same dtype: this makes one from the default model by
adding Gaussian noise of ``--relative-noise`` x each projection's mean |w|
(1e-4 by default: the outputs barely move, but no block of 32 weights is
codes any more), then checks that ``find_block_codes`` finds none.

    .venv/bin/python benchmarks/dense_checkpoint.py --out /tmp/smollm2-dense
    .venv/bin/python benchmarks/vllm_compare.py --model /tmp/smollm2-dense
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.block_codes import find_block_codes
from services.model_prep import default_model_path

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=default_model_path())
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--relative-noise", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    perturbed = make_dense(args.model, args.out, args.relative_noise, args.seed)
    print(f"{args.out}: {perturbed} projections perturbed, none holds block codes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
