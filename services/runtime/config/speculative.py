"""``--speculative-config``: vLLM's JSON shape, parsed into one frozen dataclass.

The flag's text is a JSON object, e.g. ``{"method": "ngram",
"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}``.
Unknown keys are refused (a misspelt key silently ignored would leave
speculation configured differently from what the operator believes).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

SPECULATIVE_METHODS = ("ngram", "suffix")


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """How the scheduler proposes draft tokens and when it stops proposing them."""

    # "ngram": prompt lookup (the longest recent n-gram of the request seen
    # before in its own tokens); "suffix": suffix-automaton matching over the
    # request's tokens and the outputs of recent requests (suffix decoding).
    method: str
    # Most drafts per request per step.
    num_speculative_tokens: int = 4
    # n-gram sizes tried, longest first; one given alone sets both.
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    # No drafts in a step whose running batch is larger: verification costs
    # compute the big batch no longer has spare (vLLM's key; vLLM never turns
    # drafts off by default, kvmesh does past 4 running requests: on the CPU
    # benchmark, 8 requests verifying 8 drafts each cost more than they saved;
    # benchmarks/README.md). 0: never.
    disable_by_batch_size: int = 4
    # suffix: how many recent requests' outputs the shared corpus keeps.
    suffix_decoding_max_cached_requests: int = 64
    # suffix: longest context suffix matched (bounds the work per proposal).
    suffix_decoding_max_tree_depth: int = 24
    # suffix: drafts allowed per matched token (a short match earns few drafts).
    suffix_decoding_max_spec_factor: float = 1.0
    # Back-off per request: an acceptance-rate EMA below this pauses its drafts
    # (kvmesh's key; vLLM has no per-request back-off). Low, because a draft
    # costs little at small batches: verifying k more tokens costs a fraction
    # of a step, so even 1 accepted draft in 10 about pays for itself.
    min_acceptance_rate: float = 0.1

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}; "
                f"got {self.method!r}"
            )
        counts = {
            "num_speculative_tokens": self.num_speculative_tokens,
            "prompt_lookup_min": self.prompt_lookup_min,
            "prompt_lookup_max": self.prompt_lookup_max,
            "suffix_decoding_max_cached_requests": self.suffix_decoding_max_cached_requests,
            "suffix_decoding_max_tree_depth": self.suffix_decoding_max_tree_depth,
        }
        for name, value in counts.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must be <= prompt_lookup_max")
        if isinstance(self.disable_by_batch_size, bool) or self.disable_by_batch_size < 0:
            raise ValueError("disable_by_batch_size must be >= 0 (0: never)")
        if self.suffix_decoding_max_spec_factor <= 0:
            raise ValueError("suffix_decoding_max_spec_factor must be positive")
        if not 0.0 <= self.min_acceptance_rate < 1.0:
            raise ValueError("min_acceptance_rate must be in [0, 1)")


def parse_speculative_config(text: str) -> SpeculativeConfig | None:
    """The flag's JSON as a config; None for an empty flag (speculation off)."""
    if not text.strip():
        return None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--speculative-config is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError("--speculative-config must be a JSON object")
    known = {f.name for f in fields(SpeculativeConfig)}
    if unknown := sorted(set(raw) - known):
        raise ValueError(f"--speculative-config: unknown keys {unknown}; known: {sorted(known)}")
    if "method" not in raw:
        raise ValueError('--speculative-config needs "method" (ngram or suffix)')
    # One n-gram bound given alone sets both (an exact n-gram size).
    for given, other in (
        ("prompt_lookup_max", "prompt_lookup_min"),
        ("prompt_lookup_min", "prompt_lookup_max"),
    ):
        if given in raw and other not in raw:
            raw[other] = raw[given]
    return SpeculativeConfig(**raw)
