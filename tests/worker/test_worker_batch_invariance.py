"""Batch-invariant mode: the same request gets the same logits, bit for bit.

One target prompt runs alone, then inside batches of other requests, chunked
at several budgets, after a prefix-cache hit, after a load from the kvstore,
after a preemption (recompute) and on two threads
(tests/worker/batch_invariance.py): in the mode every logits row it samples
from equals the lone run's in every bit, for the default model in float32 and
bfloat16 and for tiny dense checkpoints of the Llama and Qwen2 families (the
fixed-tile oneDNN path; test_worker_batch_invariance_families.py has the
Qwen3, Gemma 3 and Qwen3-MoE ones). Without the mode the
same comparison finds differences, so the check can fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvmesh.kernels import batch_invariant, native
from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.worker.config import CacheConfig, ModelConfig
from kvmesh.worker.model_runner import ModelRunner

from .batch_invariance import (
    TARGET,
    Logits,
    Scenario,
    Workload,
    differences,
    record_scenario,
    run_scenario,
)
from .conftest import make_tiny_checkpoint

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(
        native.unavailable_reason() is not None,
        reason=f"C++ kernels unavailable: {native.unavailable_reason()}",
    ),
]

GREEDY = SamplingParams(temperature=0.0)
NEW_TOKENS = 6
# A decode step of 40 rows passes MAX_BLOCK_CODE_ROWS (32): oneDNN without the mode.
SCENARIOS = (
    Scenario("batch of 2", others=1),
    Scenario("batch of 5, middle", others=4, before=2),
    Scenario("batch of 40, last", others=39, before=39),
    Scenario("chunked by 1", chunk_size=1),
    Scenario("chunked by 7", chunk_size=7),
    Scenario("chunked by 16", chunk_size=16),
    Scenario("chunked by 40", chunk_size=40),
    Scenario("chunked by 16 in a batch of 8", chunk_size=16, others=7, before=3),
    Scenario("prefix hit, 1 block", prefix_blocks=1),
    Scenario("prefix hit, 3 blocks", prefix_blocks=3),
    Scenario("preempted after 2 tokens", preempt_after=2),
    Scenario("preempted after 3 in a batch of 6", preempt_after=3, others=5, before=2),
    Scenario("2 threads, batch of 3", threads=2, others=2, before=1),
    Scenario("kvstore load, 3 blocks", kvstore_blocks=3),
)
ALONE = Scenario("alone")


def _runner(path: Path, dtype: str, block_size: int = 16) -> ModelRunner:
    return ModelRunner(
        ModelConfig.from_pretrained(path, max_model_len=256, dtype=dtype),
        CacheConfig(block_size=block_size, num_kv_blocks=800),
        num_threads=1,  # a shared 2-core box (tests/worker/conftest.py); one scenario sets 2
    )


@pytest.fixture(scope="module")
def target_prompt(prompts: list[list[int]]) -> list[int]:
    prompt = prompts[2]  # ~56 tokens: a prefill past MAX_BLOCK_CODE_ROWS
    assert len(prompt) > 48
    return prompt


@pytest.fixture(scope="module")
def float32_runner(model_path: Path) -> ModelRunner:
    return _runner(model_path, "float32")


@pytest.fixture(scope="module")
def bfloat16_runner(model_path: Path) -> ModelRunner:
    return _runner(model_path, "bfloat16")


def _alone(runner: ModelRunner, workload: Workload) -> Logits:
    reference = run_scenario(runner, workload, ALONE)
    assert len(reference) == NEW_TOKENS
    return reference


def _assert_identical(
    runner: ModelRunner,
    workload: Workload,
    scenarios: tuple[Scenario, ...],
    reference: Logits | None = None,
) -> None:
    """In the mode, each scenario's logits equal the lone run's (``reference``
    if given, else run here) in every bit."""
    with batch_invariant.forced(True):
        if reference is None:
            reference = _alone(runner, workload)
        for scenario in scenarios:
            got = run_scenario(runner, workload, scenario)
            compared, differ, worst = differences(reference, got)
            # A preempted request's tokens before the preemption are sampled
            # once, the rest again after the recompute: all are compared.
            assert compared == NEW_TOKENS, scenario
            assert differ == 0, f"{scenario.name}: {differ} of {compared} rows differ by {worst}"


@pytest.fixture(scope="module")
def float32_alone(float32_runner: ModelRunner, target_prompt: list[int]) -> Logits:
    """The target's logits run alone in the mode, once for every float32 scenario."""
    with batch_invariant.forced(True):
        return _alone(float32_runner, Workload(target_prompt, NEW_TOKENS, GREEDY))


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_float32_logits_are_batch_invariant(
    float32_runner: ModelRunner,
    target_prompt: list[int],
    float32_alone: Logits,
    scenario: Scenario,
) -> None:
    workload = Workload(target_prompt, NEW_TOKENS, GREEDY)
    _assert_identical(float32_runner, workload, (scenario,), float32_alone)


