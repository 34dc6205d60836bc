"""KV-cache groups in the worker (vLLM v1's hybrid KV cache): layers grouped by
attention type share tensor pairs by their position in the group, each layer
reads its group's block table, and the scheduler's per-group block ids drive
it. A Gemma 2 checkpoint (local, global, local layers) served in three groups
gives transformers' greedy tokens, with chunked prefill, prefix-cache hits and
preemption.

Until the kernels attend over a window (another branch), the window here is
at least max_model_len, which full attention computes exactly; the groups,
their tables and the shared tensors are what is under test."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvmesh.scheduler.config import SchedulerConfig
from kvmesh.scheduler.request import Request
from kvmesh.scheduler.scheduler import Scheduler
from kvmesh.services.contracts.kv_cache_groups import group_layers
from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.worker.config import CacheConfig, ModelConfig
from kvmesh.worker.model_runner import ModelRunner

from .conftest import hf_greedy_tokens
from .model_families import make_family_checkpoint
from .parallel_ranks import RunSpec, run_replica, run_single

BLOCK = 4
NEW_TOKENS = 24
MAX_MODEL_LEN = 128
LONG = [(7 * i + 3) % 160 for i in range(70)]
# A long prompt, a short one, and one sharing the long one's first 40 tokens.
PROMPTS = [LONG, [5, 9, 11, 2, 150, 31, 77], [*LONG[:40], 12, 13, 14, 15, 16]]
# Gemma 2's layers: local, global, local; its window (256) covers the context.
WINDOWS = [256, None, 256]


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    folder = tmp_path_factory.mktemp("gemma2_groups")
    hf_model = make_family_checkpoint(folder, "Gemma2ForCausalLM")
    expected = [
        hf_greedy_tokens(hf_model, prompt, NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        for prompt in PROMPTS
    ]
    return folder, expected


def _runner(folder: Path, grouped: bool, **cache: int) -> ModelRunner:
    return ModelRunner(
        ModelConfig.from_pretrained(folder, max_model_len=MAX_MODEL_LEN),
        CacheConfig(block_size=BLOCK, **cache),
        num_threads=1,
        kv_cache_groups=group_layers(WINDOWS) if grouped else None,
    )


def _generate(runner: ModelRunner, num_kv_blocks: int) -> tuple[list[list[int]], int]:
    """Every prompt in one batch through the real scheduler, in 16-token chunks
    (the third admitted after the first's prompt is cached); tokens per prompt
    and the number of preemptions."""
    scheduler = Scheduler(
        SchedulerConfig(
            max_model_len=MAX_MODEL_LEN,
            block_size=BLOCK,
            num_kv_blocks=num_kv_blocks,
            max_num_batched_tokens=32,
            long_prefill_token_threshold=16,
            watermark=0.0,
            kv_cache_windows=tuple(g.sliding_window for g in runner.kv_cache_groups),
        )
    )
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    preemptions = 0
    for index, prompt in enumerate(PROMPTS):
        scheduler.add_request(Request(f"r{index}", prompt, params, (), 0.0))
        if index == 0:
            # Run the first prompt's prefill so the third finds it cached.
            while not tokens["r0"]:
                step = scheduler.schedule()
                for output in scheduler.update_from_output(step, runner.execute_model(step)):
                    tokens[output.request_id].extend(output.new_token_ids)
    while scheduler.has_unfinished_requests():
        step = scheduler.schedule()
        for output in scheduler.update_from_output(step, runner.execute_model(step)):
            assert output.error is None, output.error
            tokens[output.request_id].extend(output.new_token_ids)
        scheduler.check_integrity()
        preemptions += scheduler.make_stats().num_preemptions
    return list(tokens.values()), preemptions


def test_groups_share_tensor_pairs_by_position_and_a_block_costs_a_group(gemma2) -> None:
    folder, _ = gemma2
    budget = 3 << 16  # a whole number of blocks either way
    plain = _runner(folder, grouped=False, kv_cache_memory_bytes=budget)
    grouped = _runner(folder, grouped=True, kv_cache_memory_bytes=budget)
    assert len(plain.kv_cache_groups) == 1  # a window covering the context frees nothing
    assert [g.sliding_window for g in grouped.kv_cache_groups] == [None, 256, 256]
    # Three groups of one layer: one tensor pair, each layer a page of it per block.
    key_caches = {id(k) for k, _ in grouped.kv_caches}
    assert len(key_caches) == 1 and len({id(k) for k, _ in plain.kv_caches}) == 3
    assert grouped.num_kv_blocks == 3 * plain.num_kv_blocks


def test_grouped_cache_gives_transformers_greedy_tokens(gemma2) -> None:
    folder, expected = gemma2
    assert all(len(set(tokens)) > 1 for tokens in expected)
    plain, _ = _generate(_runner(folder, grouped=False, num_kv_blocks=256), 256)
    grouped, _ = _generate(_runner(folder, grouped=True, num_kv_blocks=256), 256)
    assert plain == expected
    assert grouped == expected


def test_grouped_cache_survives_preemption(gemma2) -> None:
    folder, expected = gemma2
    # Room for one request of max_model_len in three groups (and the third
    # prompt's hit), not for all three prompts' 24 blocks per group each.
    tokens, preemptions = _generate(_runner(folder, grouped=True, num_kv_blocks=98), 98)
    assert preemptions > 0
    assert tokens == expected


def test_a_step_missing_a_groups_block_ids_fails_its_request(gemma2) -> None:
    folder, _ = gemma2
    runner = _runner(folder, grouped=True, num_kv_blocks=98)
    scheduler = Scheduler(
        SchedulerConfig(
            max_model_len=MAX_MODEL_LEN,
            block_size=BLOCK,
            num_kv_blocks=98,
            kv_cache_windows=(None, 256, 256),
        )
    )
    scheduler.add_request(
        Request("r", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=2), (), 0.0)
    )
    step = scheduler.schedule()
    step.scheduled_new_reqs[0].group_block_ids.pop()
    output = runner.execute_model(step)
    assert "KV-cache groups" in output.errors["r"]


def test_grouped_cache_at_tp2_matches_one_process(gemma2) -> None:
    """Each rank lays out its KV heads' share of the groups' tensors; the one
    scheduler's per-group block ids drive every rank."""
    folder, _ = gemma2
    spec = RunSpec(str(folder), [PROMPTS[0][:30], PROMPTS[1]], kv_cache_windows=tuple(WINDOWS))
    plain = run_single(dataclasses.replace(spec, kv_cache_windows=None, micro_batches=1))
    grouped = run_single(spec)
    assert grouped[0] == plain[0]
    assert run_replica(2, 1, spec)[0] == grouped[0]
