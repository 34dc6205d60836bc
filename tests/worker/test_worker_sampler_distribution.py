"""Sampled tokens follow the exact filtered distribution, per parameter combination.

For each combination, many draws from one row of logits are compared by a
chi-square test with the distribution computed here in float64 straight from
the definitions (temperature, then min_p, then top_k, then the smallest
nucleus reaching top_p), for the C++ sampler (kvmesh::sample_tokens) and the
torch one. Tokens outside the filtered set must never be drawn at all.
"""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

from kvmesh.kernels.native import ensure_loaded
from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.worker.sampler import Sampler
from tests.worker.sampling_lists import sampling_metadata_from_lists

VOCAB = 4096  # 128 chunks of 32: top_k up to 128 takes the candidate path
DRAWS = 24_000
BATCH = 2_000
ALPHA = 1e-3


def filtered_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The probabilities a row samples from, in float64 (ties by index, as the kernel)."""
    x = logits.double() / params.temperature
    probs = torch.softmax(x, dim=0)
    keep = torch.ones_like(x, dtype=torch.bool)
    if params.top_n_sigma > 0:  # on the logits before temperature, as llama.cpp
        raw = logits.double()
        keep &= raw >= raw.max() - params.top_n_sigma * raw.std(unbiased=False)
    if params.min_p > 0:
        keep &= probs >= params.min_p * probs.max()
    if 0 < params.top_k < len(x):
        kth = torch.sort(torch.where(keep, x, -math.inf), descending=True).values[params.top_k - 1]
        keep &= x >= kth
    if params.top_p < 1.0:
        kept = torch.where(keep, probs, 0.0)
        kept = kept / kept.sum()
        order = sorted(range(len(x)), key=lambda i: (-float(x[i]), i))
        nucleus = torch.zeros_like(keep)
        above = 0.0
        for token in order:
            if above >= params.top_p * (1 - 1e-12) or not keep[token]:
                break
            nucleus[token] = True
            above += float(kept[token])
        keep &= nucleus
    filtered = torch.where(keep, probs, 0.0)
    return filtered / filtered.sum()


def draw(sampler: Sampler, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """DRAWS tokens from one row, in batches of BATCH identical rows."""
    metadata = sampling_metadata_from_lists(
        [params] * BATCH, [[1]] * BATCH, [[]] * BATCH, {}, [0], VOCAB
    )
    batch = logits.unsqueeze(0).expand(BATCH, -1).contiguous()
    return torch.cat([sampler(batch, metadata).token_ids for _ in range(DRAWS // BATCH)])


def assert_follows(tokens: torch.Tensor, expected: torch.Tensor) -> None:
    counts = torch.bincount(tokens, minlength=len(expected)).double()
    outside = expected == 0
    assert counts[outside].sum() == 0, f"drew filtered-out tokens {torch.nonzero(counts * outside)}"
    # Bins with too few expected draws for the test are pooled into one.
    big = DRAWS * expected >= 5
    observed = [*counts[big].tolist(), float(counts[~big & ~outside].sum())]
    wanted = [*(DRAWS * expected[big]).tolist(), float(DRAWS * expected[~big].sum())]
    if wanted[-1] < 5:
        observed, wanted = observed[:-1], wanted[:-1]
        scale = sum(observed) / sum(wanted)
        wanted = [w * scale for w in wanted]
    if len(wanted) < 2:
        assert counts.sum() == counts[expected.argmax()]
        return
    result = chisquare(observed, wanted)
    assert result.pvalue > ALPHA, f"chi-square p = {result.pvalue:.2e} over {len(wanted)} bins"


def _logits(scale: float, seed: int, shape: str = "normal") -> torch.Tensor:
    """N(0, scale^2) logits; "ties": rounded to quarters (runs of equal logits at
    every nucleus boundary); "head": 20 tokens 4 above a flat N(0, scale^2) tail."""
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * scale
    if shape == "ties":
        logits = (logits * 4).round() / 4
    elif shape == "head":
        logits[torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:20]] += 4.0
    return logits


COMBINATIONS = {
    "temperature 1": (SamplingParams(temperature=1.0), 3.0),
    "temperature 0.7": (SamplingParams(temperature=0.7), 3.0),
    "temperature 1.5, flat": (SamplingParams(temperature=1.5), 1.0),
    "top_k 50": (SamplingParams(temperature=1.0, top_k=50), 1.0),
    "top_k 5, sharp": (SamplingParams(temperature=0.8, top_k=5), 2.0),
    "top_k 1000 (past the chunk count)": (SamplingParams(temperature=1.0, top_k=1000), 2.0),
    "top_p 0.9": (SamplingParams(temperature=0.7, top_p=0.9), 3.0),
    "top_p 0.5": (SamplingParams(temperature=1.0, top_p=0.5), 3.5),
    # A nucleus of ~2,000 tokens: past the candidates, the exact fallback.
    "top_p 0.95, flat": (SamplingParams(temperature=1.0, top_p=0.95), 0.5),
    "min_p 0.05": (SamplingParams(temperature=1.0, min_p=0.05), 2.0),
    "min_p 0.2, flat": (SamplingParams(temperature=1.0, min_p=0.2), 0.7),
    "top_k 50 + top_p 0.9 + min_p 0.02": (
        SamplingParams(temperature=0.9, top_k=50, top_p=0.9, min_p=0.02),
        2.0,
    ),
    "top_k 1000 + top_p 0.8": (SamplingParams(temperature=1.0, top_k=1000, top_p=0.8), 1.0),
    "min_p 0.1 + top_p 0.7": (SamplingParams(temperature=1.2, top_p=0.7, min_p=0.1), 1.5),
    "top_n_sigma 1": (SamplingParams(temperature=1.0, top_n_sigma=1.0), 1.0),
    "top_n_sigma 2 + top_p 0.9, hot": (
        SamplingParams(temperature=1.5, top_n_sigma=2.0, top_p=0.9),
        1.0,
    ),
}
# Nuclei past the kernel's 64 candidates: its radix selection over (max - x) / T,
# on flat and peaked rows, alone and with every other filter, and with ties at
# the boundary: (params, scale, shape of the logits).
RADIX_COMBINATIONS = {
    "top_p 0.9, flat": (SamplingParams(temperature=1.0, top_p=0.9), 1.0, "normal"),
    "top_p 0.5, flat, T 2": (SamplingParams(temperature=2.0, top_p=0.5), 1.0, "normal"),
    "top_p 0.9, T 0.7, wide": (SamplingParams(temperature=0.7, top_p=0.9), 2.0, "normal"),
    "top_p 0.95, peaked head, flat tail": (
        SamplingParams(temperature=1.0, top_p=0.95),
        0.5,
        "head",
    ),
    "top_p 0.6, ties": (SamplingParams(temperature=1.0, top_p=0.6), 1.0, "ties"),
    "top_p 0.8 + top_k 2000, flat": (
        SamplingParams(temperature=1.0, top_p=0.8, top_k=2000),
        1.0,
        "normal",
    ),
    "top_p 0.9 + min_p 0.05, flat": (
        SamplingParams(temperature=1.0, top_p=0.9, min_p=0.05),
        1.0,
        "normal",
    ),
    "top_p 0.7 + top_k 3000 + min_p 0.02, ties": (
        SamplingParams(temperature=1.3, top_p=0.7, top_k=3000, min_p=0.02),
        1.0,
        "ties",
    ),
}


@pytest.fixture(scope="module")
def native() -> bool:
    ensure_loaded()  # builds/loads the ops or fails with the reason
    return True


@pytest.mark.parametrize("name", list(COMBINATIONS))
def test_native_sampler_draws_the_filtered_distribution(native: bool, name: str) -> None:
    params, scale = COMBINATIONS[name]
    logits = _logits(scale, seed=len(name))
    torch.manual_seed(1)
    assert_follows(
        draw(Sampler(native=True), logits, params), filtered_distribution(logits, params)
    )


@pytest.mark.parametrize("name", list(RADIX_COMBINATIONS))
def test_native_top_p_past_the_candidates_draws_the_filtered_distribution(
    native: bool, name: str
) -> None:
    params, scale, shape = RADIX_COMBINATIONS[name]
    logits = _logits(scale, seed=len(name), shape=shape)
    expected = filtered_distribution(logits, params)
    assert int((expected > 0).sum()) > 64, "the nucleus must be past the candidates"
    torch.manual_seed(4)
    assert_follows(draw(Sampler(native=True), logits, params), expected)


@pytest.mark.parametrize(
    "name", ["temperature 0.7", "top_k 50", "top_p 0.9", "min_p 0.05", "top_n_sigma 1"]
)
def test_torch_sampler_draws_the_filtered_distribution(name: str) -> None:
    params, scale = COMBINATIONS[name]
    logits = _logits(scale, seed=len(name))
    torch.manual_seed(2)
    assert_follows(draw(Sampler(), logits, params), filtered_distribution(logits, params))


def test_the_test_rejects_a_wrong_temperature(native: bool) -> None:
    """The chi-square check can fail: tokens drawn at temperature 1.1 are not temperature 1's."""
    logits = _logits(3.0, seed=3)
    torch.manual_seed(3)
    tokens = draw(Sampler(native=True), logits, SamplingParams(temperature=1.1))
    with pytest.raises(AssertionError, match="chi-square"):
        assert_follows(tokens, filtered_distribution(logits, SamplingParams(temperature=1.0)))
