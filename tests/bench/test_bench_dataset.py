"""Random prompts: exact lengths, determinism under a seed, shared prefixes, text mode."""

from __future__ import annotations

import pytest

from kvmesh.services.cli.bench.dataset import (
    BenchTokenizer,
    PromptKind,
    RandomDatasetConfig,
    sample_random_requests,
    sample_warmup_request,
)


def test_token_id_prompts_have_exact_lengths_and_no_special_tokens(
    bench_tokenizer: BenchTokenizer,
) -> None:
    config = RandomDatasetConfig(num_prompts=20, input_len=128, output_len=64, seed=3)
    requests = sample_random_requests(config, bench_tokenizer)
    assert len(requests) == 20
    assert len({request.request_id for request in requests}) == 20
    for request in requests:
        assert isinstance(request.prompt, list)
        assert len(request.prompt) == request.prompt_len == 128
        assert request.output_len == 64
        assert all(0 <= token < bench_tokenizer.vocab_size for token in request.prompt)
        # An EOS or chat marker inside a prompt would change what the model does.
        assert not set(request.prompt) & bench_tokenizer.special_ids
    assert 2 in bench_tokenizer.special_ids  # <|im_end|>, the EOS, is among those excluded


def test_same_seed_same_prompts_other_seed_other_prompts(bench_tokenizer: BenchTokenizer) -> None:
    config = RandomDatasetConfig(num_prompts=5, input_len=32, output_len=8, range_ratio=0.5, seed=1)
    first = sample_random_requests(config, bench_tokenizer)
    again = sample_random_requests(config, bench_tokenizer)
    other = sample_random_requests(
        RandomDatasetConfig(num_prompts=5, input_len=32, output_len=8, range_ratio=0.5, seed=2),
        bench_tokenizer,
    )
    assert first == again
    assert [r.prompt for r in first] != [r.prompt for r in other]


def test_shared_prefix_is_common_and_bodies_differ(bench_tokenizer: BenchTokenizer) -> None:
    config = RandomDatasetConfig(num_prompts=8, input_len=40, output_len=4, shared_prefix_len=64)
    requests = sample_random_requests(config, bench_tokenizer)
    prefixes = {tuple(request.prompt[:64]) for request in requests}
    bodies = {tuple(request.prompt[64:]) for request in requests}
    assert len(prefixes) == 1
    assert len(bodies) == 8
    assert all(request.prompt_len == 64 + 40 for request in requests)
    # The warm-up prompt must not warm the prefix cache for the timed prompts.
    warmup = sample_warmup_request(config, bench_tokenizer)
    assert warmup.prompt[:64] != requests[0].prompt[:64]
    assert warmup.prompt_len == 104


def test_range_ratio_spreads_lengths_within_vllm_bounds(bench_tokenizer: BenchTokenizer) -> None:
    config = RandomDatasetConfig(num_prompts=200, input_len=100, output_len=10, range_ratio=0.25)
    requests = sample_random_requests(config, bench_tokenizer)
    input_lens = [request.prompt_len for request in requests]
    output_lens = [request.output_len for request in requests]
    assert min(input_lens) >= 75 and max(input_lens) <= 125
    assert min(output_lens) >= 7 and max(output_lens) <= 13  # floor(7.5), ceil(12.5)
    assert len(set(input_lens)) > 20 and len(set(output_lens)) > 3
    assert all(len(request.prompt) == request.prompt_len for request in requests)


def test_text_prompts_re_encode_to_their_length(bench_tokenizer: BenchTokenizer) -> None:
    config = RandomDatasetConfig(
        num_prompts=10, input_len=96, output_len=4, prompt_kind=PromptKind.TEXT, seed=5
    )
    requests = sample_random_requests(config, bench_tokenizer)
    for request in requests:
        assert isinstance(request.prompt, str)
        assert len(bench_tokenizer.encode(request.prompt)) == request.prompt_len == 96


@pytest.mark.parametrize(
    "kwargs",
    [
        {"range_ratio": 1.0},
        {"output_len": 0},
        {"num_prompts": 0},
        {"input_len": 0},
    ],
)
def test_impossible_workloads_are_refused(kwargs: dict[str, float]) -> None:
    base = {"num_prompts": 1, "input_len": 8, "output_len": 8}
    with pytest.raises(ValueError):
        RandomDatasetConfig(**{**base, **kwargs})
