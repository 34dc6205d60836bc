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
from worker.lora.setup import attach_lora_slots
from worker.lora.slots import LoRASlots
from worker.lora.step_batch import NO_ADAPTER, LoRABatch, order_by_slot, plan_lora_batch
from worker.model_loader import load_model
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


class ModelRunner:
    """Owns the model, its KV cache and the persistent batch of one worker."""

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        device: str = "cpu",
        attention_backend: str | None = None,
        num_threads: int | None = None,
        max_loras: int = 0,
        max_lora_rank: int = 16,
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
        self.num_kv_blocks = cache_config.resolve_num_kv_blocks(model_config)
        self.model = load_model(model_config, self.device)
        # --enable-lora: adapter slots in every layer (0 slots: LoRA off).
        self.lora_slots: LoRASlots | None = (
            attach_lora_slots(self.model, max_loras, max_lora_rank, self.device)
            if max_loras
            else None
        )
        self.backend = select_attention_backend(self.device, attention_backend)
        self.kv_caches = allocate_kv_caches(
            model_config, self.num_kv_blocks, cache_config.block_size, self.device
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
        self.kv_connector: KVConnectorWorker | None = None

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
                if new.lora_request is not None and self.lora_slots is None:
                    raise ValueError("LoRA adapters are not enabled on this worker")
                batch.add_request(new)
                spec = new.sampling_params.structured_output
                if spec is not None:
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
        lora = None
        if self.lora_slots is not None and req_ids:
            req_ids, rows, num_scheduled, lora = self._group_by_adapter(
                req_ids, rows, num_scheduled, output.errors
            )
        if not req_ids:
            return output
        inputs = prepare_step_inputs(
            self.input_batch, rows, num_scheduled, self.backend, self.device
        )
        prompt_spans = plan_prompt_logprobs(self.input_batch, req_ids, rows, num_scheduled)
        prepared = time.perf_counter()
        try:
            sampled, logprobs, output.prompt_logprobs, failed_rows = self._forward_and_sample(
                inputs, prompt_spans, lora
            )
        except Exception as exc:
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

    def _group_by_adapter(
        self,
        req_ids: list[str],
        rows: np.ndarray,
        num_scheduled: np.ndarray,
        errors: dict[str, str],
    ) -> tuple[list[str], np.ndarray, np.ndarray, LoRABatch | None]:
        """Slot the step's adapters and order its requests by slot.

        A request whose adapter cannot be loaded fails alone. Returns the
        requests that run, in their new order, and the step's adapter layout
        (None when every request runs the base model).
        """
        assert self.lora_slots is not None
        loras = [self.input_batch.lora_requests[row] for row in rows]
        wanted = {lora.lora_id: lora for lora in loras if lora is not None}
        if not wanted:
            return req_ids, rows, num_scheduled, None
        slot_of, failures = self.lora_slots.activate(wanted)
        keep = np.ones(len(req_ids), dtype=bool)
        for index, (req_id, lora) in enumerate(zip(req_ids, loras, strict=True)):
            if lora is not None and lora.lora_id in failures:
                errors[req_id] = failures[lora.lora_id]
                self.input_batch.remove_request(req_id)
                self.structured_output.remove_request(req_id)
                keep[index] = False
        slots = np.fromiter(
            (
                NO_ADAPTER if lora is None else slot_of.get(lora.lora_id, NO_ADAPTER)
                for lora in loras
            ),
            dtype=np.int64,
            count=len(loras),
        )[keep]
        req_ids = [r for r, ok in zip(req_ids, keep, strict=True) if ok]
        rows, num_scheduled = rows[keep], num_scheduled[keep]
        order = order_by_slot(slots)
        req_ids = [req_ids[i] for i in order]
        rows, num_scheduled, slots = rows[order], num_scheduled[order], slots[order]
        return req_ids, rows, num_scheduled, plan_lora_batch(slots, num_scheduled, self.device)

    def _forward_and_sample(
        self,
        inputs: StepInputs,
        prompt_spans: list[PromptLogprobsSpan],
        lora: LoRABatch | None = None,
    ) -> tuple[torch.Tensor, list, list[PromptLogprobs], dict[int, str]]:
        """(sampled token per sampling row, their logprobs, prompt logprobs, failed
        sampling rows by position)."""
        forward_started = time.perf_counter()
        hidden = self.model(
            inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata, self.backend, lora
        )
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
        self.timings.sample += time.perf_counter() - sample_started
        return result.token_ids, result.logprobs, prompt_logprobs, result.failed_rows
