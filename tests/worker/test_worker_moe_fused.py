"""A MoE family's CPU steps run the fused expert kernel (worker/models/moe.py's
fused_experts) over the experts packed in panels at load, and a bfloat16
checkpoint served in float32 keeps its experts in bfloat16 for it, still exact
against transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvmesh.kernels import batch_invariant, native
from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.worker.config import CacheConfig, ModelConfig
from kvmesh.worker.local_driver import LocalDriver
from kvmesh.worker.model_runner import ModelRunner
from kvmesh.worker.models import moe

from .conftest import hf_greedy_tokens
from .model_families import make_family_checkpoint

ARCHITECTURE = "Qwen3MoeForCausalLM"
PROMPT = [(7 * i + 3) % 160 for i in range(20)]
NEW_TOKENS = 6


@pytest.fixture(autouse=True)
def native_ops() -> None:
    native.ensure_loaded()


def _greedy(folder: Path) -> tuple[ModelRunner, list[int]]:
    runner = ModelRunner(
        ModelConfig.from_pretrained(folder),
        CacheConfig(block_size=4, num_kv_blocks=64),
        num_threads=1,
    )
    driver = LocalDriver(runner, chunk_size=16)
    driver.add_request("r0", PROMPT, SamplingParams(temperature=0.0), NEW_TOKENS)
    return runner, driver.run()["r0"].output_token_ids


def _count_fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Rows of every fused_experts call from now on."""
    rows: list[int] = []
    fused = moe.fused_experts

    def counting(hidden: torch.Tensor, *args: object) -> torch.Tensor:
        rows.append(hidden.shape[0])
        return fused(hidden, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(moe, "fused_experts", counting)
    return rows


def test_prefill_chunks_and_decode_steps_call_the_fused_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_family_checkpoint(tmp_path, ARCHITECTURE)
    rows = _count_fused_calls(monkeypatch)
    runner, _ = _greedy(tmp_path)
    layers = sum(layer.router is not None for layer in runner.model.layers)
    # Two prefill chunks (16 + 4 tokens), then one row per decode step, in
    # every layer; the last layer's MLP runs only the rows that sample (none
    # in the first chunk, one in the second).
    first_chunk = [16] * (layers - 1)
    second_chunk = [4] * (layers - 1) + [1]
    assert rows == first_chunk + second_chunk + [1] * (NEW_TOKENS - 1) * layers
    # The fused kernel's outputs do not depend on the batch: batch-invariant
    # mode runs it too (its router through fixed tiles).
    rows.clear()
    with batch_invariant.forced(True):
        _greedy(tmp_path)
    assert rows == first_chunk + second_chunk + [1] * (NEW_TOKENS - 1) * layers


def test_bfloat16_checkpoint_in_float32_keeps_bfloat16_experts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Half the bytes per step, the same model: float32 activations over the
    exact bfloat16 weights, equal to transformers' float32 run of them."""
    hf_model = make_family_checkpoint(tmp_path / "f32", ARCHITECTURE)
    folder = tmp_path / "bf16"
    hf_model.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    hf_model = type(hf_model).from_pretrained(folder, dtype=torch.float32).eval()
    expected = hf_greedy_tokens(hf_model, PROMPT, NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    assert len(set(expected)) > 1, expected
    rows = _count_fused_calls(monkeypatch)
    runner, tokens = _greedy(folder)
    assert tokens == expected and rows
    layer = runner.model.layers[0]
    assert runner.model_config.dtype == torch.float32
    assert layer.experts_gate_up.dtype == layer.experts_down.dtype == torch.bfloat16
    assert moe.is_packed(layer.experts_gate_up)
