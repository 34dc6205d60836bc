"""A projection kept plain in the compute dtype shares one tensor with its parameter.

Packing rounds every parameter to the compute dtype; where the packed
projection holds that very rounding as its plain weight (amx_linear's
bfloat16 weight, the torch linear's), the parameter must point at it rather
than keep a second copy of the same values.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from worker.config import CacheConfig, ModelConfig
from worker.model_runner import ModelRunner

from .conftest import make_tiny_checkpoint


def _parameters(layer) -> dict[str, torch.Tensor]:
    return {
        "qkv": layer.qkv_proj,
        "o": layer.o_proj,
        "gate_up": layer.gate_up_proj,
        "down": layer.down_proj,
    }


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_plain_projections_share_their_parameter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: str
) -> None:
    monkeypatch.setenv("KVMESH_DENSE_LINEAR", "1")  # plain weights on every CPU
    make_tiny_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM", torch.float32)
    runner = ModelRunner(
        ModelConfig.from_pretrained(tmp_path / "ckpt", dtype=dtype),
        CacheConfig(block_size=4, num_kv_blocks=64),
        num_threads=1,
    )
    model = runner.model
    for layer in model.layers:
        for name, param in _parameters(layer).items():
            plain = layer._packed[name].weight
            assert plain is not None
            assert param.dtype == getattr(torch, dtype)
            assert param.data_ptr() == plain.data_ptr(), name


def test_the_shared_parameters_hold_the_packed_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The unpacked path (F.linear on the parameters) gives the packed path's
    # logits bit for bit: the parameters are the weights the model runs.
    monkeypatch.setenv("KVMESH_DENSE_LINEAR", "1")
    make_tiny_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM", torch.float32)
    runner = ModelRunner(
        ModelConfig.from_pretrained(tmp_path / "ckpt", dtype="bfloat16"),
        CacheConfig(block_size=4, num_kv_blocks=64),
        num_threads=1,
    )
    generator = torch.Generator().manual_seed(0)
    for layer in runner.model.layers:
        for name, param in _parameters(layer).items():
            rows = torch.randn(5, param.shape[1], generator=generator).to(torch.bfloat16)
            packed = layer._packed[name](rows)
            assert torch.equal(packed, torch.nn.functional.linear(rows, param)), name


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_lm_head_shares_its_parameter_tied_or_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tied: bool
) -> None:
    monkeypatch.setenv("KVMESH_DENSE_LINEAR", "1")
    make_tiny_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM", torch.float32, tied)
    runner = ModelRunner(
        ModelConfig.from_pretrained(tmp_path / "ckpt", dtype="bfloat16"),
        CacheConfig(block_size=4, num_kv_blocks=64),
        num_threads=1,
    )
    model = runner.model
    head = model._packed_lm_head.weight
    assert head is not None and model.lm_head.data_ptr() == head.data_ptr()
    # Tied: the embedding table is that same tensor, and lookups read it.
    assert (model.embed_tokens.data_ptr() == head.data_ptr()) is tied
    if tied:  # the table is counted once, with the projections
        assert model.weight_bytes()["parameters"] < head.numel() * head.element_size()
