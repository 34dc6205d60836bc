"""Per-step sampling inputs, gathered once into batched tensors.

One row per request that samples this step. Optional fields stay ``None`` when
no row in the step uses the feature, so the common case (plain temperature or
greedy sampling) skips the work entirely.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvmesh.services.contracts.sampling_params import TOP_N_SIGMA_MAX, SamplingParams


def validate_sampling_params(params: SamplingParams, vocab_size: int) -> None:
    """Raise ValueError for parameters the sampler cannot honour."""
    if params.temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {params.temperature}")
    if not 0.0 < params.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
    if params.top_k < -1:
        raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {params.top_k}")
    if not 0.0 <= params.min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {params.min_p}")
    if not 0.0 <= params.top_n_sigma <= TOP_N_SIGMA_MAX:
        raise ValueError(
            f"top_n_sigma must be in [0, {TOP_N_SIGMA_MAX:g}], got {params.top_n_sigma}"
        )
    if params.repetition_penalty <= 0:
        raise ValueError(f"repetition_penalty must be > 0, got {params.repetition_penalty}")
    if params.min_tokens < 0:
        raise ValueError(f"min_tokens must be >= 0, got {params.min_tokens}")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and not 0 <= value <= vocab_size:
            raise ValueError(f"{name} must be in [0, {vocab_size}], got {value}")
    for token_id, _ in params.logit_bias:
        if not 0 <= token_id < vocab_size:
            raise ValueError(f"logit_bias token id {token_id} outside the vocabulary")
    for token_id in params.stop_token_ids:
        if not 0 <= token_id < vocab_size:
            raise ValueError(f"stop token id {token_id} outside the vocabulary")
    for token_id in params.allowed_token_ids:
        if not 0 <= token_id < vocab_size:
            raise ValueError(f"allowed token id {token_id} outside the vocabulary")
    for word in params.bad_words_token_ids:
        if not word or not all(0 <= token_id < vocab_size for token_id in word):
            raise ValueError("bad_words token sequences must be non-empty and in the vocabulary")


@dataclass
class SamplingMetadata:
    """Batched sampling parameters for the rows that sample in one step."""

    temperature: torch.Tensor  # [n] float32, as requested (greedy rows < 1e-5)
    is_greedy: torch.Tensor  # [n] bool
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None = None  # [n] int64, vocab_size where disabled
    top_p: torch.Tensor | None = None  # [n] float32
    min_p: torch.Tensor | None = None  # [n] float32
    top_n_sigma: torch.Tensor | None = None  # [n] float32, 0 where off
    # Penalties: all four are set together, or none.
    repetition_penalty: torch.Tensor | None = None  # [n] float32
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    # prompt + output per row, padded with vocab_size; lengths split the two.
    token_ids: torch.Tensor | None = None  # [n, max_len] int64
    prompt_lens: torch.Tensor | None = None  # [n] int64
    num_tokens: torch.Tensor | None = None  # [n] int64
    # Sparse (row, token, value) triplets.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    min_tokens_block: tuple[torch.Tensor, torch.Tensor] | None = None
    # Optional hooks for structured output and bad words: True = allowed / banned.
    allowed_token_mask: torch.Tensor | None = None  # [n, vocab] bool
    banned_token_mask: torch.Tensor | None = None  # [n, vocab] bool
    # Structured outputs: xgrammar's packed bitmask [n, ceil(vocab / 32)] int32
    # (bit set = allowed) and the rows it constrains (worker/structured_output.py).
    grammar_bitmask: torch.Tensor | None = None
    grammar_rows: list[int] = field(default_factory=list)
    # Row -> generator of a seeded request; other rows use the global RNG.
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    num_logprobs: list[int | None] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @property
    def max_num_logprobs(self) -> int | None:
        requested = [k for k in self.num_logprobs if k is not None]
        return max(requested) if requested else None

    def row(self, index: int) -> SamplingMetadata:
        """The metadata of row ``index`` alone, as a batch of one (the sampler's
        fallback when a batch fails: each row is retried by itself)."""
        one = slice(index, index + 1)
        sliced: dict[str, object] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor) and f.name != "grammar_bitmask":
                sliced[f.name] = value[one]
        for name in ("logit_bias", "min_tokens_block"):
            sparse = getattr(self, name)
            if sparse is not None:
                keep = sparse[0] == index
                rows, *rest = (part[keep] for part in sparse)
                sliced[name] = (torch.zeros_like(rows), *rest) if keep.any() else None
        constrained = index in self.grammar_rows
        is_greedy = bool(self.is_greedy[index])
        return dataclasses.replace(
            self,
            **sliced,
            all_greedy=is_greedy,
            all_random=not is_greedy,
            grammar_bitmask=self.grammar_bitmask[one] if constrained else None,
            grammar_rows=[0] if constrained else [],
            generators={0: self.generators[index]} if index in self.generators else {},
            num_logprobs=self.num_logprobs[one],
        )


def banned_by_bad_words(
    bad_words: Sequence[Sequence[int]], output_token_ids: np.ndarray
) -> list[int]:
    """The tokens that would complete a bad word after ``output_token_ids`` (vLLM's rule)."""
    banned = []
    for word in bad_words:
        prefix = word[:-1]
        if len(prefix) > len(output_token_ids):
            continue
        if not prefix or output_token_ids[len(output_token_ids) - len(prefix) :].tolist() == list(
            prefix
        ):
            banned.append(word[-1])
    return banned


@dataclass(frozen=True)
class MinTokensBlock:
    """Every (row, stop token) pair of the rows with ``min_tokens``, flat: a pair
    blocks its token while its row has fewer than ``min_tokens`` outputs."""

    rows: np.ndarray  # [pairs] int64
    token_ids: np.ndarray  # [pairs] int64
    min_tokens: np.ndarray  # [pairs] int64


@dataclass(frozen=True)
class RequestColumns:
    """The per-request part of a step's sampling metadata: what the rows' parameters
    alone decide, gathered once per batch composition (``SamplingColumnsCache``)
    so that a step whose rows are unchanged does no per-row Python work."""

    temperature: torch.Tensor  # [n] float32
    is_greedy: torch.Tensor  # [n] bool
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    top_n_sigma: torch.Tensor | None
    # repetition, presence, frequency ([n] float32 each), or None if no row penalizes.
    penalties: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    allowed_token_mask: torch.Tensor | None
    num_logprobs: tuple[int | None, ...]
    # (row, its bad words) for the rows that have any.
    bad_words: tuple[tuple[int, tuple[tuple[int, ...], ...]], ...]
    min_tokens: MinTokensBlock | None


def gather_request_columns(
    params: Sequence[SamplingParams],
    eos_token_ids: Sequence[int],
    vocab_size: int,
    device: torch.device | str = "cpu",
) -> RequestColumns:
    """The rows' parameters as tensors (one pass over the rows)."""
    n = len(params)
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    is_greedy = torch.tensor([p.is_greedy for p in params], dtype=torch.bool)
    all_greedy = bool(is_greedy.all())
    top_k = top_p = min_p = top_n_sigma = None
    if not all_greedy:
        # A top_k past the vocabulary (any int32 is valid) keeps every token, as
        # vLLM clamps it: torch's topk would refuse k > vocab_size.
        ks = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
        if any(k < vocab_size for k in ks):
            top_k = torch.tensor(ks, dtype=torch.int64, device=device)
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], device=device)
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=device)
        if any(p.top_n_sigma > 0.0 for p in params):
            top_n_sigma = torch.tensor([p.top_n_sigma for p in params], device=device)
    penalties = None
    if any(
        p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        for p in params
    ):
        penalties = (
            torch.tensor([p.repetition_penalty for p in params], device=device),
            torch.tensor([p.presence_penalty for p in params], device=device),
            torch.tensor([p.frequency_penalty for p in params], device=device),
        )
    logit_bias = None
    bias = [(row, tok, val) for row, p in enumerate(params) for tok, val in p.logit_bias]
    if bias:
        rows, toks, vals = zip(*bias, strict=True)
        logit_bias = (
            torch.tensor(rows, device=device),
            torch.tensor(toks, device=device),
            torch.tensor(vals, dtype=torch.float32, device=device),
        )
    allowed_token_mask = None
    if any(p.allowed_token_ids for p in params):
        allowed = torch.ones(n, vocab_size, dtype=torch.bool)
        for row, p in enumerate(params):
            if p.allowed_token_ids:
                allowed[row] = False
                allowed[row, list(p.allowed_token_ids)] = True
        allowed_token_mask = allowed.to(device)
    pairs: list[tuple[int, int, int]] = []
    for row, p in enumerate(params):
        if p.min_tokens:
            stop_ids = set(p.stop_token_ids)
            if not p.ignore_eos:
                stop_ids.update(eos_token_ids)
            pairs.extend((row, tok, p.min_tokens) for tok in sorted(stop_ids))
    min_tokens = None
    if pairs:
        rows_, toks_, mins = (
            np.array(column, dtype=np.int64) for column in zip(*pairs, strict=True)
        )
        min_tokens = MinTokensBlock(rows_, toks_, mins)
    return RequestColumns(
        temperature=temperature.to(device),
        is_greedy=is_greedy.to(device),
        all_greedy=all_greedy,
        all_random=not bool(is_greedy.any()),
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        top_n_sigma=top_n_sigma,
        penalties=penalties,
        logit_bias=logit_bias,
        allowed_token_mask=allowed_token_mask,
        num_logprobs=tuple(p.logprobs for p in params),
        bad_words=tuple(
            (row, p.bad_words_token_ids) for row, p in enumerate(params) if p.bad_words_token_ids
        ),
        min_tokens=min_tokens,
    )


