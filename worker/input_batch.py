"""The worker's persistent batch: per-request state kept across steps.

A request's full data arrives once (``NewRequestData``); later steps only send
new block ids and the scheduler's ``num_computed_tokens``. Each request owns a
row of preallocated numpy arrays (token ids, block table, counters), so a step's
input tensors are built by fancy indexing instead of per-token Python loops.

With several KV-cache groups (services/contracts/kv_cache_groups.py) a row has
one block table per group, all of one length (``num_blocks``): group 0's in
``block_table``, the others' in ``group_block_tables``.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from kvmesh.services.contracts.lora_request import LoRARequest
from kvmesh.services.contracts.math_utils import cdiv
from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.services.contracts.step import NewRequestData
from kvmesh.worker.sampling_metadata import validate_sampling_params

logger = logging.getLogger(__name__)


class InputBatch:
    """Rows of request state; rows are reused after a request leaves."""

    def __init__(
        self,
        max_model_len: int,
        block_size: int,
        num_kv_blocks: int,
        vocab_size: int,
        initial_capacity: int = 64,
        device: torch.device | str = "cpu",
        num_kv_cache_groups: int = 1,
    ) -> None:
        self.device = torch.device(device)
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        self.vocab_size = vocab_size
        self.max_blocks_per_req = cdiv(max_model_len, block_size)
        self.capacity = 0
        # One spare column: a request at max_model_len still stores the token it samples.
        self.token_ids = np.zeros((0, max_model_len + 1), dtype=np.int32)
        self.num_tokens = np.zeros(0, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(0, dtype=np.int64)
        self.num_computed_tokens = np.zeros(0, dtype=np.int64)
        self.block_table = np.zeros((0, self.max_blocks_per_req), dtype=np.int32)
        # KV-cache groups 1..'s tables (empty with one group).
        self.group_block_tables = [
            np.zeros((0, self.max_blocks_per_req), dtype=np.int32)
            for _ in range(num_kv_cache_groups - 1)
        ]
        self.num_blocks = np.zeros(0, dtype=np.int64)
        self.sampling_params: list[SamplingParams | None] = []
        # The adapter each row runs with (None: the base model).
        self.lora_requests: list[LoRARequest | None] = []
        self.generators: dict[int, torch.Generator] = {}
        self.row_of: dict[str, int] = {}
        # Bumped whenever a row's request changes (added or removed): the sampler's
        # per-request columns are cached per composition (SamplingColumnsCache).
        self.composition = 0
        self._free_rows: list[int] = []
        self._grow(initial_capacity)

    def __len__(self) -> int:
        return len(self.row_of)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.row_of

    def _grow(self, new_capacity: int) -> None:
        extra = new_capacity - self.capacity

        def pad(array: np.ndarray) -> np.ndarray:
            return np.concatenate([array, np.zeros((extra, *array.shape[1:]), array.dtype)])

        self.token_ids = pad(self.token_ids)
        self.num_tokens = pad(self.num_tokens)
        self.num_prompt_tokens = pad(self.num_prompt_tokens)
        self.num_computed_tokens = pad(self.num_computed_tokens)
        self.block_table = pad(self.block_table)
        self.group_block_tables = [pad(table) for table in self.group_block_tables]
        self.num_blocks = pad(self.num_blocks)
        self.sampling_params.extend([None] * extra)
        self.lora_requests.extend([None] * extra)
        # Lowest rows first, so a small batch stays in the first rows.
        self._free_rows = sorted(
            [*self._free_rows, *range(self.capacity, new_capacity)], reverse=True
        )
        self.capacity = new_capacity

    def _check_new_request(self, new: NewRequestData) -> None:
        num_tokens = len(new.prompt_token_ids) + len(new.output_token_ids)
        if not new.prompt_token_ids:
            raise ValueError("empty prompt")
        if num_tokens > self.max_model_len:
            raise ValueError(f"{num_tokens} tokens exceed max_model_len={self.max_model_len}")
        ids = np.asarray([*new.prompt_token_ids, *new.output_token_ids])
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise ValueError(f"token id outside the vocabulary [0, {self.vocab_size})")
        if not 0 <= new.num_computed_tokens <= num_tokens:
            raise ValueError(f"num_computed_tokens={new.num_computed_tokens} out of range")
        validate_sampling_params(new.sampling_params, self.vocab_size)
        self._check_block_ids(new.block_ids, 0)
        self._check_group_block_ids(new.group_block_ids, len(new.block_ids), 0)

    def _check_group_block_ids(
        self, group_block_ids: list[list[int]], num_ids: int, num_existing: int
    ) -> None:
        """Groups 1..'s ids: one list per group, each as long as group 0's."""
        if len(group_block_ids) != len(self.group_block_tables):
            raise ValueError(
                f"block ids for {len(group_block_ids) + 1} KV-cache groups, the model has "
                f"{len(self.group_block_tables) + 1}"
            )
        for ids in group_block_ids:
            if len(ids) != num_ids:
                raise ValueError(f"{len(ids)} block ids in a KV-cache group, group 0 has {num_ids}")
            self._check_block_ids(ids, num_existing)

    def _check_block_ids(self, block_ids: list[int], num_existing: int) -> None:
        if num_existing + len(block_ids) > self.max_blocks_per_req:
            raise ValueError(
                f"{num_existing + len(block_ids)} blocks exceed the per-request maximum "
                f"{self.max_blocks_per_req}"
            )
        if block_ids and (min(block_ids) < 0 or max(block_ids) >= self.num_kv_blocks):
            raise ValueError(f"block id outside [0, {self.num_kv_blocks})")

    def add_request(self, new: NewRequestData) -> None:
        """Take a request's full data; raises ValueError (batch untouched) if it is invalid."""
        self._check_new_request(new)
        if new.req_id in self.row_of:
            # Resumed after a preemption without a drop in between: start over.
            self.remove_request(new.req_id)
        if not self._free_rows:
            self._grow(max(2 * self.capacity, 1))
        row = self._free_rows.pop()
        prompt_len = len(new.prompt_token_ids)
        num_tokens = prompt_len + len(new.output_token_ids)
        self.token_ids[row, :prompt_len] = new.prompt_token_ids
        self.token_ids[row, prompt_len:num_tokens] = new.output_token_ids
        self.num_prompt_tokens[row] = prompt_len
        self.num_tokens[row] = num_tokens
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.block_table[row, : len(new.block_ids)] = new.block_ids
        for table, ids in zip(self.group_block_tables, new.group_block_ids, strict=True):
            table[row, : len(ids)] = ids
        self.num_blocks[row] = len(new.block_ids)
        params = new.sampling_params
        self.sampling_params[row] = params
        self.lora_requests[row] = new.lora_request
        if params.seed is not None:
            self.generators[row] = self._seeded_generator(params.seed, len(new.output_token_ids))
        self.row_of[new.req_id] = row
        self.composition += 1

    def _seeded_generator(self, seed: int, num_sampled: int) -> torch.Generator:
        generator = torch.Generator(device=self.device).manual_seed(seed)
        # Replay the draws of tokens sampled before a preemption (one int64 key
        # per token, as the sampler's draw_keys makes; a batch of n draws is n
        # single ones), so a resumed seeded request continues the same stream.
        if num_sampled:
            torch.empty(num_sampled, dtype=torch.int64, device=self.device).random_(
                generator=generator
            )
        return generator

    def update_request(
        self,
        req_id: str,
        new_block_ids: list[int],
        num_computed: int,
        new_group_block_ids: list[list[int]] | None = None,
    ) -> None:
        """Apply one step's deltas (``new_group_block_ids``: groups 1..'s, with
        several KV-cache groups); raises KeyError/ValueError if they do not fit."""
        row = self.row_of[req_id]
        num_existing = int(self.num_blocks[row])
        self._check_block_ids(new_block_ids, num_existing)
        group_ids = new_group_block_ids or [[] for _ in self.group_block_tables]
        if self.group_block_tables:
            self._check_group_block_ids(group_ids, len(new_block_ids), num_existing)
        if not 0 <= num_computed <= self.num_tokens[row]:
            raise ValueError(
                f"num_computed_tokens={num_computed} but only {self.num_tokens[row]} tokens known"
            )
        end = num_existing + len(new_block_ids)
        self.block_table[row, num_existing:end] = new_block_ids
        for table, ids in zip(self.group_block_tables, group_ids, strict=True):
            table[row, num_existing:end] = ids
        self.num_blocks[row] = end
        self.num_computed_tokens[row] = num_computed

    def remove_request(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is None:
            return
        self.sampling_params[row] = None
        self.lora_requests[row] = None
        self.generators.pop(row, None)
        self.composition += 1
        self.num_blocks[row] = 0
        self._free_rows.append(row)

    def append_sampled_tokens(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Extend each row's sequence by its sampled token (rows are distinct)."""
        self.token_ids[rows, self.num_tokens[rows]] = token_ids
        self.num_tokens[rows] += 1

    def write_draft_tokens(self, row: int, draft_token_ids: list[int]) -> None:
        """Place a step's draft tokens after the row's known tokens (not counted in
        ``num_tokens``): the step's input reads them from there. ValueError if
        they leave the vocabulary or the row."""
        start = int(self.num_tokens[row])
        if start + len(draft_token_ids) > self.max_model_len:
            raise ValueError(
                f"{len(draft_token_ids)} drafts after {start} tokens pass max_model_len"
            )
        if min(draft_token_ids) < 0 or max(draft_token_ids) >= self.vocab_size:
            raise ValueError(f"draft token id outside the vocabulary [0, {self.vocab_size})")
        self.token_ids[row, start : start + len(draft_token_ids)] = draft_token_ids

    def append_verified_tokens(self, row: int, token_ids: list[int]) -> None:
        """Extend a row by its accepted drafts and the token sampled after them, and
        drop the blocks past its known tokens: they held only rejected drafts, and
        the scheduler frees the same tail (the step contract's rule)."""
        start = int(self.num_tokens[row])
        self.token_ids[row, start : start + len(token_ids)] = token_ids
        num_tokens = self.num_tokens[row] = start + len(token_ids)
        self.num_blocks[row] = min(
            int(self.num_blocks[row]), cdiv(int(num_tokens), self.block_size)
        )

    def output_token_ids(self, req_id: str) -> list[int]:
        row = self.row_of[req_id]
        return self.token_ids[row, self.num_prompt_tokens[row] : self.num_tokens[row]].tolist()
