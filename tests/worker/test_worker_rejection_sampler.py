"""The rejection sampler keeps the target distribution (chi-square over many draws);
greedy verification keeps the longest run that equals the argmax."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from kvmesh.worker.rejection_sampler import rejection_sample, split_runs

NUM_REQUESTS = 40_000
P_FIRST = torch.tensor([0.10, 0.20, 0.30, 0.15, 0.25])
P_SECOND = torch.tensor([0.40, 0.05, 0.05, 0.30, 0.20])


def _draws(draft: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """NUM_REQUESTS requests with one draft each: rows alternate draft row / bonus row.
    Returns (first tokens, second tokens where the draft was accepted)."""
    probs = torch.stack([P_FIRST, P_SECOND]).repeat(NUM_REQUESTS, 1)
    drafts = torch.tensor([draft, -1]).repeat(NUM_REQUESTS)
    greedy = probs.argmax(dim=1)
    is_greedy = torch.zeros(2 * NUM_REQUESTS, dtype=torch.bool)
    emitted, accepted = rejection_sample(drafts, greedy, is_greedy, probs, generator)
    first, second = emitted[0::2], emitted[1::2]
    return first, second[accepted[0::2]]


def _p_value(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    observed = torch.bincount(tokens, minlength=len(probs)).double().numpy()
    expected = probs.double().numpy()
    expected = expected / expected.sum() * observed.sum()
    return float(chisquare(observed, expected).pvalue)


@pytest.mark.parametrize("draft", [2, 0, 3])
def test_every_emitted_token_follows_the_target_distribution(draft: int) -> None:
    generator = torch.Generator().manual_seed(1234 + draft)
    first, second_after_accept = _draws(draft, generator)
    # Accepted with probability p(draft), and the first token is distributed as p.
    assert abs(len(second_after_accept) / NUM_REQUESTS - float(P_FIRST[draft])) < 0.01
    assert _p_value(first, P_FIRST) > 0.001
    # After an accepted draft the extra token is drawn from the next position's p.
    assert _p_value(second_after_accept, P_SECOND) > 0.001


def test_the_chi_square_check_catches_a_sampler_that_favours_the_draft() -> None:
    """Power check: always accepting the draft half the time is clearly detected."""
    generator = torch.Generator().manual_seed(7)
    first, _ = _draws(2, generator)
    biased = first.clone()
    biased[: NUM_REQUESTS // 10] = 2
    assert _p_value(biased, P_FIRST) < 1e-6


def test_a_rejected_draft_is_never_emitted_in_its_place() -> None:
    generator = torch.Generator().manual_seed(3)
    probs = torch.tensor([[0.5, 0.5, 0.0]]).repeat(10_000, 1)
    drafts = torch.full((10_000,), 1)
    emitted, accepted = rejection_sample(
        drafts, probs.argmax(dim=1), torch.zeros(10_000, dtype=torch.bool), probs, generator
    )
    assert bool((emitted[~accepted] == 0).all())
    # A draft the target rules out is always rejected.
    emitted, accepted = rejection_sample(
        torch.full((10_000,), 2),
        probs.argmax(dim=1),
        torch.zeros(10_000, dtype=torch.bool),
        probs,
        generator,
    )
    assert not bool(accepted.any())
    assert set(emitted.tolist()) <= {0, 1}


def test_greedy_keeps_the_longest_matching_run_then_the_argmax() -> None:
    # Request A: drafts 4 5 6, argmax 4 5 9 | 8 -> keeps 4 5 then 9.
    # Request B: drafts 1 2, argmax 1 2 | 3 -> keeps both and the bonus 3.
    # Request C: no drafts, argmax 7.
    drafts = torch.tensor([4, 5, 6, -1, 1, 2, -1, -1])
    greedy = torch.tensor([4, 5, 9, 8, 1, 2, 3, 7])
    emitted, accepted = rejection_sample(
        drafts, greedy, torch.ones(8, dtype=torch.bool), None, None
    )
    runs = split_runs(emitted.tolist(), accepted.tolist(), [4, 3, 1])
    tokens = [emitted.tolist()[start : start + count] for start, count in runs]
    assert tokens == [[4, 5, 9], [1, 2, 3], [7]]


def test_greedy_and_random_rows_mix_in_one_batch() -> None:
    generator = torch.Generator().manual_seed(11)
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    drafts = torch.tensor([1, -1, 0, -1])
    greedy = probs.argmax(dim=1)
    is_greedy = torch.tensor([True, True, False, False])
    emitted, accepted = rejection_sample(drafts, greedy, is_greedy, probs, generator)
    assert emitted.tolist() == [1, 2, 0, 2]
    assert accepted.tolist() == [True, False, True, False]