def step_sampling_metadata(
    columns: RequestColumns,
    token_ids: np.ndarray,  # [n, >= max(num_tokens)] prompt + output per row
    prompt_lens: np.ndarray,  # [n]
    num_tokens: np.ndarray,  # [n] prompt + output lengths
    generators: Mapping[int, torch.Generator],
    vocab_size: int,
    device: torch.device | str = "cpu",
) -> SamplingMetadata:
    """One step's metadata: the request columns plus what the rows' tokens decide
    (penalties' histories, min_tokens, bad words), in array operations; per-row
    Python only for the rows with bad words."""
    n = columns.temperature.shape[0]
    metadata = SamplingMetadata(
        temperature=columns.temperature,
        is_greedy=columns.is_greedy,
        all_greedy=columns.all_greedy,
        all_random=columns.all_random,
        top_k=columns.top_k,
        top_p=columns.top_p,
        min_p=columns.min_p,
        top_n_sigma=columns.top_n_sigma,
        logit_bias=columns.logit_bias,
        allowed_token_mask=columns.allowed_token_mask,
        generators=dict(generators),
        num_logprobs=list(columns.num_logprobs),
    )
    if columns.penalties is not None:
        max_len = int(num_tokens.max())
        ids = np.asarray(token_ids)[:, :max_len].astype(np.int64, copy=True)
        ids[np.arange(max_len)[None, :] >= np.asarray(num_tokens)[:, None]] = vocab_size
        metadata.token_ids = torch.from_numpy(ids).to(device)
        metadata.prompt_lens = torch.as_tensor(np.asarray(prompt_lens), dtype=torch.int64).to(
            device
        )
        metadata.num_tokens = torch.as_tensor(np.asarray(num_tokens), dtype=torch.int64).to(device)
        (
            metadata.repetition_penalty,
            metadata.presence_penalty,
            metadata.frequency_penalty,
        ) = columns.penalties
    banned = [
        (row, token_id)
        for row, words in columns.bad_words
        for token_id in banned_by_bad_words(
            words, token_ids[row, int(prompt_lens[row]) : int(num_tokens[row])]
        )
    ]
    if banned:
        mask = torch.zeros(n, vocab_size, dtype=torch.bool)
        rows, toks = zip(*banned, strict=True)
        mask[list(rows), list(toks)] = True
        metadata.banned_token_mask = mask.to(device)
    block = columns.min_tokens
    if block is not None:
        outputs = np.asarray(num_tokens)[block.rows] - np.asarray(prompt_lens)[block.rows]
        active = outputs < block.min_tokens
        if active.any():
            metadata.min_tokens_block = (
                torch.from_numpy(block.rows[active]).to(device),
                torch.from_numpy(block.token_ids[active]).to(device),
            )
    assert metadata.num_rows == n
    return metadata


