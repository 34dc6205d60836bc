"""Synthetic random-token prompts of a given length, like vLLM's random dataset.

Prompts are drawn from the target's own tokenizer so that each one is exactly
the intended number of tokens on the server: either the token ids themselves
(the completions API accepts a list of ids) or, for servers that only take
text, text that re-encodes to that many tokens.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

# Decoding random ids and re-encoding the text can merge or split tokens at
# their boundaries; a few rounds of truncate-or-pad settle on the target length.
_MAX_TEXT_ALIGN_ROUNDS = 10


class PromptKind(StrEnum):
    TOKEN_IDS = "token-ids"
    TEXT = "text"


@dataclass(frozen=True)
class SampleRequest:
    """One benchmark prompt and how many tokens to ask for."""

    request_id: str
    prompt: list[int] | str
    # Prompt tokens as the server should count them (the client replaces it
    # with the server's own count when the response carries usage).
    prompt_len: int
    output_len: int


@dataclass(frozen=True)
class RandomDatasetConfig:
    num_prompts: int
    input_len: int
    output_len: int
    # Lengths are drawn uniformly from [len * (1 - r), len * (1 + r)] (vLLM's --random-range-ratio).
    range_ratio: float = 0.0
    # Tokens every prompt starts with, added before the input_len random tokens
    # (vLLM's --random-prefix-len), for prefix-caching workloads.
    shared_prefix_len: int = 0
    seed: int = 0
    prompt_kind: PromptKind = PromptKind.TOKEN_IDS
    # > 0: input lengths log-uniform in [min_input_len, input_len] instead of
    # range_ratio's uniform spread (embedding corpora: many short, few long).
    min_input_len: int = 0

    def __post_init__(self) -> None:
        if self.min_input_len and not 1 <= self.min_input_len <= self.input_len:
            raise ValueError(
                f"min_input_len must be in [1, {self.input_len}], got {self.min_input_len}"
            )
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if self.input_len < 0 or self.shared_prefix_len < 0:
            raise ValueError("input_len and shared_prefix_len must be >= 0")
        if self.output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {self.output_len}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")
        if self.shared_prefix_len + math.floor(self.input_len * (1 - self.range_ratio)) < 1:
            raise ValueError("every prompt needs at least one token: raise input_len")


class BenchTokenizer:
    """The parts of a Hugging Face ``tokenizer.json`` the dataset needs."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.special_ids: frozenset[int] = frozenset(
            token_id
            for token_id, token in tokenizer.get_added_tokens_decoder().items()
            if token.special
        )
        self.num_special_tokens_to_add: int = tokenizer.num_special_tokens_to_add(False)
        # Ids a random prompt may use: all but special tokens (EOS, chat markers...).
        all_ids = np.arange(self.vocab_size, dtype=np.int64)
        specials = np.fromiter(self.special_ids, dtype=np.int64)
        self.allowed_ids: np.ndarray = all_ids[~np.isin(all_ids, specials)]

    @classmethod
    def from_path(cls, path: str | Path) -> BenchTokenizer:
        """Load from a model folder or directly from a ``tokenizer.json`` file."""
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        return cls(Tokenizer.from_file(str(file)))

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=False)


def length_bounds(length: int, range_ratio: float, minimum: int) -> tuple[int, int]:
    """Inclusive [low, high] of vLLM's random dataset: floor below, ceil above."""
    low = max(minimum, math.floor(length * (1 - range_ratio)))
    high = max(minimum, math.ceil(length * (1 + range_ratio)))
    return low, high


def sample_random_requests(
    config: RandomDatasetConfig, tokenizer: BenchTokenizer
) -> list[SampleRequest]:
    """``config.num_prompts`` prompts, identical for identical config and tokenizer."""
    rng = np.random.default_rng(config.seed)
    # In text mode the server may add special tokens (BOS) of its own; leave room.
    num_added = tokenizer.num_special_tokens_to_add if config.prompt_kind is PromptKind.TEXT else 0
    input_low, input_high = length_bounds(
        max(0, config.input_len - num_added), config.range_ratio, minimum=0
    )
    output_low, output_high = length_bounds(config.output_len, config.range_ratio, minimum=1)
    input_lens = rng.integers(input_low, input_high + 1, size=config.num_prompts)
    if config.min_input_len:
        low = max(1, config.min_input_len - num_added)
        high = max(low, config.input_len - num_added)
        input_lens = np.rint(
            np.exp(rng.uniform(math.log(low), math.log(high), size=config.num_prompts))
        ).astype(np.int64)
        input_low, input_high = low, high
    output_lens = rng.integers(output_low, output_high + 1, size=config.num_prompts)
    allowed = tokenizer.allowed_ids
    prefix = allowed[rng.integers(0, len(allowed), size=config.shared_prefix_len)]
    requests = []
    for index in range(config.num_prompts):
        body = allowed[rng.integers(0, len(allowed), size=int(input_lens[index]))]
        token_ids = np.concatenate([prefix, body]).tolist()
        requests.append(
            _make_request(
                f"bench-{index}", token_ids, int(output_lens[index]), config, tokenizer, rng
            )
        )
    logger.info(
        "sampled %s prompts: input %s..%s (+%s shared prefix) tokens, output %s..%s tokens",
        config.num_prompts,
        input_low,
        input_high,
        config.shared_prefix_len,
        output_low,
        output_high,
    )
    return requests


def sample_warmup_request(config: RandomDatasetConfig, tokenizer: BenchTokenizer) -> SampleRequest:
    """A prompt of the configured lengths sharing no tokens with the timed prompts' prefix.

    Warming up with a timed prompt (as vLLM does) would let the server's prefix
    cache serve that prompt later and flatter its TTFT.
    """
    rng = np.random.default_rng([config.seed, 1])
    allowed = tokenizer.allowed_ids
    num_tokens = max(1, config.shared_prefix_len + config.input_len)
    token_ids = allowed[rng.integers(0, len(allowed), size=num_tokens)].tolist()
    return _make_request("bench-warmup", token_ids, config.output_len, config, tokenizer, rng)


def _make_request(
    request_id: str,
    token_ids: list[int],
    output_len: int,
    config: RandomDatasetConfig,
    tokenizer: BenchTokenizer,
    rng: np.random.Generator,
) -> SampleRequest:
    if config.prompt_kind is PromptKind.TOKEN_IDS:
        return SampleRequest(request_id, token_ids, len(token_ids), output_len)
    text, num_tokens = text_of_length(token_ids, tokenizer, rng)
    return SampleRequest(
        request_id, text, num_tokens + tokenizer.num_special_tokens_to_add, output_len
    )


def text_of_length(
    token_ids: list[int], tokenizer: BenchTokenizer, rng: np.random.Generator
) -> tuple[str, int]:
    """Text that re-encodes to ``len(token_ids)`` tokens (or as close as a few rounds get)."""
    target = len(token_ids)
    allowed = tokenizer.allowed_ids
    ids = token_ids
    for _ in range(_MAX_TEXT_ALIGN_ROUNDS):
        text = tokenizer.decode(ids)
        encoded = tokenizer.encode(text)
        if len(encoded) == target:
            return text, target
        if len(encoded) > target:
            ids = encoded[:target]
        else:
            pad = allowed[rng.integers(0, len(allowed), size=target - len(encoded))]
            ids = encoded + pad.tolist()
    logger.warning("prompt text encodes to %s tokens instead of %s", len(encoded), target)
    return text, len(encoded)