def test_float32_logits_differ_without_the_mode(
    float32_runner: ModelRunner, target_prompt: list[int]
) -> None:
    """The comparison can fail: today's paths change a row's sums with the
    chunking (decode vs prefill attention; block-code kernel vs oneDNN where
    float32 weights are not kept as panels: the panels and the codes sum each
    row's chain in order, so on the avx2 level projections no longer differ)."""
    workload = Workload(target_prompt, NEW_TOKENS, GREEDY)
    with batch_invariant.forced(False):
        reference = _alone(float32_runner, workload)
        for scenario in (
            Scenario("chunked by 1", chunk_size=1),
            Scenario("recompute", preempt_after=2),
        ):
            compared, differ, _ = differences(
                reference, run_scenario(float32_runner, workload, scenario)
            )
            assert compared == NEW_TOKENS
            assert differ > 0, scenario


@pytest.mark.parametrize(
    "scenario",
    (SCENARIOS[1], SCENARIOS[2], SCENARIOS[4], SCENARIOS[9], SCENARIOS[11], SCENARIOS[13]),
    ids=lambda s: s.name,
)
def test_bfloat16_logits_are_batch_invariant(
    bfloat16_runner: ModelRunner, target_prompt: list[int], scenario: Scenario
) -> None:
    workload = Workload(target_prompt, NEW_TOKENS, GREEDY)
    _assert_identical(bfloat16_runner, workload, (scenario,))


def test_bfloat16_logits_differ_without_the_mode(
    bfloat16_runner: ModelRunner, target_prompt: list[int]
) -> None:
    """The bfloat16 comparison can fail on this CPU too (no AVX512-BF16 needed):
    without the mode, chunking changes the kernels a row's sums go through."""
    workload = Workload(target_prompt, NEW_TOKENS, GREEDY)
    with batch_invariant.forced(False):
        reference = _alone(bfloat16_runner, workload)
        compared, differ, _ = differences(
            reference, run_scenario(bfloat16_runner, workload, SCENARIOS[5])
        )
    assert compared == NEW_TOKENS
    assert differ > 0


def test_seeded_sampling_gets_the_same_tokens(
    float32_runner: ModelRunner, target_prompt: list[int]
) -> None:
    """A sampled request with a seed draws the same tokens in any batch."""
    workload = Workload(target_prompt, NEW_TOKENS, SamplingParams(temperature=1.0, seed=1234))
    with batch_invariant.forced(True):
        alone = record_scenario(float32_runner, workload, ALONE)
        for scenario in (SCENARIOS[2], SCENARIOS[5], SCENARIOS[10]):
            got = record_scenario(float32_runner, workload, scenario)
            assert got.tokens[TARGET] == alone.tokens[TARGET], scenario
            assert differences(alone.logits[TARGET], got.logits[TARGET])[1] == 0, scenario


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_tiny_dense_checkpoints_are_batch_invariant(tmp_path: Path, architecture: str) -> None:
    """Dense weights (no block codes) run oneDNN on fixed 16-row tiles."""
    # head_dim 64: the decode kernel's run path (other sizes never split a context).
    make_tiny_checkpoint(tmp_path, architecture, torch.float32, hidden_size=256)
    runner = _runner(tmp_path, "float32", block_size=4)
    assert runner.model.block_code_coverage()[0] == 0  # random weights: no codes
    prompt = list(range(5, 5 + 37))
    workload = Workload(prompt, NEW_TOKENS, GREEDY)
    workload.other_prompts = [[(7 * i + j) % 120 + 3 for j in range(3 + i % 30)] for i in range(40)]
    scenarios = (
        Scenario("batch of 40", others=39, before=10),
        Scenario("chunked by 5", chunk_size=5),
        Scenario("prefix hit, 2 blocks", prefix_blocks=2),
        Scenario("preempted", preempt_after=2, others=3, before=1),
    )
    _assert_identical(runner, workload, scenarios)
