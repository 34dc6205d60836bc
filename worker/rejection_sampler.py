"""Verify draft tokens in the step that computed them: keep the longest acceptable
run, then sample one more token.

A request with k drafts has k + 1 logits rows this step: row i scores the
token after its known tokens and drafts 0..i-1. Each row is processed as an
ordinary sampling row whose history includes the drafts before it, so
penalties, min_tokens, bad words, logit bias and allowed tokens apply at every
position exactly as they would without speculation.

- Greedy rows: draft i is accepted while it equals the row's argmax; the
  argmax at the first mismatch (or after the last draft) is the extra token.
  The output equals decoding without drafts, token for token.
- Random rows (vLLM's RejectionSampler, specialised to proposers that put all
  probability on their draft, as n-gram and suffix proposals do): draft d is
  accepted with probability p(d); on rejection the token is drawn from the
  residual max(p - q, 0) normalised, which for a point mass q is p with d
  removed; after k accepted drafts the extra token is drawn from p. Each
  emitted token is then distributed exactly as p (Leviathan et al. 2023).

Seeded random requests and structured-output requests get no drafts (the
scheduler's Speculator), so the global random generator serves every row here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from kvmesh.services.contracts.step import Logprobs
from kvmesh.worker.input_batch import InputBatch
from kvmesh.worker.sampler import apply_logits_processors, gather_logprobs, random_sampling_logits
from kvmesh.worker.sampling_metadata import build_sampling_metadata

logger = logging.getLogger(__name__)


@dataclass
class VerifyOutput:
    """Per drafted request (in the order given): its tokens and their logprobs."""

    token_ids: list[list[int]]
    logprobs: list[list[Logprobs]]
    # Requests whose verification failed: index -> message (their lists are empty).
    failed: dict[int, str] = field(default_factory=dict)


def rejection_sample(
    draft_ids: torch.Tensor,
    greedy_ids: torch.Tensor,
    is_greedy: torch.Tensor,
    target_probs: torch.Tensor | None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per logits row: (the token emitted there if the run reaches it, whether its
    draft is accepted).

    ``draft_ids`` holds each row's draft, -1 on a request's last row (no draft:
    its token is the extra one). ``target_probs`` is needed when any row is random.
    """
    has_draft = draft_ids >= 0
    accepted = has_draft & (draft_ids == greedy_ids)
    if target_probs is None:
        return greedy_ids, accepted
    draft_index = draft_ids.clamp(min=0).unsqueeze(1)
    draft_prob = target_probs.gather(1, draft_index).squeeze(1)
    uniform = torch.rand(draft_prob.shape, generator=generator, device=draft_prob.device)
    random_accepted = has_draft & (uniform < draft_prob)
    residual = torch.where(
        has_draft.unsqueeze(1), target_probs.scatter(1, draft_index, 0.0), target_probs
    )
    # A draft with probability ~1 leaves no residual; it is then (almost surely)
    # accepted, and p itself is a safe stand-in.
    residual = torch.where((residual.sum(dim=1) > 0).unsqueeze(1), residual, target_probs)
    noise = torch.empty_like(residual).exponential_(generator=generator)
    recovered = residual.div(noise).argmax(dim=1)
    random_ids = torch.where(random_accepted, draft_ids, recovered)
    return (
        torch.where(is_greedy, greedy_ids, random_ids),
        torch.where(is_greedy, accepted, random_accepted),
    )


def split_runs(
    token_ids: list[int], accepted: list[bool], num_logits: list[int]
) -> list[tuple[int, int]]:
    """Per request: (its first row, tokens it emits = accepted drafts + 1)."""
    runs = []
    start = 0
    for count in num_logits:
        num_accepted = 0
        while num_accepted < count - 1 and accepted[start + num_accepted]:
            num_accepted += 1
        runs.append((start, num_accepted + 1))
        start += count
    return runs


def verify_drafts(
    logits: torch.Tensor,
    batch: InputBatch,
    rows: np.ndarray,
    num_logits: np.ndarray,
    eos_token_ids: list[int],
    generator: torch.Generator | None = None,
) -> VerifyOutput:
    """Verify the drafts of the batch ``rows`` (logits: their 1 + drafts rows each, in order).

    The drafts are read from the batch, where the step wrote them after each
    row's known tokens. A failure costs only the requests that fail: the batch
    is verified again one request at a time.
    """
    try:
        return _verify(logits, batch, rows, num_logits, eos_token_ids, generator)
    except Exception:
        logger.exception("verifying drafts of %d requests failed; one at a time", len(rows))
    output = VerifyOutput([[] for _ in rows], [[] for _ in rows])
    starts = np.cumsum(num_logits) - num_logits
    for i, (start, count) in enumerate(zip(starts.tolist(), num_logits.tolist(), strict=True)):
        try:
            alone = _verify(
                logits[start : start + count],
                batch,
                rows[i : i + 1],
                num_logits[i : i + 1],
                eos_token_ids,
                generator,
            )
        except Exception as exc:
            logger.warning("verifying drafts of row %d failed: %r", rows[i], exc)
            output.failed[i] = f"draft verification failed: {exc}"
            continue
        output.token_ids[i], output.logprobs[i] = alone.token_ids[0], alone.logprobs[0]
    return output


def _verify(
    logits: torch.Tensor,
    batch: InputBatch,
    rows: np.ndarray,
    num_logits: np.ndarray,
    eos_token_ids: list[int],
    generator: torch.Generator | None,
) -> VerifyOutput:
    # One sampling row per logits row: the request's row, its history grown by
    # the drafts before that position.
    expanded_rows = np.repeat(rows, num_logits)
    group_start = np.cumsum(num_logits) - num_logits
    offset = np.arange(len(expanded_rows)) - np.repeat(group_start, num_logits)
    num_tokens = batch.num_tokens[expanded_rows] + offset
    token_ids = batch.token_ids[expanded_rows]
    # The draft a row judges is the token right after its history; none on the last row.
    is_last = offset == np.repeat(num_logits - 1, num_logits)
    draft_ids = np.where(is_last, -1, token_ids[np.arange(len(expanded_rows)), num_tokens])
    params = [batch.sampling_params[row] for row in expanded_rows]
    metadata = build_sampling_metadata(
        params,  # type: ignore[arg-type]
        token_ids,
        batch.num_prompt_tokens[expanded_rows],
        num_tokens,
        {},
        eos_token_ids,
        batch.vocab_size,
        logits.device,
    )
    raw_logprobs = (
        torch.log_softmax(logits.float(), dim=-1) if metadata.max_num_logprobs is not None else None
    )
    processed = apply_logits_processors(logits, metadata)
    greedy_ids = processed.argmax(dim=-1)
    target_probs = (
        None
        if metadata.all_greedy
        else torch.softmax(random_sampling_logits(processed, metadata), dim=-1)
    )
    emitted, accepted = rejection_sample(
        torch.from_numpy(draft_ids).to(logits.device),
        greedy_ids,
        metadata.is_greedy,
        target_probs,
        generator,
    )
    emitted_list = emitted.tolist()
    runs = split_runs(emitted_list, accepted.tolist(), num_logits.tolist())
    row_logprobs = (
        gather_logprobs(raw_logprobs, emitted, metadata) if raw_logprobs is not None else None
    )
    output = VerifyOutput([], [])
    for start, count in runs:
        output.token_ids.append(emitted_list[start : start + count])
        run_logprobs = row_logprobs[start : start + count] if row_logprobs is not None else []
        output.logprobs.append([lp for lp in run_logprobs if lp is not None])
    return output
