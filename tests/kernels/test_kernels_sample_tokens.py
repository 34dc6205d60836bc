"""kvmesh::sample_tokens and kvmesh::apply_penalties_ against the torch sampler's
definitions: greedy rows to the index, the argmax rules on rows without a
distribution, one token per key whatever shares the batch, the inverse
transform's token for a given key, and penalties to the bit. (The
distributions themselves: tests/worker/test_worker_sampler_distribution.py.)"""

from __future__ import annotations

import pytest
import torch

from kvmesh.kernels.cpu_native_backend import NativeCpuAttentionBackend
from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.worker.sampler import (
    apply_penalties,
    draw_keys,
    inverse_transform,
    random_sampling_logits,
    uniforms_from_keys,
)
from tests.worker.sampling_lists import sampling_metadata_from_lists


@pytest.fixture(scope="module")
def backend() -> NativeCpuAttentionBackend:
    return NativeCpuAttentionBackend()  # builds/loads the ops or fails with the reason


def _sample(
    logits: torch.Tensor,
    temperature: list[float],
    keys: torch.Tensor,
    top_k: list[int] | None = None,
    top_p: list[float] | None = None,
    min_p: list[float] | None = None,
) -> torch.Tensor:
    return torch.ops.kvmesh.sample_tokens(
        logits,
        torch.tensor(temperature, dtype=torch.float32),
        None if top_k is None else torch.tensor(top_k, dtype=torch.int64),
        None if top_p is None else torch.tensor(top_p, dtype=torch.float32),
        None if min_p is None else torch.tensor(min_p, dtype=torch.float32),
        keys,
    )


def test_greedy_rows_take_the_argmax_and_rows_without_a_distribution_the_argmax_rules(
    backend,
) -> None:
    logits = torch.randn(6, 3000, generator=torch.Generator().manual_seed(1))
    logits[2] = float("-inf")  # nothing to sample: index 0, as argmax
    logits[3, [100, 2000]] = float("nan")  # the first NaN
    logits[4, [7, 2999]] = float("inf")  # the first +inf
    logits[5, [40, 41]] = 50.0  # greedy with a tie: the first
    temperature = [0.0, 1.0, 1.0, 0.8, 1.0, 0.0]
    tokens = _sample(logits, temperature, draw_keys(6, {}))
    assert tokens[[0, 2, 3, 4, 5]].tolist() == [int(logits[0].argmax()), 0, 100, 7, 40]


def test_a_rows_token_depends_on_its_key_not_on_the_batch(backend) -> None:
    logits = torch.randn(8, 20_000, generator=torch.Generator().manual_seed(2)) * 2
    settings = dict(
        temperature=[1.0, 0.7, 1.0, 1.3, 0.0, 1.0, 0.9, 1.0],
        top_k=[0, 0, 50, 0, 0, 2000, 40, 20_000],
        top_p=[1.0, 0.9, 1.0, 0.5, 1.0, 0.8, 0.95, 0.99],
        min_p=[0.0, 0.0, 0.0, 0.1, 0.0, 0.0, 0.02, 0.0],
    )
    keys = draw_keys(8, {})
    batched = _sample(logits, keys=keys, **settings)
    for row in range(8):
        alone = {name: values[row : row + 1] for name, values in settings.items()}
        assert int(_sample(logits[row : row + 1], keys=keys[row : row + 1], **alone)) == int(
            batched[row]
        ), f"row {row}"
    reversed_rows = list(range(7, -1, -1))
    shuffled = {name: [values[r] for r in reversed_rows] for name, values in settings.items()}
    again = _sample(logits[reversed_rows].contiguous(), keys=keys[reversed_rows], **shuffled)
    assert again.tolist() == batched[reversed_rows].tolist()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.6, top_k=20),
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=1.0, min_p=0.05, top_p=0.95),
        # Flat enough that the nucleus (hundreds to thousands of tokens) is past
        # the 64 candidates: the radix selection.
        SamplingParams(temperature=1.5, top_p=0.9),
        SamplingParams(temperature=2.5, top_p=0.6, top_k=5000),
        SamplingParams(temperature=2.0, top_p=0.95, min_p=0.01),
    ],
)
def test_the_token_for_a_key_is_the_inverse_transform_of_the_torch_distribution(
    backend, params: SamplingParams
) -> None:
    """Both walk the kept tokens in index order to u times their mass: the same
    tokens for the same keys (up to float rounding at a boundary, ~1e-6 a draw)."""
    rows, vocab = 64, 10_000
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(3)) * 2.5
    metadata = sampling_metadata_from_lists(
        [params] * rows, [[1]] * rows, [[]] * rows, {}, [0], vocab
    )
    keys = draw_keys(rows, {})
    probs = torch.softmax(random_sampling_logits(logits, metadata), dim=-1)
    expected = inverse_transform(probs, uniforms_from_keys(keys))
    actual = _sample(
        logits,
        [params.temperature] * rows,
        keys,
        top_k=[params.top_k] * rows,
        top_p=[params.top_p] * rows,
        min_p=[params.min_p] * rows,
    )
    assert actual.tolist() == expected.tolist()


def test_masked_tokens_are_never_drawn_and_ties_at_the_kth_value_are_kept(backend) -> None:
    rows, vocab = 400, 1000
    logits = torch.full((rows, vocab), float("-inf"))
    logits[:, 500:510] = 1.0  # ten tokens tie; top_k 3 keeps all ten
    logits[:, 900] = 0.5
    tokens = _sample(logits, [2.0] * rows, draw_keys(rows, {}), top_k=[3] * rows)
    assert set(tokens.tolist()) == set(range(500, 510))
    tokens = _sample(logits, [2.0] * rows, draw_keys(rows, {}))
    assert set(tokens.tolist()) == {*range(500, 510), 900}


def test_the_op_refuses_inputs_it_cannot_read(backend) -> None:
    logits = torch.randn(2, 100)
    with pytest.raises(RuntimeError, match="float32"):
        _sample(logits.double(), [1.0, 1.0], draw_keys(2, {}))
    with pytest.raises(RuntimeError, match="keys"):
        _sample(logits, [1.0, 1.0], draw_keys(3, {}))


def _penalty_case(seed: int, rows: int = 9, vocab: int = 3000):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=generator) * 3
    logits[0, :50] = float("-inf")
    params = [
        SamplingParams(
            temperature=1.0,
            repetition_penalty=[1.0, 1.3, 0.8, 1.0, 2.0][row % 5],
            presence_penalty=[0.0, 0.5, 0.0, -0.4, 1.0][row % 5],
            frequency_penalty=[0.0, 0.25, 0.7, 0.0, -0.3][row % 5],
        )
        for row in range(rows)
    ]
    prompts = [
        torch.randint(0, 60, (int(n),), generator=generator).tolist()
        for n in torch.randint(1, 200, (rows,), generator=generator)
    ]
    outputs = [
        torch.randint(0, 80, (int(n),), generator=generator).tolist()
        for n in torch.randint(0, 100, (rows,), generator=generator)
    ]
    metadata = sampling_metadata_from_lists(params, prompts, outputs, {}, [0], vocab)
    return logits, metadata


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_native_penalties_are_the_torch_floats(backend, seed: int) -> None:
    logits, metadata = _penalty_case(seed)
    expected = apply_penalties(logits, metadata)
    native = logits.clone()
    assert apply_penalties(native, metadata, native=True) is native  # in place
    assert torch.equal(native, expected)
    assert not torch.equal(native, logits)
