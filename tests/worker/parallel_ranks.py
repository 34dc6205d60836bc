"""Run one replica's ranks as spawned processes on CPU (gloo), for the parallel tests.

Rank 0 drives a LocalDriver through a StepBroadcaster, exactly the path the
worker service takes; the other ranks follow. Rank 0 puts each request's
output tokens and logprobs on a queue. With ``micro_batches`` the real
scheduler drives instead, keeping that many micro-batches begun at once
(pipeline overlap), and rank 0 also records the order in which its steps
began and finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from kvmesh.engine import InProcessEngine
from kvmesh.services.contracts.kv_cache_groups import group_layers
from kvmesh.services.contracts.lora_request import LoRARequest
from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.services.contracts.step import ModelRunnerOutput, SchedulerOutput
from kvmesh.services.runtime.config import SpeculativeConfig
from kvmesh.worker.config import CacheConfig, ModelConfig
from kvmesh.worker.local_driver import LocalDriver
from kvmesh.worker.model_runner import ModelRunner
from kvmesh.worker.parallel.collectives import Collectives
from kvmesh.worker.parallel.driver import lead_or_follow
from kvmesh.worker.parallel.layout import RankLayout
from kvmesh.worker.parallel.local_replica import run_local_replica
from kvmesh.worker.step_in_flight import StepInFlight
from tests.lora_adapters import lora_request

MAX_NEW_TOKENS = 6
TOP_LOGPROBS = 5


class RequestResult(NamedTuple):
    """One request's greedy tokens, per sampled token its (token, logprob) top
    list, and the error it failed with (then no tokens)."""

    tokens: list[int]
    logprobs: list[list[tuple[int, float]]]
    error: str | None = None


Result = dict[str, RequestResult]


@dataclass(frozen=True)
class RunSpec:
    checkpoint: str
    prompts: list[list[int]]
    chunk_size: int | None = None
    dense: bool = False  # plain F.linear instead of oneDNN / block codes
    # > 0: the scheduler's micro-batches, that many steps begun at once.
    micro_batches: int = 0
    # --speculative-config's fields: the real scheduler proposes drafts and the
    # driver verifies them (synchronous steps).
    speculative: dict[str, Any] | None = None
    max_new_tokens: int = MAX_NEW_TOKENS
    # Per prompt, the folder of the PEFT adapter it runs with (None: the base
    # model); ``max_loras`` adapter slots on every rank.
    loras: tuple[str | None, ...] = ()
    max_loras: int = 0
    # (rank, adapter folder): that rank cannot read that adapter, as if its
    # machine lacked the path (the others can).
    lora_unreadable: tuple[tuple[int, str], ...] = ()
    # Per layer, the window its KV-cache group is formed by (None: the model's
    # own grouping); the real scheduler then drives every rank's groups.
    kv_cache_windows: tuple[int | None, ...] | None = None


@dataclass
class EventLog:
    """A runner whose begun and finished steps are recorded, in order."""

    runner: Any
    events: list[tuple[str, int]] = field(default_factory=list)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def begin_step(self, step: SchedulerOutput) -> StepInFlight:
        begun = self.runner.begin_step(step)
        self.events.append(("begun", step.step_id))
        return begun

    def finish_step(self, step: StepInFlight) -> ModelRunnerOutput:
        output = self.runner.finish_step(step)
        self.events.append(("finished", output.step_id))
        return output


def drive_scheduler(runner, spec: RunSpec) -> tuple[dict[str, list[int]], list[tuple[str, int]]]:
    """Greedy tokens per request through the real scheduler (with micro-batches or
    speculative decoding), and the driver's begin/finish events, or with
    speculation the accepted draft count."""
    log = EventLog(runner)
    engine = InProcessEngine(
        log,
        max_num_seqs=16,
        num_micro_batches=max(1, spec.micro_batches),
        speculative=None if spec.speculative is None else SpeculativeConfig(**spec.speculative),
    )
    params = SamplingParams(temperature=0.0, max_tokens=spec.max_new_tokens, ignore_eos=True)
    loras = [None if folder is None else _adapter_request(folder) for folder in spec.loras]
    results = engine.generate(spec.prompts, params, len(spec.prompts), lora_requests=loras)
    tokens = {f"r{i}": result.output_token_ids for i, result in enumerate(results)}
    if spec.speculative is not None:
        stats = engine.scheduler.make_stats().spec_decoding
        return tokens, [("accepted", stats.num_accepted_tokens if stats else 0)]
    return tokens, log.events


def build_runner(spec: RunSpec, collectives: Collectives | None) -> ModelRunner:
    runner = ModelRunner(
        ModelConfig.from_pretrained(spec.checkpoint, max_model_len=128),
        CacheConfig(block_size=16, num_kv_blocks=64),
        num_threads=1,
        collectives=collectives,
        max_loras=spec.max_loras,
        max_lora_rank=8,
        kv_cache_groups=(
            None if spec.kv_cache_windows is None else group_layers(spec.kv_cache_windows)
        ),
    )
    if spec.dense:
        runner.model.pack_weights(use_onednn=False, use_native=False)
    return runner


def _adapter_request(folder: str) -> LoRARequest:
    path = Path(folder)
    if not path.exists():  # an adapter no rank can read: any id will do
        return LoRARequest(path.name, "0" * 64, folder)
    return lora_request(path.name, path)


def _make_unreadable(runner: ModelRunner, folders: list[str]) -> None:
    """This rank fails to load the adapters in ``folders`` (the others load them)."""
    slots = runner.lora_slots
    assert slots is not None
    load = slots._load

    def failing_load(lora: LoRARequest):  # type: ignore[no-untyped-def]
        if lora.lora_path in folders:
            raise OSError(f"{lora.lora_path} is not on this machine")
        return load(lora)

    slots._load = failing_load


def drive(runner, spec: RunSpec) -> Result:
    driver = LocalDriver(runner, chunk_size=spec.chunk_size)
    params = SamplingParams(temperature=0.0, logprobs=TOP_LOGPROBS)
    for index, prompt in enumerate(spec.prompts):
        folder = spec.loras[index] if index < len(spec.loras) else None
        lora = None if folder is None else _adapter_request(folder)
        driver.add_request(
            f"r{index}", prompt, params, max_new_tokens=MAX_NEW_TOKENS, lora_request=lora
        )
    finished = driver.run()
    return {
        req_id: RequestResult(
            request.output_token_ids,
            [
                [(lp.token_id, lp.logprob), *zip(lp.top_token_ids, lp.top_logprobs, strict=True)]
                for lp in request.logprobs
            ],
            request.error,
        )
        for req_id, request in finished.items()
    }


def _rank_main(layout: RankLayout, address: str, spec: RunSpec, results) -> None:
    collectives = Collectives(layout, address, timeout_s=60, device=torch.device("cpu"))
    try:
        lead = _lead(spec)
        runner = build_runner(spec, collectives)
        unreadable = [folder for rank, folder in spec.lora_unreadable if rank == layout.rank]
        if unreadable:
            _make_unreadable(runner, unreadable)
        result = lead_or_follow(runner, collectives, lambda runner: lead(runner, spec))
        if layout.is_driver:
            results.put(result)
    finally:
        collectives.close()


def run_replica(tp_size: int, pp_size: int, spec: RunSpec, timeout_s: float = 240) -> Any:
    """Greedy results of a TP x PP replica of spawned ranks (``drive``'s, or
    ``drive_scheduler``'s with micro-batches)."""
    return run_local_replica(_rank_main, tp_size, pp_size, (spec,), timeout_s)


def _lead(spec: RunSpec) -> Any:
    """The real scheduler where the step needs it (micro-batches, drafts, KV-cache
    groups), else the plain driver."""
    needs_scheduler = spec.micro_batches or spec.speculative or spec.kv_cache_windows
    return drive_scheduler if needs_scheduler else drive


def run_single(spec: RunSpec) -> Any:
    return _lead(spec)(build_runner(spec, None), spec)
