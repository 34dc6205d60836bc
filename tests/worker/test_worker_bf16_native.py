"""In bfloat16 the C++ CPU ops change no greedy token of the default model.

The native runner fuses RMSNorm/SwiGLU/rotary and runs decode attention in C++
(float32 softmax and accumulation, one rounding of the output); the reference
runner is the plain torch path in bfloat16 for those ops (the projections are
the same in both). The elementwise ops round where torch does and differ by at most an ulp
or two where float32 details cross a rounding boundary, and attention rounds
less often than torch's bfloat16 SDPA, so logits differ slightly; on these
prompts no greedy choice is that close, and the tokens must be equal.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from services.sampling_params import SamplingParams
from worker.config import CacheConfig, ModelConfig
from worker.local_driver import LocalDriver
from worker.model_runner import ModelRunner

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
    assert _greedy_batch(native, prompts) == expected
