"""In bfloat16 the C++ CPU ops change no greedy token of the default model.

The native runner fuses RMSNorm/SwiGLU/rotary and runs decode attention in C++
(float32 softmax and accumulation, one rounding of the output); the reference
runner is the plain torch path in bfloat16 for those ops (the projections are
the same in both). The elementwise ops round where torch does and differ by at most an ulp
or two where float32 details cross a rounding boundary, and attention rounds
less often than torch's bfloat16 SDPA, so logits differ slightly; the tokens
must be equal up to a greedy choice between two logits one bfloat16 step
apart (a tie at bfloat16's resolution, which either side may break: seen on
one prompt at the amx level, whose projections sum in another order).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.worker.config import CacheConfig, ModelConfig
from kvmesh.worker.local_driver import LocalDriver
from kvmesh.worker.model_runner import ModelRunner

from .test_worker_model_loader import _our_logits

MAX_NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)

pytestmark = pytest.mark.model


def _bf16_runner(model_path: Path, native: bool) -> ModelRunner:
    runner = ModelRunner(
        ModelConfig.from_pretrained(model_path, max_model_len=256, dtype="bfloat16"),
        CacheConfig(block_size=16, num_kv_blocks=128),
        attention_backend=None if native else "cpu",
        num_threads=1,  # see tests/worker/conftest.py: a shared 2-core box
    )
    if not native:
        runner.model.set_native_elementwise(False)
    return runner


def _greedy_batch(runner: ModelRunner, prompts: list[list[int]]) -> list[list[int]]:
    driver = LocalDriver(runner)
    for index, prompt in enumerate(prompts):
        driver.add_request(f"bf16-{index}", prompt, GREEDY, MAX_NEW_TOKENS)
    finished = driver.run()
    return [finished[f"bf16-{index}"].output_token_ids for index in range(len(prompts))]


def test_bf16_native_ops_keep_greedy_tokens(model_path: Path, prompts: list[list[int]]) -> None:
    native = _bf16_runner(model_path, native=True)
    assert native.attention_backend_name == "cpu_native"
    assert native.model.rotary.use_native
    reference = _bf16_runner(model_path, native=False)
    # Both run the same projections (the block codes found before rounding).
    assert native.model.block_code_coverage() == reference.model.block_code_coverage()
    assert not reference.model.rotary.use_native

    expected = _greedy_batch(reference, prompts)
    assert [len(tokens) for tokens in expected] == [MAX_NEW_TOKENS] * len(prompts)
    for prompt, want, got in zip(prompts, expected, _greedy_batch(native, prompts), strict=True):
        if got != want:
            _assert_bf16_tie(model_path, prompt, want, got)


def _assert_bf16_tie(model_path: Path, prompt: list[int], want: list[int], got: list[int]) -> None:
    """Where the tokens first differ, both are the reference's top two and
    their logits at most one bfloat16 step apart."""
    step = next(i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b)
    logits = _our_logits(_bf16_runner(model_path, native=False), prompt + want[:step])[-1]
    top = logits.float().topk(2)
    ulp = 2.0 ** (math.floor(math.log2(abs(top.values[0].item()))) - 7)
    assert {want[step], got[step]} == set(top.indices.tolist()), (step, top)
    assert top.values[0] - top.values[1] <= ulp, (step, top)
