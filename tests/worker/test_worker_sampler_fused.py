"""A decode step's tokens come from the fused C++ kernels, sampled or greedy:
one kernel call per step, and the torch path is never taken (no silent
fallback that would cost a sampled batch its speed)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import torch

import kvmesh.worker.sampler
from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.worker.local_driver import LocalDriver
from kvmesh.worker.model_runner import ModelRunner


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Counts the calls of kvmesh's sampling ops; the torch sampling path raises."""
    calls: Counter = Counter()
    for name in ("greedy_argmax", "sample_tokens", "apply_penalties_"):
        op = getattr(torch.ops.kvmesh, name)

        def counted(*args: object, _op: Callable = op, _name: str = name) -> object:
            calls[_name] += 1
            return _op(*args)

        monkeypatch.setattr(torch.ops.kvmesh, name, counted)

    def no_fallback(*args: object, **kwargs: object) -> None:
        raise AssertionError("the torch sampling path ran")

    for name in ("random_sampling_logits", "inverse_transform"):
        monkeypatch.setattr(kvmesh.worker.sampler, name, no_fallback)
    return calls


def _decode(runner: ModelRunner, params: list[SamplingParams], steps: int) -> None:
    driver = LocalDriver(runner)
    for index, p in enumerate(params):
        driver.add_request(f"fused-{index}", [1, 2, 3, 4, 5 + index], p, max_new_tokens=steps)
    finished = driver.run()
    assert all(request.error is None for request in finished.values())
    assert all(len(request.output_token_ids) == steps for request in finished.values())


SAMPLED = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.0, top_k=50, min_p=0.05, seed=7),
    SamplingParams(temperature=0.0),
]


def test_a_sampled_batch_takes_one_fused_kernel_call_per_step(runner, kernel_calls) -> None:
    assert runner.sampler.native
    _decode(runner, SAMPLED, steps=4)
    # Four steps (the prefill samples the first token): one call each, greedy row included.
    assert kernel_calls == Counter(sample_tokens=4)


def test_a_greedy_batch_takes_the_greedy_kernel(runner, kernel_calls) -> None:
    _decode(runner, [SamplingParams(temperature=0.0)] * 3, steps=3)
    assert kernel_calls == Counter(greedy_argmax=3)


def test_penalties_take_their_kernel_and_a_neutral_repetition_penalty_costs_nothing(
    runner, kernel_calls
) -> None:
    _decode(runner, [SamplingParams(temperature=1.0, repetition_penalty=1.0)] * 2, steps=2)
    assert kernel_calls == Counter(sample_tokens=2)
    kernel_calls.clear()
    penalized = SamplingParams(temperature=1.0, repetition_penalty=1.2, frequency_penalty=0.3)
    _decode(runner, [penalized, SamplingParams(temperature=0.8)], steps=2)
    assert kernel_calls == Counter(sample_tokens=2, apply_penalties_=2)
