"""Run one engine step: update the persistent batch, forward, sample.

``ModelRunner.execute_model`` is the whole worker core for a step; the gRPC
service only decodes the ``SchedulerOutput`` and encodes the answer. A step
runs in two halves, ``begin_step`` (apply the deltas, build the inputs, run
this pipeline stage's layers and send them on) and ``finish_step`` (the final
hidden states, logits and sampling): a pipeline-parallel driver begins step
n+1 before it finishes step n, so stages overlap (worker/parallel/driver.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvmesh.kernels.registry import select_attention_backend
from kvmesh.services.contracts.kv_cache_groups import KVCacheGroup, group_size, layer_slots
from kvmesh.services.contracts.step import (
    Logprobs,
    ModelRunnerOutput,
    PromptLogprobs,
    SchedulerOutput,
)
from kvmesh.worker.config import CacheConfig, ModelConfig
from kvmesh.worker.input_batch import InputBatch
from kvmesh.worker.kv_cache import (
    allocate_group_kv_caches,
    allocate_kv_caches,
    model_kv_cache_groups,
)
from kvmesh.worker.kv_connector import KVConnectorWorker
from kvmesh.worker.lora.setup import attach_lora_slots
from kvmesh.worker.lora.slots import LoRASlots
from kvmesh.worker.lora.step_batch import NO_ADAPTER, LoRABatch, order_by_slot, plan_lora_batch
from kvmesh.worker.model_loader import load_model
from kvmesh.worker.models.config_checks import UnsupportedModelError
from kvmesh.worker.models.decoder import full_plan
from kvmesh.worker.models.registry import get_model_class
from kvmesh.worker.parallel.collectives import Collectives
from kvmesh.worker.parallel.layout import RankLayout
from kvmesh.worker.parallel.replica_kv_connector import ReplicaKVConnector
from kvmesh.worker.parallel.sharding import ShardPlan
from kvmesh.worker.prompt_logprobs import (
    compute_prompt_logprobs,
    plan_prompt_logprobs,
)
from kvmesh.worker.rejection_sampler import verify_drafts
from kvmesh.worker.sampler import Sampler, SamplerOutput
from kvmesh.worker.sampling_metadata import (
    RequestColumns,
    SamplingColumnsCache,
    gather_request_columns,
    step_sampling_metadata,
)
from kvmesh.worker.step_in_flight import StepInFlight
from kvmesh.worker.step_inputs import check_schedulable, prepare_step_inputs
from kvmesh.worker.structured_output import GrammarCompilerCache, StructuredOutputManager

logger = logging.getLogger(__name__)


@dataclass
class StepTimings:
    """Seconds spent in each phase, accumulated over steps (for profiling)."""

    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    num_steps: int = 0


def shard_plan(model_config: ModelConfig, layout: RankLayout) -> ShardPlan:
    return dataclasses.replace(
        full_plan(model_config),
        tp_size=layout.tp_size,
        tp_rank=layout.tp_rank,
        pp_size=layout.pp_size,
        pp_rank=layout.pp_rank,
    )


class ModelRunner:
    """Owns the model, its KV cache and the persistent batch of one worker.

    With ``collectives`` it is one rank of a tensor/pipeline-parallel replica:
    every rank holds the same persistent batch and block ids and runs the same
    step (its own shard of the model); only the driver (rank 0) samples, and
    the other ranks append its tokens (``apply_sampled``) so every rank's batch
    moves in step.

    Steps may overlap (begun, not finished) only when their requests are
    disjoint; a request a later step drops while an earlier one still uses its
    row keeps the row until that step completes.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        device: str = "cpu",
        attention_backend: str | None = None,
        num_threads: int | None = None,
        collectives: Collectives | None = None,
        max_loras: int = 0,
        max_lora_rank: int = 16,
        kv_cache_groups: Sequence[KVCacheGroup] | None = None,
    ) -> None:
        """``kv_cache_groups``: the layers' KV-cache groups (default: from the
        model's per-layer spec, services/contracts/kv_cache_groups.py)."""
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
        self.kv_cache_groups = (
            tuple(kv_cache_groups)
            if kv_cache_groups is not None
            else model_kv_cache_groups(
                get_model_class(model_config.architecture).kv_cache_spec(model_config),
                model_config.max_model_len,
            )
        )
        multi_group = len(self.kv_cache_groups) > 1
        if multi_group and self.layout.pp_size > 1:
            raise UnsupportedModelError(
                "layers of several KV-cache groups (sliding-window and full attention, "
                f"{len(self.kv_cache_groups)} groups) under pipeline parallelism are not "
                "implemented: run this model with --pipeline-parallel-size 1"
            )
        # Per layer, its group's index (None: one group, every layer reads one table).
        self.layer_groups: list[int] | None = (
            [group for group, _ in layer_slots(self.kv_cache_groups, model_config.num_layers)]
            if multi_group
            else None
        )
        # A block is one page in each of group_size tensor pairs, not in every layer.
        kv_share = self.plan.largest_kv_share()
        if multi_group:
            kv_share = kv_share // model_config.num_layers * group_size(self.kv_cache_groups)
        self.num_kv_blocks = cache_config.resolve_num_kv_blocks(model_config, kv_share)
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
        # --enable-lora: adapter slots in every layer (0 slots: LoRA off); on a
        # parallel rank each adapter cut like the projections it adapts.
        self.lora_slots: LoRASlots | None = (
            attach_lora_slots(
                self.model,
                max_loras,
                max_lora_rank,
                self.device,
                self._agree_on_lora_failures if self.layout.is_parallel else None,
            )
            if max_loras
            else None
        )
        self.backend = select_attention_backend(self.device, attention_backend)
        refused = self.backend.kv_cache_unsupported_reason(cache_config.kv_cache_dtype)
        if refused is not None:
            raise ValueError(
                f"--kv-cache-dtype {cache_config.kv_cache_dtype} is not supported by the "
                f"{self.backend.name!r} attention backend: {refused}"
            )
        self.kv_caches = (
            allocate_group_kv_caches(
                model_config,
                self.kv_cache_groups,
                self.num_kv_blocks,
                cache_config.block_size,
                self.device,
                num_kv_heads=len(self.plan.heads.kv_heads),
                kv_format=cache_config.kv_format,
            )
            if multi_group
            else allocate_kv_caches(
                model_config,
                self.num_kv_blocks,
                cache_config.block_size,
                self.device,
                num_kv_heads=len(self.plan.heads.kv_heads),
                num_layers=len(self.plan.layers),
                kv_format=cache_config.kv_format,
            )
        )
        self.input_batch = InputBatch(
            model_config.max_model_len,
            cache_config.block_size,
            self.num_kv_blocks,
            model_config.vocab_size,
            device=self.device,
            num_kv_cache_groups=len(self.kv_cache_groups),
        )
        # The C++ ops' argmax where the model runs them (so they are loaded).
        self.sampler = Sampler(native=self.model.uses_native_ops)
        # The sampling rows' request columns, per batch composition.
        self.sampling_columns = SamplingColumnsCache()
        self.structured_output = StructuredOutputManager(
            GrammarCompilerCache(
                model_config.path, model_config.vocab_size, model_config.eos_token_ids
            )
        )
        self.timings = StepTimings()
        # Set by the worker service when KV offload is on (it needs the event loop).
        # On a parallel rank, a ReplicaKVConnector around it (same methods).
        self.kv_connector: KVConnectorWorker | ReplicaKVConnector | None = None
        # Request -> the begun, not yet completed step that uses its row.
        self._busy: dict[str, StepInFlight] = {}

    def _agree_on_lora_failures(self, errors: dict[str, str]) -> dict[str, str]:
        """Every rank's adapter load errors, merged (the first rank's message per
        adapter): called by every rank at the same point of the same step."""
        assert self.collectives is not None
        merged: dict[str, str] = {}
        for rank_errors in self.collectives.all_gather_host(errors):
            for lora_id, message in rank_errors.items():
                merged.setdefault(lora_id, message)
        return merged

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
        self._busy.clear()
        for req_id in list(self.input_batch.row_of):
            self._remove(req_id)
        if self.kv_connector is not None:
            self.kv_connector.reset()

    def _remove(self, req_id: str) -> None:
        self.input_batch.remove_request(req_id)
        self.structured_output.remove_request(req_id)

    def busy_with(self, scheduler_output: SchedulerOutput) -> bool:
        """Whether the step runs a request that a begun, unfinished step runs too
        (then that step must finish first: its token is this one's input)."""
        busy = self._busy
        return bool(busy) and any(r in busy for r in scheduler_output.num_scheduled_tokens)

    def _apply_scheduler_deltas(self, scheduler_output: SchedulerOutput) -> dict[str, str]:
        """Drop finished requests, add new ones, apply cached deltas; returns errors."""
        errors: dict[str, str] = {}
        batch = self.input_batch
        for req_id in scheduler_output.finished_req_ids:
            step = self._busy.get(req_id)
            if step is not None:
                # An unfinished step still reads and appends to its row.
                step.removals.append(req_id)
                continue
            self._remove(req_id)
        for new in scheduler_output.scheduled_new_reqs:
            try:
                if new.lora_request is not None and self.lora_slots is None:
                    raise ValueError("LoRA adapters are not enabled on this worker")
                batch.add_request(new)
                spec = new.sampling_params.structured_output
                if spec is not None and self.samples:
                    self.structured_output.add_request(new.req_id, spec, new.output_token_ids)
            except (ValueError, TypeError) as exc:
                batch.remove_request(new.req_id)
                errors[new.req_id] = f"invalid request: {exc}"
                logger.warning("request %s rejected: %s", new.req_id, exc)
        cached = scheduler_output.scheduled_cached_reqs
        group_ids = cached.new_group_block_ids or [[]] * len(cached.req_ids)
        for req_id, new_block_ids, num_computed, new_group_ids in zip(
            cached.req_ids,
            cached.new_block_ids,
            cached.num_computed_tokens,
            group_ids,
            strict=True,
        ):
            if req_id not in batch:
                errors[req_id] = "unknown request (never sent as new, or already dropped)"
                logger.warning("request %s: deltas for a request the worker does not hold", req_id)
                continue
            try:
                batch.update_request(req_id, new_block_ids, num_computed, new_group_ids)
            except ValueError as exc:
                errors[req_id] = f"invalid step for request: {exc}"
                logger.warning("request %s: %s", req_id, exc)
                batch.remove_request(req_id)
        return errors

    def _scheduled_requests(
        self, scheduler_output: SchedulerOutput, errors: dict[str, str]
    ) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray | None]:
        """(req_ids, rows, num_scheduled, num_drafts) of the requests that can run this
        step; num_drafts is None when the step has no drafts (which are written
        into the batch here)."""
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
        num_drafts, draft_errors = self._write_drafts(
            scheduler_output.scheduled_spec_decode_tokens, req_ids, rows
        )
        reasons = check_schedulable(batch, rows, num_scheduled, num_drafts)
        for i, message in draft_errors.items():
            reasons[i] = reasons[i] or message
        if any(reasons):
            keep = np.array([not reason for reason in reasons], dtype=bool)
            for req_id, reason in zip(req_ids, reasons, strict=True):
                if reason:
                    errors[req_id] = f"invalid step for request: {reason}"
                    logger.warning("request %s: %s", req_id, reason)
                    batch.remove_request(req_id)
            req_ids = [r for r, ok in zip(req_ids, keep, strict=True) if ok]
            rows, num_scheduled = rows[keep], num_scheduled[keep]
            if num_drafts is not None:
                num_drafts = num_drafts[keep]
        return req_ids, rows, num_scheduled, num_drafts

    def _write_drafts(
        self, drafts: dict[str, list[int]], req_ids: list[str], rows: np.ndarray
    ) -> tuple[np.ndarray | None, dict[int, str]]:
        """Place each request's drafts after its known tokens: (drafts per request,
        or None without any; why a request's drafts are invalid, by index)."""
        if not drafts:
            return None, {}
        num_drafts = np.zeros(len(req_ids), dtype=np.int64)
        errors: dict[int, str] = {}
        for i, req_id in enumerate(req_ids):
            request_drafts = drafts.get(req_id)
            if not request_drafts:
                continue
            try:
                self.input_batch.write_draft_tokens(int(rows[i]), request_drafts)
            except ValueError as exc:
                errors[i] = f"invalid drafts: {exc}"
                continue
            num_drafts[i] = len(request_drafts)
        return num_drafts, errors

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One whole step (both halves)."""
        step = self.begin_step(scheduler_output)
        return self.finish_step(step)

    @torch.inference_mode()
    def begin_step(self, scheduler_output: SchedulerOutput) -> StepInFlight:
        """The first half of a step: deltas, inputs, and (pipeline parallel) this
        stage's layers, whose output is on its way to the next stage on return."""
        connector = self.kv_connector
        if connector is not None:
            # Before the forward: blocks to save are copied out before this step
            # may overwrite them, and arrived loads are in place before it reads them.
            connector.start_step(scheduler_output)
        step = StepInFlight(
            ModelRunnerOutput.make_empty(scheduler_output.step_id), time.perf_counter()
        )
        output = step.output
        output.errors = self._apply_scheduler_deltas(scheduler_output)
        req_ids, rows, num_scheduled, num_drafts = self._scheduled_requests(
            scheduler_output, output.errors
        )
        lora = None
        if self.lora_slots is not None and req_ids:
            req_ids, rows, num_scheduled, num_drafts, lora = self._group_by_adapter(
                req_ids, rows, num_scheduled, num_drafts, output.errors
            )
        if not req_ids:
            return step
        inputs = prepare_step_inputs(
            self.input_batch,
            rows,
            num_scheduled,
            self.backend,
            self.device,
            num_drafts,
            self.layer_groups,
        )
        step.req_ids, step.inputs, step.lora = req_ids, inputs, lora
        step.prompt_spans = plan_prompt_logprobs(self.input_batch, req_ids, rows, num_scheduled)
        step.prepared = time.perf_counter()
        for req_id in req_ids:
            self._busy[req_id] = step
        if self.layout.pp_size > 1:
            self._run_stage(step)
        return step

    @torch.inference_mode()
    def finish_step(self, step: StepInFlight) -> ModelRunnerOutput:
        """The second half: final hidden states, logits, sampling (the driver).

        The driver's step completes here; another rank's completes when it
        gets the driver's tokens (``apply_sampled``).
        """
        if step.inputs is not None:
            self._finish_forward(step)
        if self.samples:
            self._complete(step)
        connector = self.kv_connector
        if connector is not None:
            step.output.kv_connector_output = connector.get_finished()
        return step.output

    def apply_sampled(self, step: StepInFlight, tokens: np.ndarray) -> None:
        """A rank other than the driver: append the driver's tokens for a finished
        step (-1: the row failed there; the scheduler drops the request next) and
        complete it. A step with drafts sends each row's count and tokens
        (``_verified_message``)."""
        if step.inputs is not None and step.inputs.num_logits is not None:
            self._apply_verified(step, tokens)
            self._complete(step)
            return
        sample_rows = step.sample_rows
        if len(tokens) != len(sample_rows):
            raise RuntimeError(
                f"step {step.output.step_id}: {len(tokens)} sampled tokens for "
                f"{len(sample_rows)} sampling rows (the ranks are out of step)"
            )
        if len(tokens):
            self.input_batch.append_sampled_tokens(sample_rows, tokens)
        self._complete(step)

    def _apply_verified(self, step: StepInFlight, message: np.ndarray) -> None:
        """The driver's verified tokens of a step with drafts: per sampling row its
        count (-1: failed there, nothing appended) and that many tokens."""
        at = 0
        try:
            for row in step.sample_rows.tolist():
                count = int(message[at])
                at += 1
                if count >= 0:
                    self.input_batch.append_verified_tokens(row, message[at : at + count].tolist())
                    at += count
        except IndexError:
            at = -1
        if at != len(message):
            raise RuntimeError(
                f"step {step.output.step_id}: verified tokens do not match "
                f"{len(step.sample_rows)} sampling rows (the ranks are out of step)"
            )

    @staticmethod
    def _verified_message(tokens: list[list[int]], failed: dict[int, str]) -> np.ndarray:
        """What the other ranks append after a step with drafts: for each sampling
        row its number of tokens (accepted drafts + 1; -1 if it failed) and them."""
        parts: list[int] = []
        for position, row_tokens in enumerate(tokens):
            if position in failed:
                parts.append(-1)
                continue
            parts.append(len(row_tokens))
            parts.extend(row_tokens)
        return np.asarray(parts, dtype=np.int64)

    def _complete(self, step: StepInFlight) -> None:
        """The step is done with its rows: release them, and drop those the
        scheduler dropped meanwhile."""
        for _, work in step.sends:
            work.wait()
        step.sends.clear()
        busy = self._busy
        for req_id in step.req_ids:
            if busy.get(req_id) is step:
                del busy[req_id]
        for req_id in step.removals:
            self._remove(req_id)

    def _finish_forward(self, step: StepInFlight) -> None:
        """Logits and sampling of a begun step into its output (failures per step
        in a single process, fatal in a replica)."""
        output, req_ids, inputs = step.output, step.req_ids, step.inputs
        assert inputs is not None
        try:
            if inputs.num_logits is None:
                tokens, logprobs, output.prompt_logprobs, failed_rows = self._forward_and_sample(
                    step
                )
            else:
                tokens, logprobs, output.prompt_logprobs, failed_rows = self._forward_and_verify(
                    step
                )
        except Exception as exc:
            if self.layout.is_parallel:
                # The other ranks may be waiting in a collective this rank never
                # reaches: the replica is out of step and restarts as a whole.
                raise
            # A failure in the forward pass belongs to the whole step (the
            # sampler isolates its own per row): fail the step's requests,
            # keep the worker alive for the next one.
            logger.exception("step %s failed", output.step_id)
            for req_id in req_ids:
                output.errors[req_id] = f"worker step failed: {exc}"
                self.input_batch.remove_request(req_id)
            return
        if not self.samples:
            return  # the driver answers the scheduler
        output.req_ids = req_ids
        output.sampled_token_ids = [[] for _ in req_ids]
        output.logprobs = [[] for _ in req_ids]
        for position, index in enumerate(np.flatnonzero(inputs.sample_mask)):
            if position in failed_rows:
                self._fail_request(req_ids[index], failed_rows[position], output)
                continue
            output.sampled_token_ids[index] = tokens[position]
            output.logprobs[index] = logprobs[position]
        output.errors.update(self.structured_output.pop_errors())
        self.timings.prepare += step.prepared - step.started
        self.timings.num_steps += 1

    def _fail_request(self, req_id: str, message: str, output: ModelRunnerOutput) -> None:
        output.errors[req_id] = message
        self.input_batch.remove_request(req_id)
        self.structured_output.remove_request(req_id)

    def _group_by_adapter(
        self,
        req_ids: list[str],
        rows: np.ndarray,
        num_scheduled: np.ndarray,
        num_drafts: np.ndarray | None,
        errors: dict[str, str],
    ) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray | None, LoRABatch | None]:
        """Slot the step's adapters and order its requests by slot.

        A request whose adapter cannot be loaded fails alone. Returns the
        requests that run, in their new order, and the step's adapter layout
        (None when every request runs the base model).
        """
        assert self.lora_slots is not None
        loras = [self.input_batch.lora_requests[row] for row in rows]
        wanted = {lora.lora_id: lora for lora in loras if lora is not None}
        if not wanted:
            return req_ids, rows, num_scheduled, num_drafts, None
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
        if num_drafts is not None:
            num_drafts = num_drafts[keep][order]
        lora = plan_lora_batch(slots, num_scheduled, self.device)
        return req_ids, rows, num_scheduled, num_drafts, lora

    def _forward_and_sample(
        self, step: StepInFlight
    ) -> tuple[list[list[int]], list[list[Logprobs]], list[PromptLogprobs], dict[int, str]]:
        """Per sampling request (in step order): its token and their logprobs; plus
        prompt logprobs and failed sampling requests by position. The tokens are
        appended to the batch (on the driver; the other ranks get them later)."""
        logits, prompt_logprobs = self._forward(step)
        if not self.samples or logits is None:
            return [], [], prompt_logprobs, {}
        sample_rows = step.sample_rows
        result = self._sample(logits, sample_rows)
        token_array = result.token_ids.cpu().numpy()
        self.input_batch.append_sampled_tokens(sample_rows, token_array)
        if self.layout.is_parallel:
            # What the other ranks append: -1 where the row failed.
            sampled = token_array.astype(np.int64, copy=True)
            sampled[list(result.failed_rows)] = -1
            step.sampled = sampled
        tokens = [[token] for token in token_array.tolist()]
        logprobs = [[] if lp is None else [lp] for lp in result.logprobs]
        return tokens, logprobs, prompt_logprobs, result.failed_rows

    def _forward_and_verify(
        self, step: StepInFlight
    ) -> tuple[list[list[int]], list[list[Logprobs]], list[PromptLogprobs], dict[int, str]]:
        """``_forward_and_sample`` for a step with drafts: requests without drafts
        sample as usual; those with drafts keep their accepted drafts plus one token."""
        logits, prompt_logprobs = self._forward(step)
        inputs = step.inputs
        assert inputs is not None
        num_logits = inputs.num_logits
        if not self.samples or logits is None or num_logits is None:
            # Other ranks append the driver's verified tokens (apply_sampled).
            return [], [], prompt_logprobs, {}
        batch = self.input_batch
        sample_rows = inputs.rows[inputs.sample_mask]
        tokens: list[list[int]] = [[] for _ in sample_rows]
        logprobs: list[list[Logprobs]] = [[] for _ in sample_rows]
        failed: dict[int, str] = {}
        starts = np.cumsum(num_logits) - num_logits
        plain = np.flatnonzero(num_logits == 1)
        if plain.size:
            self._collect_plain_samples(
                logits[torch.from_numpy(starts[plain])],
                sample_rows,
                plain,
                tokens,
                logprobs,
                failed,
            )
        drafted = np.flatnonzero(num_logits > 1)
        if drafted.size:
            sample_started = time.perf_counter()
            logits_rows = np.concatenate(
                [np.arange(starts[i], starts[i] + num_logits[i]) for i in drafted]
            )
            verified = verify_drafts(
                logits[torch.from_numpy(logits_rows)],
                batch,
                sample_rows[drafted],
                num_logits[drafted],
                self.model_config.eos_token_ids,
            )
            for j, position in enumerate(drafted.tolist()):
                if j in verified.failed:
                    failed[position] = verified.failed[j]
                    continue
                tokens[position], logprobs[position] = verified.token_ids[j], verified.logprobs[j]
                batch.append_verified_tokens(int(sample_rows[position]), tokens[position])
            self.timings.sample += time.perf_counter() - sample_started
        if self.layout.is_parallel:
            step.sampled = self._verified_message(tokens, failed)
        return tokens, logprobs, prompt_logprobs, failed

    def _collect_plain_samples(
        self,
        logits: torch.Tensor,
        sample_rows: np.ndarray,
        positions: np.ndarray,
        tokens: list[list[int]],
        logprobs: list[list[Logprobs]],
        failed: dict[int, str],
    ) -> None:
        """Sample the requests at ``positions`` (no drafts) into the per-position lists."""
        rows = sample_rows[positions]
        result = self._sample(logits, rows)
        token_array = result.token_ids.cpu().numpy()
        self.input_batch.append_sampled_tokens(rows, token_array)
        for j, (position, token) in enumerate(
            zip(positions.tolist(), token_array.tolist(), strict=True)
        ):
            if j in result.failed_rows:
                failed[position] = result.failed_rows[j]
                continue
            tokens[position] = [token]
            if (lp := result.logprobs[j]) is not None:
                logprobs[position] = [lp]

    def _forward(self, step: StepInFlight) -> tuple[torch.Tensor | None, list[PromptLogprobs]]:
        """The rest of the forward pass: logits at ``inputs.logits_indices`` (None if
        there are none) and the prompt logprobs."""
        inputs, prompt_spans = step.inputs, step.prompt_spans
        assert inputs is not None
        forward_started = time.perf_counter()
        # Only the sampled rows' hidden states, when nothing else reads the
        # others: no prompt logprobs, no adapters (their per-token layout
        # covers every row), one process for the whole model.
        only_sampled = (
            not prompt_spans
            and step.lora is None
            and not self.layout.is_parallel
            and inputs.logits_indices.shape[0] < inputs.input_ids.shape[0]
        )
        hidden = self._final_hidden(step, inputs.logits_indices if only_sampled else None)
        if hidden is None:  # a later pipeline stage: the first stage computes logits
            self.timings.forward += time.perf_counter() - forward_started
            return None, []
        prompt_logprobs = (
            compute_prompt_logprobs(self.model.compute_logits, hidden, prompt_spans)
            if prompt_spans
            else []
        )
        sampled_hidden = hidden if only_sampled else hidden[inputs.logits_indices]
        logits = (
            self.model.compute_logits(sampled_hidden) if inputs.logits_indices.shape[0] else None
        )
        self.timings.forward += time.perf_counter() - forward_started
        return logits, prompt_logprobs

    def _sample(self, logits: torch.Tensor, sample_rows: np.ndarray) -> SamplerOutput:
        """One token per row of ``logits`` (batch rows ``sample_rows``), grammars applied."""
        sample_started = time.perf_counter()
        batch = self.input_batch

        def gather() -> tuple[RequestColumns, dict[int, torch.Generator]]:
            params = [batch.sampling_params[row] for row in sample_rows]
            columns = gather_request_columns(
                params,  # type: ignore[arg-type]
                self.model_config.eos_token_ids,
                self.vocab_size,
                self.device,
            )
            generators = {
                i: batch.generators[row]
                for i, row in enumerate(sample_rows)
                if row in batch.generators
            }
            return columns, generators

        # A decode step with the previous step's rows reuses their columns.
        columns, generators = self.sampling_columns.get(
            (batch.composition, sample_rows.tobytes()), gather
        )
        metadata = step_sampling_metadata(
            columns,
            batch.token_ids[sample_rows],
            batch.num_prompt_tokens[sample_rows],
            batch.num_tokens[sample_rows],
            generators,
            self.vocab_size,
            self.device,
        )
        step_grammar = self.structured_output.constrain(sample_rows, batch.row_of)
        if step_grammar is not None and step_grammar.bitmask is not None:
            metadata.grammar_bitmask = step_grammar.bitmask
            metadata.grammar_rows = step_grammar.positions
        result = self.sampler(logits, metadata)
        if step_grammar is not None:
            step_grammar.accept(result.token_ids.tolist())
        self.timings.sample += time.perf_counter() - sample_started
        return result

    def _final_hidden(
        self, step: StepInFlight, output_rows: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """The final hidden states on the first pipeline stage, None on the others:
        the whole model in one process, else what the last stage sent back.
        ``output_rows`` (one process only): just those rows' states."""
        inputs = step.inputs
        assert inputs is not None
        if self.layout.pp_size == 1:
            return self.model(
                inputs.input_ids,
                inputs.positions,
                self.kv_caches,
                inputs.attention_metadata,
                self.backend,
                lora=step.lora,
                output_rows=output_rows,
            )
        return step.final_hidden.wait() if step.final_hidden is not None else None

    def _run_stage(self, step: StepInFlight) -> None:
        """This pipeline stage's layers of a begun step.

        Stages pass activations around a ring: stage 0 embeds and runs its
        layers, each next stage continues, and the last hands its output back
        to stage 0, which holds the final norm and LM head. Sends do not wait
        for their receiver (it may still be busy with an earlier step); stage 0
        posts the receive of the last stage's output now and collects it when
        the step finishes.
        """
        collectives = self.collectives
        assert collectives is not None and step.inputs is not None
        inputs = step.inputs
        shape = (inputs.input_ids.shape[0], self.model_config.hidden_size)
        dtype = self.model_config.dtype
        first = self.plan.is_first_stage
        started = time.perf_counter()
        hidden = None if first else collectives.recv_hidden(shape, dtype)
        hidden = self.model(
            inputs.input_ids,
            inputs.positions,
            self.kv_caches,
            inputs.attention_metadata,
            self.backend,
            hidden=hidden,
            lora=step.lora,
        )
        step.sends.append(collectives.isend_hidden(hidden))
        if first:
            step.final_hidden = collectives.irecv_hidden(shape, dtype)
        self.timings.forward += time.perf_counter() - started
