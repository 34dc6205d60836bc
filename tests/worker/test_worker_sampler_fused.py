"""A decode step's tokens come from the fused C++ kernels, sampled or greedy:
one kernel call per step, and the torch path is never taken (no silent
fallback that would cost a sampled batch its speed)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import torch

import kvmesh.worker.sampler
from kvmesh.kernels.native import ensure_loaded
from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.worker.local_driver import LocalDriver
from kvmesh.worker.model_runner import ModelRunner
from kvmesh.worker.sampler import Sampler
from tests.worker.sampling_lists import sampling_metadata_from_lists


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Counts the calls of kvmesh's sampling ops; the torch sampling path raises."""
    ensure_loaded()  # builds/loads the ops or fails with the reason
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


# Top-p on flat rows (a random-weight model's: nuclei of most of the vocabulary)
# is past the kernel's 64 candidates: its radix selection, still the one call.
FLAT_TOP_P = [
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=0.7, top_p=0.9, seed=3),
    SamplingParams(temperature=1.0, top_p=0.95, top_k=100, min_p=0.01),
    SamplingParams(temperature=0.0),
]


def test_top_p_on_a_random_weight_models_flat_rows_takes_the_fused_kernel(
    tiny_runner, kernel_calls
) -> None:
    assert tiny_runner.sampler.native
    _decode(tiny_runner, FLAT_TOP_P, steps=4)
    assert kernel_calls == Counter(sample_tokens=4)


def _smallest_nucleus_logit(row: torch.Tensor, temperature: float, top_p: float) -> float:
    """The lowest logit in the row's top-p nucleus, from a float64 sort."""
    ordered = row.double().sort(descending=True).values
    cumulative = torch.softmax(ordered / temperature, dim=0).cumsum(0)
    size = int((cumulative < top_p).sum()) + 1
    return float(ordered[size - 1])


def test_flat_rows_of_the_default_vocabulary_take_one_call_and_stay_in_the_nucleus(
    kernel_calls,
) -> None:
    rows, vocab = 16, 49_152
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(temperature=0.7, top_p=0.9)] * 10 + [
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=1.0, top_p=0.95, top_k=30_000),
        SamplingParams(temperature=1.2, top_p=0.8, min_p=0.001),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_p=0.9, seed=11),
    ]
    metadata = sampling_metadata_from_lists(params, [[1]] * rows, [[]] * rows, {}, [0], vocab)
    output = Sampler(native=True)(logits, metadata)
    assert kernel_calls == Counter(sample_tokens=1)
    assert output.failed_rows == {}
    for row, p in enumerate(params):
        token = int(output.token_ids[row])
        if p.top_p < 1.0 and p.min_p == 0.0:
            floor = _smallest_nucleus_logit(logits[row], p.temperature, p.top_p)
            # A nucleus of thousands of tokens, and the token inside it.
            assert int((logits[row] >= floor).sum()) > 1_000 or p.top_p == 0.5
            assert float(logits[row, token]) >= floor, f"row {row}"
    assert int(output.token_ids[13]) == int(logits[13].argmax())
