"""A batch-1 decode step runs each Llama layer of a GGUF file on int8
activations in one C++ call (kvmesh::ggml_llama_layer_row,
``DecoderLayer.forward_row``), and all of them in one call per step
(kvmesh::ggml_llama_layers_row, ``RowStack``): the layer's own ops on the same
tensors, so the same bits as its Python forward, and only where that forward
would make exactly those calls.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.worker.config import CacheConfig, ModelConfig
from kvmesh.worker.local_driver import LocalDriver
from kvmesh.worker.model_runner import ModelRunner
from kvmesh.worker.models.decoder import DecoderLayer
from kvmesh.worker.models.ggml_linear import GGMLLinear
from kvmesh.worker.models.row_stack import RowStack
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


def _count_fused_calls(monkeypatch) -> list[str]:
    """How each layer ran in C++ from now on, one entry per layer run: "layer"
    (``forward_row``) or "stack" (every layer in ``RowStack.forward``)."""
    calls: list[str] = []
    fused_forward = DecoderLayer.forward_row
    stack_forward = RowStack.forward

    def counted(self: DecoderLayer, *args: object) -> object:
        calls.append("layer")
        return fused_forward(self, *args)

    def counted_stack(self: RowStack, *args: object) -> object:
        calls.extend(["stack"] * len(self.layer_args))
        return stack_forward(self, *args)

    monkeypatch.setattr(DecoderLayer, "forward_row", counted)
    monkeypatch.setattr(RowStack, "forward", counted_stack)
    return calls


# Q4_K_M: Q5_0, Q4_K, Q6_K and Q8_0 blocks; Q6_K: Q6_K and Q8_0 (its 576-wide rows);
# Q8_0: every projection Q8_0 (such a file reads as blocks only under w8a8;
# worker/gguf_weights.py).
@pytest.mark.parametrize("mix", ["Q4_K_M", "Q6_K", "Q8_0"])
def test_fused_layers_give_the_python_forwards_bits(
    model_path: Path, monkeypatch, mix: str
) -> None:
    folder = write_mix(model_path, mix, with_reference=False).folder
    runner = _runner(folder, "w8a8")
    layers = runner.model.layers
    assert all(layer.row_args is not None for layer in layers)
    calls = _count_fused_calls(monkeypatch)
    stacked = _generate(runner)
    # Every layer of every decode step (the prompt's step is no single row),
    # all of a step's layers in one call.
    assert calls == ["stack"] * ((NEW_TOKENS - 1) * len(layers))
    # Without the stack, one call per layer.
    runner.model._row_stack = None
    calls.clear()
    fused = _generate(runner)
    assert calls == ["layer"] * ((NEW_TOKENS - 1) * len(layers))
    for layer in layers:
        layer.row_args = None
    calls.clear()
    plain = _generate(runner)
    assert not calls
    # Equal logprobs (top 3 of each step): equal logits, not merely equal tokens.
    assert stacked == fused == plain


def test_stack_on_two_threads_gives_one_threads_bits(model_path: Path) -> None:
    """Threads split each projection's output rows, never one row's sums."""
    folder = write_mix(model_path, "Q4_K_M", with_reference=False).folder
    one = _generate(_runner(folder, "w8a8"))
    threads = torch.get_num_threads()
    try:
        runner = ModelRunner(
            ModelConfig.from_pretrained(folder, max_model_len=64, quantization="w8a8"),
            CacheConfig(block_size=16, num_kv_blocks=8),
            num_threads=2,
        )
        assert runner.model._row_stack is not None
        two = _generate(runner)
    finally:
        torch.set_num_threads(threads)
    assert two == one


def test_stack_runs_only_while_every_layer_is_fused(model_path: Path, monkeypatch) -> None:
    folder = write_mix(model_path, "Q8_0", with_reference=False).folder
    runner = _runner(folder, "w8a8")
    stack = runner.model._row_stack
    assert stack is not None and stack.current(runner.model.layers)
    assert len(stack.segments) == 4 * len(runner.model.layers) == len(stack.norms) * 2
    assert len(stack.blocks) == len(stack.kinds) == sum(stack.segments)
    # One layer back on its Python forward: the others run one call each.
    runner.model.layers[3].row_args = None
    assert not stack.current(runner.model.layers)
    calls = _count_fused_calls(monkeypatch)
    _generate(runner)
    assert calls == ["layer"] * ((NEW_TOKENS - 1) * (len(runner.model.layers) - 1))


def test_float_activations_keep_the_python_forward(model_path: Path) -> None:
    folder = write_mix(model_path, "Q4_K_M", with_reference=False).folder
    runner = _runner(folder, None)
    assert all(layer.row_args is None for layer in runner.model.layers)


def test_q8_0_file_runs_its_blocks_fused_and_gives_the_oracles_tokens(
    model_path: Path, monkeypatch
) -> None:
    files = write_mix(model_path, "Q8_0")
    runner = _runner(files.folder, "w8a8")
    # Every projection, the LM head included, is the file's Q8_0 blocks on
    # int8 activations, not the panel codes a Q8_0 file reads as otherwise.
    packed = runner.model._all_packed()
    assert all(isinstance(p, GGMLLinear) and p.takes_int8_rows for p in packed)
    assert {kind for p in packed for kind in p.rows.kinds} == {GGMLQuantizationType.Q8_0}
    calls = _count_fused_calls(monkeypatch)
    tokens, _ = _generate(runner)
    assert len(calls) == (NEW_TOKENS - 1) * len(runner.model.layers)
    # The oracle: a float32 checkpoint of the gguf package's dequantization of
    # the file's weights, float activations. Q8_0 weights with activations
    # quantized per 32 features pick the same greedy tokens.
    assert files.reference is not None
    assert tokens == _generate(_runner(files.reference, None))[0]
