"""A batch-1 decode step runs each Llama layer of a GGUF file on int8
activations in one C++ call (kvmesh::ggml_llama_layer_row,
``DecoderLayer.forward_row``): the layer's own ops on the same tensors, so
the same bits as its Python forward, and only where that forward would make
exactly those calls.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.worker.config import CacheConfig, ModelConfig
from kvmesh.worker.local_driver import LocalDriver
from kvmesh.worker.model_runner import ModelRunner
from kvmesh.worker.models.decoder import DecoderLayer
from tests.worker.kquant_files import write_mix

pytestmark = pytest.mark.model

PROMPT = [(17 * i) % 1000 + 10 for i in range(12)]
NEW_TOKENS = 5


def _runner(folder: Path, quantization: str | None) -> ModelRunner:
    return ModelRunner(
        ModelConfig.from_pretrained(folder, max_model_len=64, quantization=quantization),
        CacheConfig(block_size=16, num_kv_blocks=8),
        num_threads=1,
    )


def _generate(runner: ModelRunner) -> tuple[list[int], list[object]]:
    driver = LocalDriver(runner)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
    driver.add_request("r", PROMPT, params, NEW_TOKENS)
    done = driver.run()["r"]
    return done.output_token_ids, done.logprobs


def test_fused_layers_give_the_python_forwards_bits(model_path: Path, monkeypatch) -> None:
    folder = write_mix(model_path, "Q4_K_M", with_reference=False).folder
    runner = _runner(folder, "w8a8")
    layers = runner.model.layers
    assert all(layer.row_args is not None for layer in layers)
    calls = []
    fused_forward = DecoderLayer.forward_row

    def counted(self: DecoderLayer, *args: object) -> object:
        calls.append(self)
        return fused_forward(self, *args)

    monkeypatch.setattr(DecoderLayer, "forward_row", counted)
    fused = _generate(runner)
    # Every layer of every decode step (the prompt's step is no single row).
    assert len(calls) == (NEW_TOKENS - 1) * len(layers)
    for layer in layers:
        layer.row_args = None
    calls.clear()
    plain = _generate(runner)
    assert not calls
    # Equal logprobs (top 3 of each step): equal logits, not merely equal tokens.
    assert fused == plain


def test_float_activations_keep_the_python_forward(model_path: Path) -> None:
    folder = write_mix(model_path, "Q4_K_M", with_reference=False).folder
    runner = _runner(folder, None)
    assert all(layer.row_args is None for layer in runner.model.layers)
