"""--speculative-config: vLLM's JSON shape in, a validated frozen dataclass out."""

from __future__ import annotations

import dataclasses

import pytest

from kvmesh.services.runtime.config import (
    SchedulerServiceConfig,
    SpeculativeConfig,
    parse_speculative_config,
)


def test_vllm_ngram_json_parses() -> None:
    config = parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, '
        '"prompt_lookup_max": 4, "disable_by_batch_size": 8}'
    )
    assert config == SpeculativeConfig(
        method="ngram",
        num_speculative_tokens=3,
        prompt_lookup_min=2,
        prompt_lookup_max=4,
        disable_by_batch_size=8,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.method = "suffix"  # type: ignore[misc, union-attr]


def test_one_lookup_bound_sets_both_and_empty_means_off() -> None:
    config = parse_speculative_config('{"method": "ngram", "prompt_lookup_max": 3}')
    assert config is not None and (config.prompt_lookup_min, config.prompt_lookup_max) == (3, 3)
    assert parse_speculative_config("") is None
    assert parse_speculative_config('{"method": "suffix"}') == SpeculativeConfig(method="suffix")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "not JSON"),
        ("[1]", "JSON object"),
        ('{"num_speculative_tokens": 2}', "method"),
        ('{"method": "eagle"}', "ngram, suffix"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "positive"),
        ('{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "<="),
        ('{"method": "ngram", "prompt_lookup_mx": 2}', "unknown keys"),
        ('{"method": "ngram", "min_acceptance_rate": 1.5}', r"\[0, 1\)"),
    ],
)
def test_bad_configs_are_refused(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_speculative_config(text)


def test_the_scheduler_flag_is_checked_at_start_up() -> None:
    with pytest.raises(ValueError, match="unknown keys"):
        SchedulerServiceConfig(speculative_config='{"method": "ngram", "k": 1}')
    config = SchedulerServiceConfig(speculative_config='{"method": "suffix"}')
    assert config.speculative == SpeculativeConfig(method="suffix")
    assert SchedulerServiceConfig().speculative is None
