"""The batched sampler against a plain per-request reference implementation."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.worker.sampler import Sampler, apply_logits_processors, random_sampling_logits
from tests.worker.sampling_lists import sampling_metadata_from_lists

VOCAB = 200
EOS = (2,)


def reference_processed_logits(
    logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]
) -> torch.Tensor:
    """One request, one token at a time, straight from the definitions (float64)."""
    x = logits.double().clone()
    if params.allowed_token_ids:
        allowed = torch.zeros(len(x), dtype=torch.bool)
        allowed[list(params.allowed_token_ids)] = True
        x[~allowed] = -math.inf
    for word in params.bad_words_token_ids:
        if len(word) == 1 or output[len(output) - len(word) + 1 :] == list(word[:-1]):
            x[word[-1]] = -math.inf
    if len(output) < params.min_tokens:
        for token in {*params.stop_token_ids, *([] if params.ignore_eos else EOS)}:
            x[token] = -math.inf
    for token, bias in params.logit_bias:
        x[token] += bias
    for token in set(prompt) | set(output):
        penalty = params.repetition_penalty
        x[token] = x[token] / penalty if x[token] > 0 else x[token] * penalty
    for token, count in Counter(output).items():
        x[token] -= params.frequency_penalty * count + params.presence_penalty
    if params.is_greedy:
        return x
    if params.top_n_sigma > 0:
        finite = x[torch.isfinite(x)]
        std = math.sqrt(sum((v - finite.mean().item()) ** 2 for v in finite.tolist()) / len(finite))
        x[x < finite.max() - params.top_n_sigma * std] = -math.inf
    x = x / params.temperature
    if params.min_p > 0:
        probs = torch.softmax(x, dim=0)
        x[probs < params.min_p * probs.max()] = -math.inf
    if 0 < params.top_k < len(x):
        kth = torch.sort(x, descending=True).values[params.top_k - 1]
        x[x < kth] = -math.inf
    if params.top_p < 1.0:
        probs = torch.softmax(x, dim=0)
        mass_above = 0.0
        keep = torch.zeros(len(x), dtype=torch.bool)
        for token in torch.argsort(x, descending=True).tolist():
            if mass_above >= params.top_p:
                break
            keep[token] = True
            mass_above += float(probs[token])
        x[~keep] = -math.inf
    return x


MIXED_PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, repetition_penalty=1.3),
    SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.25),
    SamplingParams(temperature=1.2, logit_bias=((5, 3.0), (7, -2.5), (5, 0.0))),
    SamplingParams(temperature=0.9, min_p=0.05),
    SamplingParams(temperature=1.0, top_k=10),
    SamplingParams(temperature=0.8, top_p=0.7),
    SamplingParams(temperature=1.0, top_k=25, top_p=0.9, min_p=0.01),
    SamplingParams(temperature=1.0, min_tokens=5, stop_token_ids=(9, 11)),
    SamplingParams(temperature=1.0, min_tokens=5, ignore_eos=True),
    SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=1.0),
    SamplingParams(temperature=0.0, allowed_token_ids=(3, 50, 51, 199)),
    SamplingParams(temperature=0.9, top_k=30, bad_words_token_ids=((40,), (12, 13, 41), (9, 42))),
    SamplingParams(temperature=1.0, top_n_sigma=1.0),
    SamplingParams(temperature=1.5, top_n_sigma=0.5, top_p=0.9, allowed_token_ids=(3, 50, 51, 199)),
    SamplingParams(temperature=0.0, top_n_sigma=0.1),
]


def _random_batch(seed: int, num_rows: int) -> tuple[torch.Tensor, list, list]:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, VOCAB, generator=generator) * 3
    prompts = [
        torch.randint(0, VOCAB, (int(n),), generator=generator).tolist()
        for n in torch.randint(1, 30, (num_rows,), generator=generator)
    ]
    outputs = [
        torch.randint(0, 20, (int(n),), generator=generator).tolist()
        for n in torch.randint(0, 8, (num_rows,), generator=generator)
    ]
    return logits, prompts, outputs


def _metadata(params, prompts, outputs, generators=None):
    return sampling_metadata_from_lists(params, prompts, outputs, generators or {}, EOS, VOCAB)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_processor_matches_per_request_reference(seed: int) -> None:
    logits, prompts, outputs = _random_batch(seed, len(MIXED_PARAMS))
    # Make sure min_tokens rows are still below their minimum and hit EOS/stop ids.
    outputs[8], outputs[9] = [9, 2], [2]
    # The bad-words row ends with the start of two of its words (41 and 42 banned, 40 always).
    outputs[12] = [5, 12, 13] if seed else [1, 9]
    metadata = _metadata(MIXED_PARAMS, prompts, outputs)
    processed = random_sampling_logits(apply_logits_processors(logits, metadata), metadata)
    for row, params in enumerate(MIXED_PARAMS):
        expected = reference_processed_logits(logits[row], params, prompts[row], outputs[row])
        got = processed[row].double()
        assert torch.equal(torch.isinf(got), torch.isinf(expected)), f"row {row}: masks differ"
        finite = ~torch.isinf(expected)
        torch.testing.assert_close(got[finite], expected[finite], rtol=1e-5, atol=1e-5)


def test_processors_never_modify_the_logits_and_copy_only_for_in_place_ones() -> None:
    logits, prompts, outputs = _random_batch(5, len(MIXED_PARAMS))
    before = logits.clone()
    # Each alone: no out-of-place processor makes a new tensor first.
    for params in (
        SamplingParams(temperature=0.0, logit_bias=((5, 3.0),)),
        SamplingParams(temperature=0.0, min_tokens=5),
    ):
        metadata = _metadata([params] * 2, prompts[:2], [[4], [4]])
        processed = apply_logits_processors(logits[:2], metadata)
        assert torch.equal(logits, before), params  # it wrote to a copy
        assert not torch.equal(processed, before[:2]), params
    # Plain greedy rows: nothing to apply, so float32 logits pass through uncopied
    # (a 3 MB copy per decode step saved); bfloat16 ones become float32.
    plain = [SamplingParams(temperature=0.0)] * 4
    metadata = _metadata(plain, prompts[:4], outputs[:4])
    rows = logits[:4].contiguous()
    assert apply_logits_processors(rows, metadata).data_ptr() == rows.data_ptr()
    as_bf16 = apply_logits_processors(rows.bfloat16(), metadata)
    assert as_bf16.dtype == torch.float32
    assert torch.equal(as_bf16, rows.bfloat16().float())


def test_min_tokens_blocks_eos_and_stop_ids_only_until_reached() -> None:
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(9,))
    logits = torch.zeros(2, VOCAB)
    logits[:, 2] = 10.0  # EOS is the argmax
    logits[:, 9] = 9.0
    sampled = Sampler()(logits, _metadata([params, params], [[1], [1]], [[4], [4, 5]]))
    assert sampled.token_ids.tolist() == [0, 2]  # still blocked (ties -> lowest id) / free


def test_greedy_is_argmax_of_raw_logits_without_processors() -> None:
    logits, prompts, outputs = _random_batch(3, 16)
    params = [SamplingParams(temperature=0.0)] * 16
    sampled = Sampler()(logits, _metadata(params, prompts, outputs))
    assert torch.equal(sampled.token_ids, logits.argmax(dim=-1))


def test_greedy_rows_follow_penalties_not_temperature() -> None:
    logits, prompts, outputs = _random_batch(4, len(MIXED_PARAMS))
    metadata = _metadata(MIXED_PARAMS, prompts, outputs)
    sampled = Sampler()(logits, metadata)
    processed = apply_logits_processors(logits, metadata)
    for row, params in enumerate(MIXED_PARAMS):
        if params.is_greedy:
            assert int(sampled.token_ids[row]) == int(processed[row].argmax())


def test_seeded_request_is_reproducible_whatever_shares_its_batch() -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    logits, prompts, outputs = _random_batch(5, 8)

    def run(batch_rows: list[int], seeded_row: int, num_steps: int = 6) -> list[int]:
        generators = {seeded_row: torch.Generator().manual_seed(1234)}
        others = {i: torch.Generator().manual_seed(99 + i) for i in batch_rows[:2]}
        tokens = []
        for _ in range(num_steps):
            rows = [*batch_rows]
            rows.insert(seeded_row, 7)
            params = [seeded if r == 7 else SamplingParams(temperature=1.0) for r in rows]
            gens = {**{k: v for k, v in others.items() if k != seeded_row}, **generators}
            metadata = _metadata(
                params, [prompts[r] for r in rows], [outputs[r] for r in rows], gens
            )
            result = Sampler()(logits[rows], metadata)
            tokens.append(int(result.token_ids[seeded_row]))
        return tokens

    alone = run([], 0)
    assert run([0, 1, 2], 2) == alone
    assert run([3, 4, 5, 6], 1) == alone
    assert len(set(alone)) > 1  # it does sample, not argmax


def test_random_sampling_follows_the_processed_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]]).repeat(4000, 1)
    params = [SamplingParams(temperature=1.0, top_k=3)] * 4000
    metadata = sampling_metadata_from_lists(
        params, [[0]] * 4000, [[]] * 4000, {0: torch.Generator().manual_seed(0)}, EOS, 5
    )
    torch.manual_seed(0)
    counts = torch.bincount(Sampler()(logits, metadata).token_ids, minlength=5).double() / 4000
    expected = torch.softmax(torch.tensor([2.0, 1.0, 0.5]), dim=0).double()
    assert counts[3:].sum() == 0  # outside top-k never sampled
    torch.testing.assert_close(counts[:3], expected, atol=0.03, rtol=0)


def test_logprobs_are_the_raw_distribution_with_rank_and_top_k() -> None:
    logits, prompts, outputs = _random_batch(6, len(MIXED_PARAMS))
    params = [
        SamplingParams(**{**p.__dict__, "logprobs": k})
        for p, k in zip(
            MIXED_PARAMS, [0, 1, 5, None, 3, 20, 2, 1, 0, 4, 7, 2, None, 1, 0, 3], strict=True
        )
    ]
    result = Sampler()(logits, _metadata(params, prompts, outputs))
    raw = torch.log_softmax(logits, dim=-1)
    for row, p in enumerate(params):
        entry = result.logprobs[row]
        if p.logprobs is None:
            assert entry is None
            continue
        assert entry is not None
        token = int(result.token_ids[row])
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(float(raw[row, token]), abs=1e-5)
        assert entry.rank == int((raw[row] > raw[row, token]).sum()) + 1
        top = torch.topk(raw[row], p.logprobs) if p.logprobs else None
        assert entry.top_token_ids == (top.indices.tolist() if top else [])
        assert entry.top_logprobs == pytest.approx(top.values.tolist() if top else [], abs=1e-5)


def test_allowed_token_ids_and_bad_words_decide_what_can_be_sampled() -> None:
    logits = torch.zeros(3, VOCAB)
    logits[:, 7] = 10.0  # the argmax everywhere, unless masked
    logits[:, 8] = 9.0
    logits[:, 60] = 8.0
    params = [
        SamplingParams(temperature=0.0, allowed_token_ids=(60, 61)),
        SamplingParams(temperature=0.0, bad_words_token_ids=((4, 7), (8,))),
        SamplingParams(temperature=0.0, bad_words_token_ids=((4, 7),)),
    ]
    # Row 1 just generated 4, so 7 would complete "4 7"; row 2 did not.
    sampled = Sampler()(logits, _metadata(params, [[1], [1], [1]], [[], [3, 4], [4, 3]]))
    assert sampled.token_ids.tolist() == [60, 60, 7]


def test_top_k_beyond_the_vocabulary_keeps_every_token() -> None:
    logits, prompts, outputs = _random_batch(6, 2)
    params = [SamplingParams(temperature=1.0, top_k=2**31 - 1), SamplingParams(top_k=5)]
    metadata = _metadata(params, prompts, outputs)
    processed = random_sampling_logits(apply_logits_processors(logits, metadata), metadata)
    assert not torch.isinf(processed[0]).any()
    assert int((~torch.isinf(processed[1])).sum()) == 5


def test_top_k_past_the_vocabulary_is_clamped_alone_and_in_a_batch() -> None:
    """vLLM's rule: top_k > vocab keeps every token, exactly like top_k off (0 or -1)."""
    logits, prompts, outputs = _random_batch(7, 4)

    def sample(top_ks: list[int]) -> list[int]:
        params = [
            SamplingParams(temperature=1.0, top_k=k, seed=row) for row, k in enumerate(top_ks)
        ]
        generators = {row: torch.Generator().manual_seed(row) for row in range(len(top_ks))}
        metadata = _metadata(params, prompts[: len(top_ks)], outputs[: len(top_ks)], generators)
        return Sampler()(logits[: len(top_ks)], metadata).token_ids.tolist()

    assert sample([100_000]) == sample([0]) == sample([-1])
    assert sample([100_000, 5, 100_000, VOCAB + 1]) == sample([0, 5, -1, 0])


