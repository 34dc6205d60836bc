"""The sampler's per-request columns are gathered once per batch composition: a
decode step whose rows are the previous step's reuses them (no per-row Python),
and a step after a request joins or leaves gathers them again."""

from __future__ import annotations

import numpy as np
import torch

from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.worker.local_driver import LocalDriver
from kvmesh.worker.model_runner import ModelRunner
from kvmesh.worker.sampler import SamplerOutput
from kvmesh.worker.sampling_metadata import (
    SamplingColumnsCache,
    SamplingMetadata,
    build_sampling_metadata,
    gather_request_columns,
    step_sampling_metadata,
)


def test_the_cache_gathers_again_only_when_the_key_changes() -> None:
    cache = SamplingColumnsCache()
    params = [SamplingParams(temperature=0.5), SamplingParams(temperature=0.0)]
    gathered: list[int] = []

    def gather(n: int):
        gathered.append(n)
        return gather_request_columns(params[:n], [0], 100), {}

    first, _ = cache.get((1, b"rows"), lambda: gather(2))
    again, _ = cache.get((1, b"rows"), lambda: gather(2))
    assert again is first and gathered == [2]
    other, _ = cache.get((2, b"rows"), lambda: gather(1))
    assert gathered == [2, 1] and other.temperature.tolist() == [0.5]
    assert cache.misses == 2


def test_step_metadata_from_columns_is_build_sampling_metadatas() -> None:
    """min_tokens, penalties and bad words come from the step's tokens, vectorized."""
    params = [
        SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=(7, 9)),
        SamplingParams(temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.5),
        SamplingParams(temperature=0.8, min_tokens=1, ignore_eos=True, stop_token_ids=(4,)),
        SamplingParams(temperature=1.0, bad_words_token_ids=((5, 6), (8,)), logit_bias=((3, 2.0),)),
        SamplingParams(temperature=1.0, min_tokens=5),
    ]
    token_ids = np.array(
        [
            [1, 2, 3, 4, 5, 0],
            [1, 2, 2, 2, 0, 0],
            [1, 2, 3, 0, 0, 0],
            [1, 2, 5, 0, 0, 0],
            [1, 2, 3, 4, 5, 6],
        ]
    )
    prompt_lens = np.array([2, 2, 1, 2, 2])
    num_tokens = np.array([5, 4, 3, 3, 6])  # outputs 3, 2, 2, 1, 4
    expected = build_sampling_metadata(params, token_ids, prompt_lens, num_tokens, {}, [2], 10)
    columns = gather_request_columns(params, [2], 10)
    for _ in range(2):  # the same columns serve every step
        actual = step_sampling_metadata(columns, token_ids, prompt_lens, num_tokens, {}, 10)
        # Rows 0 and 2 have their minimum; row 4 (4 of 5) blocks its stop ids and EOS.
        assert actual.min_tokens_block is not None
        assert actual.min_tokens_block[0].tolist() == [4]
        assert actual.min_tokens_block[1].tolist() == [2]
        assert actual.banned_token_mask is not None
        assert torch.nonzero(actual.banned_token_mask).tolist() == [[3, 6], [3, 8]]
        for name in (
            "temperature",
            "is_greedy",
            "repetition_penalty",
            "frequency_penalty",
            "token_ids",
            "prompt_lens",
            "num_tokens",
            "banned_token_mask",
        ):
            assert torch.equal(getattr(actual, name), getattr(expected, name)), name
        assert [t.tolist() for t in actual.logit_bias] == [t.tolist() for t in expected.logit_bias]
        assert [t.tolist() for t in actual.min_tokens_block] == [
            t.tolist() for t in expected.min_tokens_block
        ]


def test_decode_steps_reuse_the_columns_and_a_leaving_request_refreshes_them(
    tiny_runner: ModelRunner,
) -> None:
    """Requests of distinct temperatures leave after 2, 4 and 6 tokens: every step
    samples exactly the live requests' temperatures, and only the steps after a
    change of the batch gather the columns."""
    temperatures = {"a": 0.5, "b": 0.7, "c": 0.9}
    lengths = {"a": 2, "b": 4, "c": 6}
    seen: list[list[float]] = []
    sampler = tiny_runner.sampler

    def recording(logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        seen.append(sorted(round(t, 3) for t in metadata.temperature.tolist()))
        return sampler(logits, metadata)

    tiny_runner.sampler = recording  # type: ignore[assignment]
    misses_before = tiny_runner.sampling_columns.misses
    try:
        driver = LocalDriver(tiny_runner)
        for req_id, temperature in temperatures.items():
            params = SamplingParams(temperature=temperature, ignore_eos=True)
            driver.add_request(req_id, [1, 2, 3], params, max_new_tokens=lengths[req_id])
        finished = driver.run()
    finally:
        tiny_runner.sampler = sampler
    assert all(len(finished[r].output_token_ids) == lengths[r] for r in lengths)
    live = [sorted(temperatures[r] for r in temperatures if lengths[r] > step) for step in range(6)]
    assert seen == live
    # Six steps, three compositions (all three, then b and c, then c).
    assert tiny_runner.sampling_columns.misses - misses_before == 3
