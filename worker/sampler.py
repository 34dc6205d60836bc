"""Batched token sampling with mixed per-request parameters, in vLLM's order.

raw logprobs snapshot -> float32 -> structured-output grammar bitmask and
allowed/banned token masks -> min_tokens
and logit_bias -> repetition/presence/frequency penalties -> (greedy argmax
here) -> top-n-sigma -> temperature -> min_p -> top_k/top_p -> sample.

Top-n-sigma comes first among the filters, where llama.cpp's sampler chain puts
it: a threshold of max - n * std on the logits keeps the same tokens at any
temperature, so only its place relative to top_k/top_p/min_p matters.

A failure while sampling the batch costs only the rows that fail: the batch
is sampled again row by row, and a row that fails alone is reported in
``SamplerOutput.failed_rows`` while every other row gets its token.

Random rows sample by inverse transform: one uniform number u per row per
step, and the token is the first index whose cumulative probability passes u
(``draw_keys``: each row's u comes from a 63-bit key). A seeded request draws
its key from its own generator, so its tokens do not depend on which other
requests share the batch; the others draw theirs from torch's global one.

With the C++ ops loaded (``native``), a step makes one kernel call for the
rows' tokens: ``kvmesh::greedy_argmax`` when every row is greedy, else
``kvmesh::sample_tokens`` (kernels/csrc/sample_tokens_cpu.cpp: temperature,
min_p, top_k and top_p without a vocabulary sort, greedy rows among them),
and penalties go to ``kvmesh::apply_penalties_``, which touches only the
tokens a row has seen. The torch functions below are the same definitions,
for other devices and as the tests' reference.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import xgrammar as xgr

from kvmesh.services.contracts.step import Logprobs
from kvmesh.worker.sampling_metadata import SamplingMetadata

logger = logging.getLogger(__name__)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [n] int64; 0 at failed rows
    logprobs: list[Logprobs | None]
    # Rows whose sampling failed: row -> message. Their token is meaningless.
    failed_rows: dict[int, str] = field(default_factory=dict)


def apply_token_masks(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    if metadata.grammar_bitmask is not None:
        # In place on the float32 copy made by apply_logits_processors.
        xgr.apply_token_bitmask_inplace(
            logits, metadata.grammar_bitmask.to(logits.device), indices=metadata.grammar_rows
        )
    if metadata.allowed_token_mask is not None:
        logits = logits.masked_fill(~metadata.allowed_token_mask, float("-inf"))
    if metadata.banned_token_mask is not None:
        logits = logits.masked_fill(metadata.banned_token_mask, float("-inf"))
    return logits


def apply_min_tokens_and_logit_bias(
    logits: torch.Tensor, metadata: SamplingMetadata
) -> torch.Tensor:
    if metadata.min_tokens_block is not None:
        rows, toks = metadata.min_tokens_block
        logits[rows, toks] = float("-inf")
    if metadata.logit_bias is not None:
        rows, toks, values = metadata.logit_bias
        logits.index_put_((rows, toks), values, accumulate=True)
    return logits


def apply_penalties(
    logits: torch.Tensor, metadata: SamplingMetadata, native: bool = False
) -> torch.Tensor:
    """vLLM's penalties: repetition over prompt + output, presence/frequency over output.

    ``native``: in place on float32 CPU logits (``apply_logits_processors``
    made them a copy) by kvmesh::apply_penalties_, the same floats.
    """
    if metadata.token_ids is None:
        return logits
    if native and _native_rows(logits):
        assert metadata.prompt_lens is not None and metadata.num_tokens is not None
        assert metadata.repetition_penalty is not None
        assert metadata.presence_penalty is not None and metadata.frequency_penalty is not None
        torch.ops.kvmesh.apply_penalties_(
            logits,
            metadata.token_ids,
            metadata.prompt_lens,
            metadata.num_tokens,
            metadata.repetition_penalty,
            metadata.presence_penalty,
            metadata.frequency_penalty,
        )
        return logits
    assert metadata.prompt_lens is not None and metadata.num_tokens is not None
    assert metadata.repetition_penalty is not None
    assert metadata.presence_penalty is not None and metadata.frequency_penalty is not None
    num_rows, vocab_size = logits.shape
    token_ids = metadata.token_ids
    position = torch.arange(token_ids.shape[1], device=logits.device).unsqueeze(0)
    is_output = position >= metadata.prompt_lens.unsqueeze(1)
    # Padding already holds vocab_size; route prompt tokens there too for the
    # output counts. The extra column is dropped.
    output_ids = token_ids.masked_fill(~is_output, vocab_size)
    output_counts = torch.zeros(num_rows, vocab_size + 1, device=logits.device)
    output_counts.scatter_add_(1, output_ids, torch.ones_like(output_ids, dtype=torch.float32))
    output_counts = output_counts[:, :vocab_size]
    seen = torch.zeros(num_rows, vocab_size + 1, dtype=torch.bool, device=logits.device)
    seen.scatter_(1, token_ids, True)
    seen = seen[:, :vocab_size]
    output_seen = output_counts > 0

    repetition = metadata.repetition_penalty.unsqueeze(1)
    penalty = torch.where(seen, repetition, torch.ones_like(repetition))
    logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits = logits - metadata.frequency_penalty.unsqueeze(1) * output_counts
    return logits - metadata.presence_penalty.unsqueeze(1) * output_seen


def apply_logits_processors(
    logits: torch.Tensor, metadata: SamplingMetadata, native: bool = False
) -> torch.Tensor:
    """Everything before the greedy/random split, as float32; ``logits`` is never modified.

    The processors that write in place (grammar bitmask, min_tokens, logit_bias,
    native penalties) get a copy; the others make new tensors, so without them
    float32 logits pass through as they are: a decode batch's logits (16 x 49,152
    float32) are 3 MB, whose copy took ~0.1-0.2 ms of a ~26-30 ms step (2-core
    Zen 4 EPYC).
    """
    in_place = (
        metadata.grammar_bitmask is not None
        or metadata.min_tokens_block is not None
        or metadata.logit_bias is not None
        or (native and metadata.token_ids is not None)
    )
    logits = logits.to(torch.float32, copy=in_place)
    logits = apply_token_masks(logits, metadata)
    logits = apply_min_tokens_and_logit_bias(logits, metadata)
    return apply_penalties(logits, metadata, native)


def apply_top_n_sigma(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Drop tokens whose logit is below max - n * std, the statistics taken over each
    row's finite logits (tokens a mask already removed do not count), the population
    standard deviation as llama.cpp takes it. Rows with n = 0 and greedy rows (whose
    token is the argmax, which the filter always keeps) pass unchanged; a new tensor
    is returned, ``logits`` is never modified."""
    n_sigma = metadata.top_n_sigma
    if n_sigma is None:
        return logits
    finite = torch.isfinite(logits)
    count = finite.sum(dim=-1, keepdim=True).clamp_min(1)
    values = logits.masked_fill(~finite, 0.0)
    mean = values.sum(dim=-1, keepdim=True) / count
    variance = ((values - mean).square() * finite).sum(dim=-1, keepdim=True) / count
    threshold = logits.amax(dim=-1, keepdim=True) - n_sigma.unsqueeze(1) * variance.sqrt()
    active = (n_sigma > 0) & ~metadata.is_greedy
    drop = (logits < threshold) & active.unsqueeze(1)
    return logits.masked_fill(drop, float("-inf"))


