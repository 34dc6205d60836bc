"""Run one engine step: update the persistent batch, forward, sample.

``ModelRunner.execute_model`` is the whole worker core for a step; the gRPC
service only decodes the ``SchedulerOutput`` and encodes the answer.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from kernels.registry import select_attention_backend
from services.step import ModelRunnerOutput, PromptLogprobs, SchedulerOutput
from worker.config import CacheConfig, ModelConfig
from worker.input_batch import InputBatch
from worker.kv_cache import allocate_kv_caches
from worker.kv_connector import KVConnectorWorker
from worker.model_loader import load_model
from worker.parallel.collectives import Collectives
from worker.parallel.layout import RankLayout
from worker.parallel.replica_kv_connector import ReplicaKVConnector
from worker.parallel.sharding import ShardPlan
from worker.prompt_logprobs import (
    PromptLogprobsSpan,
    compute_prompt_logprobs,
    plan_prompt_logprobs,
)
from worker.sampler import Sampler
from worker.sampling_metadata import build_sampling_metadata
from worker.step_inputs import StepInputs, check_schedulable, prepare_step_inputs
from worker.structured_output import GrammarCompilerCache, StructuredOutputManager

logger = logging.getLogger(__name__)


@dataclass
class StepTimings:
    """Seconds spent in each phase, accumulated over steps (for profiling)."""

    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    num_steps: int = 0


def shard_plan(model_config: ModelConfig, layout: RankLayout) -> ShardPlan:
    return ShardPlan(
        num_heads=model_config.num_heads,
        num_kv_heads=model_config.num_kv_heads,
        head_dim=model_config.head_dim,
        intermediate_size=model_config.intermediate_size,
        vocab_size=model_config.vocab_size,
        num_layers=model_config.num_layers,
        tp_size=layout.tp_size,
        tp_rank=layout.tp_rank,
        pp_size=layout.pp_size,
        pp_rank=layout.pp_rank,
    )


class ModelRunner:
    """Owns the model, its KV cache and the persistent batch of one worker.

    With ``collectives`` it is one rank of a tensor/pipeline-parallel replica:
    every rank holds the same persistent batch and block ids and runs the same
    step (its own shard of the model); only the driver (rank 0) samples, and it
    broadcasts the sampled tokens so every rank's batch moves in step.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        device: str = "cpu",
        attention_backend: str | None = None,
        num_threads: int | None = None,
        collectives: Collectives | None = None,
    ) -> None:
        # Decode matmuls are memory-bandwidth bound and torch parallelizes each
        # one across its intra-op threads, so a worker that owns the machine
        # should use every core. torch's own default may count only physical
        # cores or be lowered by the environment; when other processes share
        # the host (tests, a co-located service), pass a smaller number. The
        # setting is process-wide, which is fine: a worker process runs one
        # model runner.
        if device == "cpu" or num_threads is not None:
            torch.set_num_threads(num_threads or os.cpu_count() or 1)
            # One step runs at a time and each op is parallelized inside; an
            # inter-op pool would only add threads competing for the same cores.
            # torch allows this once, before any inter-op work has started.
            with contextlib.suppress(RuntimeError):
                torch.set_num_interop_threads(1)
        self.device = torch.device(device)
        self.model_config = model_config
        self.cache_config = cache_config
        self.collectives = collectives
        self.layout = collectives.layout if collectives is not None else RankLayout()
        self.plan = shard_plan(model_config, self.layout)
        self.num_kv_blocks = cache_config.resolve_num_kv_blocks(
            model_config, self.plan.largest_kv_share()
        )
        self.model = (
            load_model(
                model_config,
                self.device,
                self.plan,
                collectives.all_reduce,
                collectives.all_gather_vocab,
            )
            if collectives is not None and self.layout.tp_size > 1
            else load_model(model_config, self.device, self.plan)
        )
        self.backend = select_attention_backend(self.device, attention_backend)
        self.kv_caches = allocate_kv_caches(
            model_config,
            self.num_kv_blocks,
            cache_config.block_size,
            self.device,
            num_kv_heads=len(self.plan.heads.kv_heads),
            num_layers=len(self.plan.layers),
        )
        self.input_batch = InputBatch(
            model_config.max_model_len,
            cache_config.block_size,
            self.num_kv_blocks,
            model_config.vocab_size,
            device=self.device,
        )
        self.sampler = Sampler()
        self.structured_output = StructuredOutputManager(
            GrammarCompilerCache(
                model_config.path, model_config.vocab_size, model_config.eos_token_ids
            )
        )
        self.timings = StepTimings()
        # Set by the worker service when KV offload is on (it needs the event loop).
        # On a parallel rank, a ReplicaKVConnector around it (same methods).
        self.kv_connector: KVConnectorWorker | ReplicaKVConnector | None = None

    @property
    def samples(self) -> bool:
        """Only the driver samples (and so keeps grammars and sampling state)."""
        return self.layout.is_driver

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def attention_backend_name(self) -> str:
        return self.backend.name

    def reset(self) -> None:
        """Drop every request of the persistent batch (a new scheduler starts from scratch)."""
        for req_id in list(self.input_batch.row_of):
            self.input_batch.remove_request(req_id)
            self.structured_output.remove_request(req_id)
        if self.kv_connector is not None:
            self.kv_connector.reset()

    def _apply_scheduler_deltas(self, scheduler_output: SchedulerOutput) -> dict[str, str]:
        """Drop finished requests, add new ones, apply cached deltas; returns errors."""
        errors: dict[str, str] = {}
        batch = self.input_batch
        for req_id in scheduler_output.finished_req_ids:
            batch.remove_request(req_id)
            self.structured_output.remove_request(req_id)
        for new in scheduler_output.scheduled_new_reqs:
            try:
                batch.add_request(new)
                spec = new.sampling_params.structured_output
                if spec is not None and self.samples:
                    self.structured_output.add_request(new.req_id, spec, new.output_token_ids)
            except (ValueError, TypeError) as exc:
                batch.remove_request(new.req_id)
                errors[new.req_id] = f"invalid request: {exc}"
                logger.warning("request %s rejected: %s", new.req_id, exc)
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_block_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            if req_id not in batch:
                errors[req_id] = "unknown request (never sent as new, or already dropped)"
                logger.warning("request %s: deltas for a request the worker does not hold", req_id)
                continue
            try:
                batch.update_request(req_id, new_block_ids, num_computed)
            except ValueError as exc:
                errors[req_id] = f"invalid step for request: {exc}"
                logger.warning("request %s: %s", req_id, exc)
                batch.remove_request(req_id)
        return errors

    def _scheduled_requests(
        self, scheduler_output: SchedulerOutput, errors: dict[str, str]
    ) -> tuple[list[str], np.ndarray, np.ndarray]:
        """(req_ids, rows, num_scheduled) of the requests that can run this step."""
        batch = self.input_batch
        req_ids: list[str] = []
        for req_id in scheduler_output.num_scheduled_tokens:
            if req_id in errors:
                continue
            if req_id not in batch:
                errors[req_id] = "scheduled but unknown to the worker"
                continue
            req_ids.append(req_id)
        rows = np.fromiter((batch.row_of[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        num_scheduled = np.fromiter(
            (scheduler_output.num_scheduled_tokens[r] for r in req_ids),
            dtype=np.int64,
            count=len(req_ids),
        )
        reasons = check_schedulable(batch, rows, num_scheduled)
        if any(reasons):
            keep = np.array([not reason for reason in reasons], dtype=bool)
            for req_id, reason in zip(req_ids, reasons, strict=True):
                if reason:
                    errors[req_id] = f"invalid step for request: {reason}"
                    logger.warning("request %s: %s", req_id, reason)
                    batch.remove_request(req_id)
            req_ids = [r for r, ok in zip(req_ids, keep, strict=True) if ok]
            rows, num_scheduled = rows[keep], num_scheduled[keep]
        return req_ids, rows, num_scheduled

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        connector = self.kv_connector
        if connector is None:
            return self._execute_model(scheduler_output)
        # Before the forward: blocks to save are copied out before this step
        # may overwrite them, and arrived loads are in place before it reads them.
        connector.start_step(scheduler_output)
        output = self._execute_model(scheduler_output)
        output.kv_connector_output = connector.get_finished()
        return output

    def _execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        output = ModelRunnerOutput.make_empty(scheduler_output.step_id)
        started = time.perf_counter()
        output.errors = self._apply_scheduler_deltas(scheduler_output)
        req_ids, rows, num_scheduled = self._scheduled_requests(scheduler_output, output.errors)
        if not req_ids:
            return output
        inputs = prepare_step_inputs(
            self.input_batch, rows, num_scheduled, self.backend, self.device
        )
        prompt_spans = plan_prompt_logprobs(self.input_batch, req_ids, rows, num_scheduled)
        prepared = time.perf_counter()
        try:
            sampled, logprobs, output.prompt_logprobs, failed_rows = self._forward_and_sample(
                inputs, prompt_spans
            )
        except Exception as exc:
            if self.layout.is_parallel:
                # The other ranks may be waiting in a collective this rank never
                # reaches: the replica is out of step and restarts as a whole.
                raise
            # A failure in the forward pass belongs to the whole step (the
            # sampler isolates its own per row): fail the step's requests,
            # keep the worker alive for the next one.
            logger.exception("step %s failed", scheduler_output.step_id)
            for req_id in req_ids:
                output.errors[req_id] = f"worker step failed: {exc}"
                self.input_batch.remove_request(req_id)
            return output

        sample_rows = rows[inputs.sample_mask]
        token_array = sampled.cpu().numpy()
        self.input_batch.append_sampled_tokens(sample_rows, token_array)
        token_list = token_array.tolist()
        output.req_ids = req_ids
        output.sampled_token_ids = [[] for _ in req_ids]
        output.logprobs = [[] for _ in req_ids]
        for position, index in enumerate(np.flatnonzero(inputs.sample_mask)):
            if position in failed_rows:
                self._fail_request(req_ids[index], failed_rows[position], output)
                continue
            output.sampled_token_ids[index] = [token_list[position]]
            if (sampled_logprobs := logprobs[position]) is not None:
                output.logprobs[index] = [sampled_logprobs]
        output.errors.update(self.structured_output.pop_errors())
        self.timings.prepare += prepared - started
        self.timings.num_steps += 1
        return output

    def _fail_request(self, req_id: str, message: str, output: ModelRunnerOutput) -> None:
        output.errors[req_id] = message
        self.input_batch.remove_request(req_id)
        self.structured_output.remove_request(req_id)

    def _forward_and_sample(
        self, inputs: StepInputs, prompt_spans: list[PromptLogprobsSpan]
    ) -> tuple[torch.Tensor, list, list[PromptLogprobs], dict[int, str]]:
        """(sampled token per sampling row, their logprobs, prompt logprobs, failed
        sampling rows by position)."""
        forward_started = time.perf_counter()
        hidden = self._run_layers(inputs)
        if hidden is None:  # a later pipeline stage: the driver's stage samples
            self.timings.forward += time.perf_counter() - forward_started
            return self._receive_sampled(inputs)
        prompt_logprobs = (
            compute_prompt_logprobs(self.model.compute_logits, hidden, prompt_spans)
            if prompt_spans
            else []
        )
        if inputs.logits_indices.shape[0] == 0:
            self.timings.forward += time.perf_counter() - forward_started
            return torch.empty(0, dtype=torch.int64), [], prompt_logprobs, {}
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        sample_started = time.perf_counter()
        self.timings.forward += sample_started - forward_started
        if not self.samples:
            return self._receive_sampled(inputs)
        batch = self.input_batch
        sample_rows = inputs.rows[inputs.sample_mask]
        params = [batch.sampling_params[row] for row in sample_rows]
        generators = {
            i: batch.generators[row] for i, row in enumerate(sample_rows) if row in batch.generators
        }
        metadata = build_sampling_metadata(
            params,  # type: ignore[arg-type]
            batch.token_ids[sample_rows],
            batch.num_prompt_tokens[sample_rows],
            batch.num_tokens[sample_rows],
            generators,
            self.model_config.eos_token_ids,
            self.vocab_size,
            self.device,
        )
        step_grammar = self.structured_output.constrain(sample_rows, batch.row_of)
        if step_grammar is not None:
            metadata.grammar_bitmask = step_grammar.bitmask
            metadata.grammar_rows = step_grammar.positions
        result = self.sampler(logits, metadata)
        if step_grammar is not None:
            step_grammar.accept(result.token_ids.tolist())
        if self.layout.is_parallel:
            self._send_sampled(result.token_ids, result.failed_rows)
        self.timings.sample += time.perf_counter() - sample_started
        return result.token_ids, result.logprobs, prompt_logprobs, result.failed_rows

    def _run_layers(self, inputs: StepInputs) -> torch.Tensor | None:
        """The final hidden states on the first pipeline stage, None on the others.

        Stages pass activations around a ring: stage 0 embeds and runs its
        layers, each next stage continues, and the last hands its output back
        to stage 0, which holds the final norm and LM head.
        """
        if self.layout.pp_size == 1:
            return self.model(
                inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata, self.backend
            )
        collectives = self.collectives
        assert collectives is not None
        shape = (inputs.input_ids.shape[0], self.model_config.hidden_size)
        dtype = self.model_config.dtype
        first = self.plan.is_first_stage
        hidden = None if first else collectives.recv_hidden(shape, dtype)
        hidden = self.model(
            inputs.input_ids,
            inputs.positions,
            self.kv_caches,
            inputs.metadata,
            self.backend,
            hidden=hidden,
        )
        collectives.send_hidden(hidden)
        return collectives.recv_hidden(shape, dtype) if first else None

    def _send_sampled(self, token_ids: torch.Tensor, failed_rows: dict[int, str]) -> None:
        tokens = token_ids.to(device="cpu", dtype=torch.int64, copy=True)
        for position in failed_rows:
            tokens[position] = -1
        assert self.collectives is not None
        self.collectives.broadcast_sampled(tokens)

    def _receive_sampled(
        self, inputs: StepInputs
    ) -> tuple[torch.Tensor, list, list[PromptLogprobs], dict[int, str]]:
        """The driver's sampled tokens (-1: that row failed there, so it fails here)."""
        assert self.collectives is not None
        num_rows = int(inputs.sample_mask.sum())
        if num_rows == 0:  # the driver samples nothing either, and sends nothing
            return torch.empty(0, dtype=torch.int64), [], [], {}
        tokens = self.collectives.broadcast_sampled(torch.empty(num_rows, dtype=torch.int64))
        failed = {int(p): "failed on the driver" for p in torch.nonzero(tokens < 0).flatten()}
        return tokens, [None] * num_rows, [], failed
