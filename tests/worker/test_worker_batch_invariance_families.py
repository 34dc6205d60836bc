"""Batch-invariant mode on the model zoo's tiny checkpoints, float32 and bfloat16.

Every family of tests/worker/model_families.py but Llama (the default model's
family, tests/worker/test_worker_batch_invariance.py): Qwen3 (per-head q/k
norms), Gemma 3 and 2 (offset norms, GELU, embedding scale, logit soft-cap,
per-layer rope), Qwen3-MoE and Mixtral (a router and experts grouped per
step), Phi-3, OLMo 2 (norms after attention and MLP), Granite
(multipliers) and SmolLM3 (a NoPE layer: q/k unrotated, strided views of the
q/k/v projection): one target prompt runs alone, then inside batches of 1-64
others, chunked at several budgets, after a prefix-cache hit, after a kvstore
load and after a preemption (tests/worker/batch_invariance.py); in the mode every
logits row it samples from equals the lone run's in every bit.

bfloat16 runs here whatever the CPU: on one without AVX512-BF16 or AMX (this
repository's AVX2 box) the projections run torch's bfloat16 matmul instead of
oneDNN's or the feature-pair kernel, and the C++ attention and norms run
their bfloat16 paths, so the check is meaningful on every CPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.kernels import batch_invariant, native
from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.worker.config import CacheConfig, ModelConfig
from kvmesh.worker.model_runner import ModelRunner

from .batch_invariance import Logits, Scenario, Workload, differences, run_scenario
from .model_families import make_family_checkpoint

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(
        native.unavailable_reason() is not None,
        reason=f"C++ kernels unavailable: {native.unavailable_reason()}",
    ),
]

GREEDY = SamplingParams(temperature=0.0)
NEW_TOKENS = 5
ALONE = Scenario("alone")
BLOCK = 4
FAMILIES = (
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Gemma2ForCausalLM",
    "Phi3ForCausalLM",
    "Olmo2ForCausalLM",
    "GraniteForCausalLM",
    "MixtralForCausalLM",
    "SmolLM3ForCausalLM",
)
SCENARIOS = (
    Scenario("batch of 2", others=1),
    Scenario("batch of 17, middle", others=16, before=8),
    Scenario("batch of 65, last", others=64, before=64),
    Scenario("chunked by 1", chunk_size=1),
    Scenario("chunked by 5", chunk_size=5),
    Scenario("chunked by 16", chunk_size=16),
    Scenario("chunked by 7 in a batch of 8", chunk_size=7, others=7, before=3),
    Scenario("prefix hit, 3 blocks", prefix_blocks=3),
    Scenario("kvstore load, 5 blocks", kvstore_blocks=5),
    Scenario("kvstore load in a batch of 9", kvstore_blocks=2, others=8, before=4),
    Scenario("preempted after 2", preempt_after=2),
    Scenario("preempted after 2 in a batch of 6", preempt_after=2, others=5, before=2),
    Scenario("2 threads, batch of 3", threads=2, others=2, before=1),
)


def _workload(vocab_size: int) -> Workload:
    prompt = [(11 * i + 5) % (vocab_size - 3) + 3 for i in range(37)]
    workload = Workload(prompt, NEW_TOKENS, GREEDY)
    workload.other_prompts = [
        [(7 * i + 13 * j) % (vocab_size - 3) + 3 for j in range(3 + (5 * i) % 41)]
        for i in range(64)
    ]
    return workload


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp(request.param)
    make_family_checkpoint(folder, request.param)
    return folder


@pytest.fixture(scope="module", params=("float32", "bfloat16"))
def runner(request: pytest.FixtureRequest, checkpoint: Path) -> ModelRunner:
    return ModelRunner(
        ModelConfig.from_pretrained(checkpoint, max_model_len=256, dtype=request.param),
        CacheConfig(block_size=BLOCK, num_kv_blocks=1_200),
        num_threads=1,  # a shared 2-core box (tests/worker/conftest.py); one scenario sets 2
    )


@pytest.fixture(scope="module")
def alone(runner: ModelRunner) -> Logits:
    with batch_invariant.forced(True):
        reference = run_scenario(runner, _workload(runner.model_config.vocab_size), ALONE)
    assert len(reference) == NEW_TOKENS
    return reference


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_family_logits_are_batch_invariant(
    runner: ModelRunner, alone: Logits, scenario: Scenario
) -> None:
    with batch_invariant.forced(True):
        got = run_scenario(runner, _workload(runner.model_config.vocab_size), scenario)
    compared, differ, worst = differences(alone, got)
    assert compared == NEW_TOKENS, scenario
    assert differ == 0, f"{scenario.name}: {differ} of {compared} rows differ by {worst}"


def test_family_logits_differ_without_the_mode(runner: ModelRunner) -> None:
    """The comparison can fail: without the mode a batch of 65 and a chunked
    prompt change some of the target's logits (other kernels, other tilings)."""
    workload = _workload(runner.model_config.vocab_size)
    with batch_invariant.forced(False):
        reference = run_scenario(runner, workload, ALONE)
        differ = 0
        for scenario in (SCENARIOS[2], SCENARIOS[4]):
            compared, count, _ = differences(reference, run_scenario(runner, workload, scenario))
            assert compared == NEW_TOKENS
            differ += count
    assert differ > 0
