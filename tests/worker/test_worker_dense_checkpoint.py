"""tests/worker/dense_checkpoint.py (written by benchmarks/dense_checkpoint.py): the
dense copy that issue 13's "general checkpoint" figures are measured on has no block
codes left, and nothing but its projections changed."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kvmesh.kernels.block_codes import find_block_codes
from tests.kernels.test_kernels_block_codes import q8_0_weight
from tests.worker.conftest import make_tiny_checkpoint
from tests.worker.dense_checkpoint import is_projection, make_dense


def _quantized_tiny_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    """A tiny Llama whose projections are exact Q8_0 block codes, as the default model's."""
    make_tiny_checkpoint(folder, "LlamaForCausalLM", torch.float32)
    (weights,) = folder.glob("*.safetensors")
    tensors = load_file(weights)
    for seed, name in enumerate(sorted(tensors)):
        if is_projection(name):
            tensors[name] = q8_0_weight(*tensors[name].shape, seed=seed)
            assert find_block_codes(tensors[name]) is not None
    save_file(tensors, weights, metadata={"format": "pt"})
    return tensors


def test_projections_lose_their_codes_and_nothing_else_changes(tmp_path: Path) -> None:
    source, out = tmp_path / "codes", tmp_path / "dense"
    original = _quantized_tiny_checkpoint(source)

    perturbed = make_dense(source, out, relative_noise=1e-4, seed=0)

    dense = load_file(next(out.glob("*.safetensors")))
    assert set(dense) == set(original)
    assert perturbed == sum(is_projection(name) for name in original) == 2 * 7
    for name, tensor in dense.items():
        if is_projection(name):
            assert find_block_codes(tensor) is None, name
            change = (tensor - original[name]).abs().mean() / original[name].abs().mean()
            assert 1e-6 < change < 1e-3, (name, change)
        else:
            assert torch.equal(tensor, original[name]), name
    assert (out / "config.json").read_text() == (source / "config.json").read_text()


def test_the_copy_is_reproducible(tmp_path: Path) -> None:
    source = tmp_path / "codes"
    _quantized_tiny_checkpoint(source)
    make_dense(source, tmp_path / "a", relative_noise=1e-4, seed=3)
    make_dense(source, tmp_path / "b", relative_noise=1e-4, seed=3)
    a = load_file(next((tmp_path / "a").glob("*.safetensors")))
    b = load_file(next((tmp_path / "b").glob("*.safetensors")))
    assert all(torch.equal(a[name], b[name]) for name in a)