def apply_temperature(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    # Greedy rows divide by 1: their token comes from argmax before this step.
    temperature = torch.where(
        metadata.is_greedy, torch.ones_like(metadata.temperature), metadata.temperature
    )
    return logits / temperature.unsqueeze(1)


def apply_min_p(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    if metadata.min_p is None:
        return logits
    probs = torch.softmax(logits, dim=-1)
    threshold = metadata.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Keep the k best tokens (ties at the k-th value kept), then the smallest nucleus >= p."""
    top_k, top_p = metadata.top_k, metadata.top_p
    if top_k is None and top_p is None:
        return logits
    if top_p is None:
        assert top_k is not None
        # Only the k-th largest value is needed: topk is much cheaper than a full sort.
        max_k = int(top_k.max())
        kth_value = logits.topk(max_k, dim=-1).values.gather(1, (top_k - 1).unsqueeze(1))
        return logits.masked_fill(logits < kth_value, float("-inf"))
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab_size = logits.shape[1]
    if top_k is not None:
        kth_value = sorted_logits.gather(1, (vocab_size - top_k).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_value, float("-inf"))
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1 - top_p).unsqueeze(1)
    drop[:, -1] = False  # the most likely token always survives
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def random_sampling_logits(processed: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The distribution (as logits) that random rows sample from, given processed logits."""
    logits = apply_temperature(apply_top_n_sigma(processed, metadata), metadata)
    logits = apply_min_p(logits, metadata)
    return apply_top_k_top_p(logits, metadata)


def _native_rows(x: torch.Tensor) -> bool:
    """Whether the C++ ops take ``x``: float32 CPU rows with a unit vocabulary stride."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.dim() == 2
        and x.shape[1] > 0
        and x.stride(1) == 1
    )


def row_argmax(x: torch.Tensor, native: bool = False) -> torch.Tensor:
    """Each row's argmax, as ``x.argmax(dim=-1)`` (first maximum; a NaN wins).

    ``native``: float32 CPU rows go to kvmesh::greedy_argmax
    (kernels/csrc/greedy_argmax_cpu.cpp; the caller knows the ops are loaded),
    17x faster than torch's on a decode batch's logits (16 x 49,152: 74 vs
    1,287 us, 2 threads of the 2-core AMX Xeon); the same indices.
    """
    if native and _native_rows(x):
        return torch.ops.kvmesh.greedy_argmax(x)
    return x.argmax(dim=-1)


# A key's low 63 bits, of which the top 53 make u in [0, 1).
_KEY_MASK = (1 << 63) - 1


def draw_keys(num_rows: int, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One random key per row ([num_rows] int64 in [0, 2^63), on the CPU): seeded rows
    from their own generator (one draw per step, so a resumed request replays
    one per token it sampled), the others from torch's global generator."""
    keys = torch.empty(num_rows, dtype=torch.int64).random_()
    for row, generator in generators.items():
        keys[row] = torch.empty((), dtype=torch.int64, device=generator.device).random_(
            generator=generator
        )
    return keys


def uniforms_from_keys(keys: torch.Tensor) -> torch.Tensor:
    """Each key's u in [0, 1), float64, as kvmesh::sample_tokens makes it."""
    return ((keys & _KEY_MASK) >> 10).double() * 2.0**-53


def inverse_transform(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row the first index whose cumulative probability passes ``u`` times the row's
    total: a token distributed as ``probs`` (zero-probability tokens never)."""
    cdf = probs.double().cumsum(dim=-1)
    target = (u.to(cdf.device) * cdf[:, -1]).unsqueeze(1)
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(1)
    tokens = tokens.clamp_(max=probs.shape[1] - 1)
    # u * total rounded up to the total: the last token that has probability.
    missed = probs.gather(1, tokens.unsqueeze(1)).squeeze(1) <= 0
    if bool(missed.any()):
        last = probs.shape[1] - 1 - (probs > 0).flip(-1).int().argmax(dim=-1)
        tokens = torch.where(missed, last, tokens)
    return tokens


def fused_sample(
    logits: torch.Tensor, metadata: SamplingMetadata, keys: torch.Tensor
) -> torch.Tensor:
    """Every row's token in one kvmesh::sample_tokens call (greedy rows: argmax)."""
    temperature = torch.where(
        metadata.is_greedy, torch.zeros_like(metadata.temperature), metadata.temperature
    )
    return torch.ops.kvmesh.sample_tokens(
        logits, temperature, metadata.top_k, metadata.top_p, metadata.min_p, keys
    )


def gather_logprobs(
    raw_logprobs: torch.Tensor, token_ids: torch.Tensor, metadata: SamplingMetadata
) -> list[Logprobs | None]:
    """Sampled token's raw logprob and rank plus the top k, for rows that asked."""
    results: list[Logprobs | None] = [None] * metadata.num_rows
    max_k = metadata.max_num_logprobs
    if max_k is None:
        return results
    sampled = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    ranks = (raw_logprobs > sampled.unsqueeze(1)).sum(dim=-1) + 1
    top = raw_logprobs.topk(max_k, dim=-1) if max_k > 0 else None
    sampled_list, rank_list, token_list = sampled.tolist(), ranks.tolist(), token_ids.tolist()
    for row, k in enumerate(metadata.num_logprobs):
        if k is None:
            continue
        results[row] = Logprobs(
            token_id=token_list[row],
            logprob=sampled_list[row],
            rank=rank_list[row],
            top_token_ids=top.indices[row, :k].tolist() if top is not None else [],
            top_logprobs=top.values[row, :k].tolist() if top is not None else [],
        )
    return results


class Sampler:
    """Stateless; one call samples every row of a step. ``native``: the C++ CPU
    ops are loaded, and float32 CPU logits are sampled by them (module doc)."""

    def __init__(self, native: bool = False) -> None:
        self.native = native

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        try:
            return self.sample(logits, metadata)
        except Exception:
            logger.exception("sampling %d rows failed; sampling each row alone", metadata.num_rows)
        return self._sample_rows_alone(logits, metadata)

    def _sample_rows_alone(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        # Random keys are drawn last (just before the tokens are chosen), so a
        # batch that failed earlier left every seeded generator where it was:
        # a seeded row alone draws what it would have drawn in the batch.
        token_ids = torch.zeros(metadata.num_rows, dtype=torch.int64, device=logits.device)
        logprobs: list[Logprobs | None] = [None] * metadata.num_rows
        failed: dict[int, str] = {}
        for row in range(metadata.num_rows):
            try:
                alone = self.sample(logits[row : row + 1], metadata.row(row))
            except Exception as exc:
                logger.warning("sampling row %d failed: %r", row, exc)
                failed[row] = f"sampling failed: {exc}"
                continue
            token_ids[row] = alone.token_ids[0]
            logprobs[row] = alone.logprobs[0]
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs, failed_rows=failed)

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample every row at once; any failure raises."""
        raw_logprobs = (
            torch.log_softmax(logits.float(), dim=-1)
            if metadata.max_num_logprobs is not None
            else None
        )
        logits = apply_logits_processors(logits, metadata, self.native)
        if metadata.all_greedy:
            token_ids = row_argmax(logits, self.native)
        elif self.native and _native_rows(logits):
            # Top-n-sigma is a mask before the fused kernel (which has no
            # statistics pass); it costs nothing unless a row asks for it.
            token_ids = fused_sample(
                apply_top_n_sigma(logits, metadata),
                metadata,
                draw_keys(metadata.num_rows, metadata.generators),
            )
        else:
            token_ids = self._sample_with_torch(logits, metadata)
        logprobs = (
            gather_logprobs(raw_logprobs, token_ids, metadata)
            if raw_logprobs is not None
            else [None] * metadata.num_rows
        )
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)

    def _sample_with_torch(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        greedy_tokens = None if metadata.all_random else row_argmax(logits)
        probs = torch.softmax(random_sampling_logits(logits, metadata), dim=-1)
        u = uniforms_from_keys(draw_keys(metadata.num_rows, metadata.generators))
        random_tokens = inverse_transform(probs, u)
        if greedy_tokens is None:
            return random_tokens
        return torch.where(metadata.is_greedy, greedy_tokens, random_tokens)
