"""A projection's weight is held once: by its packed forms, with the parameter
sharing or released.

Packing rounds every parameter to the compute dtype; where the packed
projection holds that very rounding as its plain weight (amx_linear's
bfloat16 weight, the torch linear's), the parameter must point at it rather
than keep a second copy of the same values. Where it holds the weight only in
packed layouts (oneDNN's, the bf16 pairs, block codes), the parameter keeps
its shape and no storage, and packing again starts from
``PackedLinear.dense_weight``, which must rebuild the weight exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvmesh.kernels import native
from kvmesh.worker.config import CacheConfig, ModelConfig
from kvmesh.worker.model_runner import ModelRunner
from kvmesh.worker.models.linear import PackedLinear, onednn_available, pair_kernel_loaded
from kvmesh.worker.models.quantized import is_placeholder
from tests.kernels.test_kernels_block_codes import q8_0_weight

from .conftest import make_tiny_checkpoint
from .test_worker_model_loader import PROMPTS, _our_logits


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


def _only(linear: PackedLinear) -> str:
    """Which form dense_weight will rebuild from."""
    if linear.weight is not None:
        return "plain"
    if linear.codes is not None:
        return "codes"
    return "pairs" if linear._pairs is not None else "onednn"


@pytest.mark.parametrize(
    ("form", "dtype"),
    [
        ("plain", torch.float32),
        ("onednn", torch.float32),
        ("onednn", torch.bfloat16),
        ("pairs", torch.bfloat16),
        ("codes", torch.float32),
        ("codes", torch.bfloat16),
    ],
)
def test_dense_weight_rebuilds_the_weight_exactly(form: str, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(5)
    # An odd number of outputs; 1,090 input features take two identity slices
    # (1,024 + 66 rows) when the weight lives only in oneDNN's layout.
    weight = torch.randn(67, 1090, generator=generator)
    if form == "codes":
        weight = q8_0_weight(67, 1088, seed=5)
    if form in ("onednn", "pairs") and not onednn_available(weight, dtype):
        pytest.skip(f"no oneDNN {dtype} here")
    if form == "pairs" and not pair_kernel_loaded():
        pytest.skip("the loaded kernels' level keeps no bf16 pairs")
    if form == "codes" and native.unavailable_reason() is not None:
        pytest.skip(native.unavailable_reason())
    if form == "codes" and dtype == torch.bfloat16 and not onednn_available(weight, dtype):
        # Without oneDNN bf16 the batches past the codes kernel run F.linear,
        # which keeps the plain bfloat16 weight (the "plain" case above).
        pytest.skip(f"no oneDNN {dtype} here: codes keep a plain weight beside them")
    linear = PackedLinear(
        weight,
        use_onednn=form != "plain",
        use_block_codes=form in ("pairs", "codes"),
        dtype=dtype,
    )
    assert _only(linear) == form
    rebuilt = linear.dense_weight()
    # Codes give back the float32 weight they were found in; the others its rounding.
    expected = weight if form == "codes" else weight.to(dtype)
    assert rebuilt.dtype == expected.dtype and torch.equal(rebuilt, expected)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_packed_projections_release_their_parameters_and_pack_again_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: str, tied: bool
) -> None:
    make_tiny_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM", torch.float32, tied)
    config = ModelConfig.from_pretrained(tmp_path / "ckpt", dtype=dtype)
    runner = ModelRunner(config, CacheConfig(block_size=4, num_kv_blocks=64), num_threads=1)
    model = runner.model
    if not onednn_available(torch.zeros(1), getattr(torch, dtype)):
        pytest.skip(f"no oneDNN {dtype} here: the projections stay plain")
    for layer in model.layers:
        for name, param in _parameters(layer).items():
            assert layer._packed[name].weight is None, name
            assert is_placeholder(param) and param.untyped_storage().nbytes() <= 4, name
    # The embedding table stays (lookups read it); an untied head goes.
    assert not is_placeholder(model.embed_tokens)
    assert is_placeholder(model.lm_head) is not tied
    # Packed again as KVMESH_DENSE_LINEAR packs (F.linear on plain weights):
    # exactly the logits of a model loaded that way from the checkpoint.
    model.pack_weights(use_onednn=False, use_native=False)
    monkeypatch.setenv("KVMESH_DENSE_LINEAR", "1")
    plain = ModelRunner(config, CacheConfig(block_size=4, num_kv_blocks=64), num_threads=1)
    for prompt in PROMPTS:
        assert torch.equal(_our_logits(runner, prompt), _our_logits(plain, prompt))