class _PoisonedSampler(Sampler):
    """Fails any batch holding a row with the poisoned temperature, as a sampler bug would."""

    POISON = 0.123

    def sample(self, logits, metadata):
        if bool((metadata.temperature == self.POISON).any()):
            raise RuntimeError("selected index k out of range")
        return super().sample(logits, metadata)


def test_a_row_that_fails_sampling_fails_alone() -> None:
    logits, prompts, outputs = _random_batch(8, len(MIXED_PARAMS))
    seeds = {row: 500 + row for row in range(len(MIXED_PARAMS))}

    def run(params: list[SamplingParams]):
        generators = {row: torch.Generator().manual_seed(seed) for row, seed in seeds.items()}
        return _PoisonedSampler()(logits, _metadata(params, prompts, outputs, generators))

    undisturbed = run(MIXED_PARAMS)
    assert undisturbed.failed_rows == {}
    poisoned = list(MIXED_PARAMS)
    poisoned[3] = SamplingParams(temperature=_PoisonedSampler.POISON)
    result = run(poisoned)
    assert set(result.failed_rows) == {3}
    assert "out of range" in result.failed_rows[3]
    good = [row for row in range(len(MIXED_PARAMS)) if row != 3]
    assert result.token_ids[good].tolist() == undisturbed.token_ids[good].tolist()


def test_one_row_of_the_metadata_samples_like_the_batch() -> None:
    logits, prompts, outputs = _random_batch(9, len(MIXED_PARAMS))
    outputs[8], outputs[9] = [9, 2], [2]
    params = [
        SamplingParams(**{**p.__dict__, "logprobs": row % 3 or None})
        for row, p in enumerate(MIXED_PARAMS)
    ]
    metadata = _metadata(params, prompts, outputs)
    batched = random_sampling_logits(apply_logits_processors(logits, metadata), metadata)
    for row in range(len(params)):
        alone = metadata.row(row)
        assert alone.num_rows == 1 and alone.num_logprobs == [params[row].logprobs]
        processed = random_sampling_logits(
            apply_logits_processors(logits[row : row + 1], alone), alone
        )
        assert torch.equal(processed[0], batched[row]), f"row {row}"