def build_sampling_metadata(
    params: Sequence[SamplingParams],
    token_ids: np.ndarray,  # [n, >= max(num_tokens)] prompt + output per row
    prompt_lens: np.ndarray,  # [n]
    num_tokens: np.ndarray,  # [n] prompt + output lengths
    generators: Mapping[int, torch.Generator],
    eos_token_ids: Sequence[int],
    vocab_size: int,
    device: torch.device | str = "cpu",
) -> SamplingMetadata:
    """Gather the per-request parameters of the sampling rows into tensors (no cache)."""
    columns = gather_request_columns(params, eos_token_ids, vocab_size, device)
    return step_sampling_metadata(
        columns, token_ids, prompt_lens, num_tokens, generators, vocab_size, device
    )


class SamplingColumnsCache:
    """The request columns (and seeded generators by sampling row) of the last batch
    composition a persistent batch sampled: a decode step whose rows and requests
    are the previous step's reuses them. ``key`` must change whenever a row's
    request or the order of the sampling rows does (``InputBatch.composition``
    and the sampling rows' bytes)."""

    def __init__(self) -> None:
        self._key: object = None
        self._entry: tuple[RequestColumns, dict[int, torch.Generator]] | None = None
        self.misses = 0

    def get(
        self,
        key: object,
        gather: Callable[[], tuple[RequestColumns, dict[int, torch.Generator]]],
    ) -> tuple[RequestColumns, dict[int, torch.Generator]]:
        if self._entry is None or key != self._key:
            self.misses += 1
            self._entry = gather()
            self._key = key
        return self._entry
