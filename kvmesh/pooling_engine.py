"""The pooling half of kvmesh's in-process engine: the real Scheduler (pooling
mode) driving a PoolingRunner, as the scheduler service drives the worker's.

Pooling requests take no KV blocks and run whole in one step; the scheduler
packs as many as the token budget holds into each step (continuous batching
over the caller's inputs), exactly as ``kvmesh serve`` does, so ``LLM.embed``
and ``/v1/embeddings`` compute the same vectors.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

import numpy as np

from kvmesh.scheduler.config import SchedulerConfig
from kvmesh.scheduler.request import Request
from kvmesh.scheduler.scheduler import Scheduler
from kvmesh.services.contracts.math_utils import cdiv
from kvmesh.services.contracts.pooling_params import PoolingParams
from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.worker.pooling_runner import PoolingRunner

# The scheduler's block size; pooling takes no blocks, the pool only has to exist.
_BLOCK_SIZE = 16


class PoolingEngine:
    """Scheduler + PoolingRunner, stepped until a call's inputs are all pooled."""

    def __init__(
        self, runner: PoolingRunner, max_num_seqs: int = 128, max_num_batched_tokens: int = 2048
    ) -> None:
        self.runner = runner
        # An input runs whole in one step: the step budget bounds its length too
        # (the scheduler service's rule, scheduler/server.py).
        max_model_len = min(runner.max_model_len, max_num_batched_tokens)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=max_num_seqs,
                max_model_len=max_model_len,
                block_size=_BLOCK_SIZE,
                num_kv_blocks=cdiv(max_model_len, _BLOCK_SIZE),
                enable_prefix_caching=False,
                pooling=True,
            )
        )
        self._ids = itertools.count()

    @property
    def max_model_len(self) -> int:
        return self.scheduler.config.max_model_len

    def run(
        self, prompts: Sequence[Sequence[int]], params: Sequence[PoolingParams]
    ) -> list[np.ndarray]:
        """Each prompt's pooled vector (float32), in order; ValueError naming the
        first input the runner refused."""
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"input {i} is empty")
            if len(prompt) > self.max_model_len:
                raise ValueError(
                    f"input {i} has {len(prompt)} tokens, more than the maximum of "
                    f"{self.max_model_len} (the model's, capped by the step token budget)"
                )
        batch = next(self._ids)
        ids = [f"pool-{batch}-{i}" for i in range(len(prompts))]
        vectors: dict[str, np.ndarray] = {}
        try:
            for request_id, prompt, p in zip(ids, prompts, params, strict=True):
                self.scheduler.add_request(
                    Request(
                        request_id=request_id,
                        prompt_token_ids=list(prompt),
                        sampling_params=SamplingParams(max_tokens=1, pooling=p),
                        eos_token_ids=(),
                        arrival_time=time.monotonic(),
                    )
                )
            while self.scheduler.has_unfinished_requests():
                step = self.scheduler.schedule()
                for out in self.scheduler.update_from_output(step, self.runner.execute_model(step)):
                    if out.error:
                        raise ValueError(f"input {ids.index(out.request_id)}: {out.error}")
                    if out.finished:
                        vectors[out.request_id] = np.frombuffer(out.pooled_data, dtype="<f4")
        finally:
            # A failure mid-call leaves nothing behind for the next call.
            self.scheduler.abort_requests([i for i in ids if i not in vectors])
        return [vectors[i] for i in ids]
