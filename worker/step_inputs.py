"""Build one step's model inputs from the persistent batch, vectorized over tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvmesh.kernels.backend import AttentionBackend, AttentionMetadata
from kvmesh.services.contracts.math_utils import cdiv
from kvmesh.worker.input_batch import InputBatch


@dataclass
class StepInputs:
    rows: np.ndarray  # [num_reqs] batch rows, in step order
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    metadata: AttentionMetadata
    # Requests that reach the end of their known tokens (and drafts) this step sample.
    sample_mask: np.ndarray  # [num_reqs] bool
    # Token rows whose logits are computed: per sampling request, its drafts'
    # rows and its last one (only the last one without drafts), in step order.
    logits_indices: torch.Tensor  # [sum(num_logits)] int64
    # Per sampling request: 1 + its drafts. None when the step has no drafts.
    num_logits: np.ndarray | None = None
    # Several KV-cache groups: per model layer, its group's metadata (its
    # block tables and slots); None with one group (``metadata`` for all).
    layer_metadata: list[AttentionMetadata] | None = None

    @property
    def attention_metadata(self) -> AttentionMetadata | list[AttentionMetadata]:
        """What the model's forward takes: one metadata, or one per layer."""
        return self.metadata if self.layer_metadata is None else self.layer_metadata


def check_schedulable(
    batch: InputBatch,
    rows: np.ndarray,
    num_scheduled: np.ndarray,
    num_drafts: np.ndarray | None = None,
) -> list[str]:
    """Per request, '' if the step fits its known tokens (plus drafts) and blocks, else why not."""
    context_lens = batch.num_computed_tokens[rows] + num_scheduled
    num_known = (
        batch.num_tokens[rows] if num_drafts is None else batch.num_tokens[rows] + num_drafts
    )
    too_many = context_lens > num_known
    no_blocks = context_lens > batch.num_blocks[rows] * batch.block_size
    nothing = num_scheduled <= 0
    reasons = [""] * len(rows)
    for i in np.flatnonzero(too_many | no_blocks | nothing):
        if nothing[i]:
            reasons[i] = f"scheduled {num_scheduled[i]} tokens"
        elif too_many[i]:
            reasons[i] = (
                f"scheduled up to token {context_lens[i]} but only {num_known[i]} tokens are known"
            )
        else:
            reasons[i] = (
                f"context of {context_lens[i]} tokens needs more than the "
                f"{batch.num_blocks[rows[i]]} blocks allocated"
            )
    return reasons


def prepare_step_inputs(
    batch: InputBatch,
    rows: np.ndarray,
    num_scheduled: np.ndarray,
    backend: AttentionBackend,
    device: torch.device,
    num_drafts: np.ndarray | None = None,
    layer_groups: Sequence[int] | None = None,
) -> StepInputs:
    """Flatten the scheduled tokens of ``rows`` (in order) into one batch.

    ``num_drafts`` (per request, None when the step has none): the request's
    input ends with that many draft tokens, written after its known tokens.
    ``layer_groups`` (several KV-cache groups): each layer's group; each group
    gets metadata of its own block tables and slots, the rest shared.
    """
    num_reqs = len(rows)
    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
    np.cumsum(num_scheduled, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    num_computed = batch.num_computed_tokens[rows]
    context_lens = num_computed + num_scheduled

    # Token t belongs to request req_of_token[t] and sits offset_in_req tokens
    # after that request's first scheduled token.
    req_of_token = np.repeat(np.arange(num_reqs), num_scheduled)
    offset_in_req = np.arange(num_tokens) - query_start_loc[:-1][req_of_token]
    positions = num_computed[req_of_token] + offset_in_req
    row_of_token = rows[req_of_token]
    input_ids = batch.token_ids[row_of_token, positions]
    block_index = positions // batch.block_size
    offset_in_block = positions % batch.block_size
    block_ids = batch.block_table[row_of_token, block_index]
    slot_mapping = block_ids.astype(np.int64) * batch.block_size + offset_in_block

    max_context_len = int(context_lens.max())
    max_blocks = cdiv(max_context_len, batch.block_size)
    block_tables = batch.block_table[rows, :max_blocks]
    num_known = batch.num_tokens[rows]
    if num_drafts is not None:
        num_known = num_known + num_drafts
    sample_mask = context_lens == num_known
    last_rows = query_start_loc[1:][sample_mask].astype(np.int64) - 1
    num_logits = None
    if num_drafts is None:
        logits_indices = last_rows
    else:
        # Each sampling request's last 1 + drafts rows, in order.
        num_logits = num_drafts[sample_mask].astype(np.int64) + 1
        group_start = np.cumsum(num_logits) - num_logits
        offset = np.arange(int(num_logits.sum())) - np.repeat(group_start, num_logits)
        logits_indices = np.repeat(last_rows - num_logits + 1, num_logits) + offset

    def to_device(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device=device, dtype=dtype)

    query_start_loc_t = to_device(query_start_loc, torch.int32)
    context_lens_t = to_device(context_lens, torch.int32)
    max_query_len = int(num_scheduled.max())
    metadata = backend.build_metadata(
        query_start_loc=query_start_loc_t,
        context_lens=context_lens_t,
        block_tables=to_device(block_tables, torch.int32),
        slot_mapping=to_device(slot_mapping, torch.int64),
        max_query_len=max_query_len,
        max_context_len=max_context_len,
    )
    layer_metadata = None
    if layer_groups is not None and batch.group_block_tables:
        group_metadata = [metadata]
        for table in batch.group_block_tables:
            group_slots = (
                table[row_of_token, block_index].astype(np.int64) * batch.block_size
                + offset_in_block
            )
            group_metadata.append(
                backend.build_metadata(
                    query_start_loc=query_start_loc_t,
                    context_lens=context_lens_t,
                    block_tables=to_device(table[rows, :max_blocks], torch.int32),
                    slot_mapping=to_device(group_slots, torch.int64),
                    max_query_len=max_query_len,
                    max_context_len=max_context_len,
                )
            )
        layer_metadata = [group_metadata[group] for group in layer_groups]
    return StepInputs(
        rows=rows,
        input_ids=to_device(input_ids, torch.int64),
        positions=to_device(positions, torch.int64),
        metadata=metadata,
        sample_mask=sample_mask,
        logits_indices=to_device(logits_indices, torch.int64),
        num_logits=num_logits,
        layer_metadata=layer_metadata,
    )
