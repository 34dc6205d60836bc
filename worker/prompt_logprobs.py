"""Prompt logprobs: each prompt token's log-probability given the tokens before it.

They come from the hidden states the forward pass computes anyway during
prefill: the row at position p scores prompt token p + 1 (the row of the last
prompt position predicts the first output token and belongs to the sampler).
A chunked prefill reports one run per chunk. Hidden rows are turned into
logits at most ``MAX_ROWS_PER_SLICE`` at a time, and of each slice only the
prompt token's logprob, its rank and the top k survive, so a long prompt never
holds full-vocabulary logits for all its positions at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvmesh.services.contracts.step import Logprobs, PromptLogprobs
from kvmesh.worker.input_batch import InputBatch

# Rows of vocab_size float32 logits alive at once: 256 x 152k vocab = 155 MB.
MAX_ROWS_PER_SLICE = 256


@dataclass(frozen=True)
class PromptLogprobsSpan:
    """The hidden rows of one request that score its prompt tokens this step."""

    req_id: str
    # Prompt position scored by the first row (>= 1).
    start_position: int
    # Index of the first row in the step's flattened hidden states.
    first_hidden_row: int
    # The prompt tokens scored, in order (one per row).
    target_token_ids: np.ndarray
    num_top: int


def plan_prompt_logprobs(
    batch: InputBatch, req_ids: list[str], rows: np.ndarray, num_scheduled: np.ndarray
) -> list[PromptLogprobsSpan]:
    """Which rows of this step's hidden states score which prompt tokens.

    Only a request that has not sampled yet gets them: one resumed after a
    preemption that followed its first token recomputes its prompt, but its
    prompt logprobs were delivered the first time.
    """
    spans: list[PromptLogprobsSpan] = []
    first_hidden_row = 0
    for req_id, row, count in zip(req_ids, rows.tolist(), num_scheduled.tolist(), strict=True):
        params = batch.sampling_params[row]
        prompt_len = int(batch.num_prompt_tokens[row])
        if (
            params is not None
            and params.prompt_logprobs is not None
            and batch.num_tokens[row] == prompt_len
        ):
            start = int(batch.num_computed_tokens[row])
            # Rows at positions start .. end - 1 score prompt tokens start + 1 .. end.
            end = min(start + count, prompt_len - 1)
            if end > start:
                spans.append(
                    PromptLogprobsSpan(
                        req_id=req_id,
                        start_position=start + 1,
                        first_hidden_row=first_hidden_row,
                        target_token_ids=batch.token_ids[row, start + 1 : end + 1].copy(),
                        num_top=params.prompt_logprobs,
                    )
                )
        first_hidden_row += count
    return spans


def compute_prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    spans: list[PromptLogprobsSpan],
    max_rows_per_slice: int = MAX_ROWS_PER_SLICE,
) -> list[PromptLogprobs]:
    """Score the spans' prompt tokens from the step's hidden states, slice by slice."""
    hidden_rows = np.concatenate(
        [np.arange(s.first_hidden_row, s.first_hidden_row + len(s.target_token_ids)) for s in spans]
    )
    targets = np.concatenate([s.target_token_ids for s in spans]).astype(np.int64)
    max_top = max(s.num_top for s in spans)
    logprob_parts: list[torch.Tensor] = []
    rank_parts: list[torch.Tensor] = []
    top_value_parts: list[torch.Tensor] = []
    top_index_parts: list[torch.Tensor] = []
    device = hidden.device
    for begin in range(0, len(hidden_rows), max_rows_per_slice):
        index = torch.from_numpy(hidden_rows[begin : begin + max_rows_per_slice]).to(device)
        target = torch.from_numpy(targets[begin : begin + max_rows_per_slice]).to(device)
        logprobs = torch.log_softmax(compute_logits(hidden[index]).float(), dim=-1)
        chosen = logprobs.gather(1, target.unsqueeze(1)).squeeze(1)
        logprob_parts.append(chosen.cpu())
        rank_parts.append(((logprobs > chosen.unsqueeze(1)).sum(dim=-1) + 1).cpu())
        if max_top:
            top = logprobs.topk(max_top, dim=-1)
            top_value_parts.append(top.values.cpu())
            top_index_parts.append(top.indices.cpu())
    chosen_list = torch.cat(logprob_parts).tolist()
    rank_list = torch.cat(rank_parts).tolist()
    top_values = torch.cat(top_value_parts).tolist() if max_top else None
    top_indices = torch.cat(top_index_parts).tolist() if max_top else None
    target_list = targets.tolist()

    runs: list[PromptLogprobs] = []
    offset = 0
    for span in spans:
        k = span.num_top
        entries = []
        for i in range(offset, offset + len(span.target_token_ids)):
            entries.append(
                Logprobs(
                    token_id=target_list[i],
                    logprob=chosen_list[i],
                    rank=rank_list[i],
                    top_token_ids=top_indices[i][:k] if top_indices is not None else [],
                    top_logprobs=top_values[i][:k] if top_values is not None else [],
                )
            )
        offset += len(span.target_token_ids)
        runs.append(PromptLogprobs(span.req_id, span.start_position, entries))
    return runs
