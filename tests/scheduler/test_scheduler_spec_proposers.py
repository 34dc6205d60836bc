"""Draft proposers: n-gram lookup and suffix matching (automaton checked against brute force)."""

from __future__ import annotations

import random

import pytest

from kvmesh.scheduler.spec_decode.ngram import NgramProposer
from kvmesh.scheduler.spec_decode.suffix import RecentOutputs, SuffixProposer
from kvmesh.scheduler.spec_decode.suffix_automaton import SuffixAutomaton


def test_ngram_takes_the_longest_match_and_its_most_recent_occurrence() -> None:
    proposer = NgramProposer(min_n=1, max_n=3)
    #          0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 3, 9, 9, 2, 3, 4, 1, 2, 3]
    # (1, 2, 3) occurred at 0 followed by 9 9 2; (2, 3) most recently at 5 -> 4 1.
    assert proposer.propose(tokens, 3) == [9, 9, 2]
    assert NgramProposer(min_n=1, max_n=2).propose(tokens, 3) == [4, 1, 2]


def test_ngram_respects_min_n_and_max_drafts() -> None:
    tokens = [7, 1, 2, 8, 3, 2]  # only the 1-gram (2) repeats
    assert NgramProposer(min_n=1, max_n=4).propose(tokens, 2) == [8, 3]
    assert NgramProposer(min_n=2, max_n=4).propose(tokens, 2) == []
    assert NgramProposer(min_n=1, max_n=1).propose(tokens, 0) == []
    assert NgramProposer(min_n=1, max_n=1).propose([2], 3) == []
    # Drafts stop at the end of the known tokens.
    assert NgramProposer(min_n=2, max_n=2).propose([4, 5, 4, 5], 5) == [4, 5]
    with pytest.raises(ValueError):
        NgramProposer(min_n=3, max_n=2)


def _brute_longest_repeated_suffix(tokens: list[int]) -> int:
    n = len(tokens)
    best = 0
    for length in range(1, n):
        suffix = tokens[n - length :]
        if any(tokens[i : i + length] == suffix for i in range(n - length)):
            best = length
    return best


def _brute_first_end(tokens: list[int], pattern: list[int]) -> int:
    for i in range(len(tokens) - len(pattern) + 1):
        if tokens[i : i + len(pattern)] == pattern:
            return i + len(pattern) - 1
    return -1


@pytest.mark.parametrize("seed", range(20))
def test_suffix_automaton_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 60))]
    automaton = SuffixAutomaton()
    for end in range(1, len(tokens) + 1):
        automaton.append(tokens[end - 1])
        prefix = tokens[:end]
        length, first_end = automaton.longest_repeated_suffix()
        assert length == _brute_longest_repeated_suffix(prefix)
        if length:
            assert first_end == _brute_first_end(prefix, prefix[end - length :])
            assert first_end < end - 1
    assert automaton.num_states <= max(2 * len(tokens) - 1, 1) + 1
    query = [rng.randrange(3) for _ in range(8)]
    length, first_end = automaton.longest_suffix_match(query)
    expected = max(
        (k for k in range(1, 9) if _brute_first_end(tokens, query[8 - k :]) >= 0), default=0
    )
    assert length == expected
    if length:
        assert first_end == _brute_first_end(tokens, query[8 - length :])


def test_suffix_proposer_uses_its_own_tokens_and_scales_drafts_with_the_match() -> None:
    proposer = SuffixProposer(max_depth=8, max_spec_factor=1.0, max_cached_requests=4)
    tokens = [10, 11, 12, 13, 14, 15, 10, 11, 12]
    assert proposer.propose("a", tokens, 8) == [13, 14, 15]  # 3 matched -> 3 drafts
    tokens += [13]
    assert proposer.propose("a", tokens, 2) == [14, 15]
    assert SuffixProposer(8, 0.5, 4).propose("b", tokens, 8) == [14, 15]  # 4 matched -> 2


def test_suffix_proposer_learns_from_finished_requests_outputs() -> None:
    proposer = SuffixProposer(max_depth=8, max_spec_factor=2.0, max_cached_requests=4)
    proposer.propose("a", [1, 2], 4)
    proposer.finish("a", [20, 21, 22, 23, 24])
    assert proposer.num_requests == 0
    # A new request that starts writing the same output gets the rest of it,
    # never running past that output's end into another one.
    assert proposer.propose("b", [5, 6, 20, 21], 8) == [22, 23, 24]


def test_recent_outputs_keep_two_generations_only() -> None:
    recent = RecentOutputs(max_requests=4)  # two outputs per generation
    for i in range(6):
        recent.add([100 + i, 200 + i])
    corpora = list(recent.automata())
    held = [t for corpus in corpora for t in corpus.tokens if t >= 0]
    # The sixth output filled a generation: it and the fifth are all that is left.
    assert sorted(held) == [104, 105, 204, 205]
    recent.add([106, 206])
    held = [t for corpus in recent.automata() for t in corpus.tokens if t >= 0]
    assert sorted(held) == [104, 105, 106, 204, 205, 206]
    assert all(corpus.longest_suffix_match([100, 200])[0] < 2 for corpus in corpora)


def test_suffix_proposer_ignores_one_token_matches() -> None:
    proposer = SuffixProposer(max_depth=8, max_spec_factor=4.0, max_cached_requests=4)
    assert proposer.propose("a", [1, 2, 3, 9, 1], 4) == []  # only "1" repeats
    assert proposer.propose("a", [1, 2, 3, 9, 1, 2], 4) == [3, 9, 1, 2]
