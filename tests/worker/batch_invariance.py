"""A harness for batch invariance: one request's logits, step by step, in many settings.

``Scenario``s run one target request through a :class:`LocalDriver` on a given
runner: alone, inside batches of other requests (before and after it in the
batch), with its prompt chunked at a token budget, after a prefix-cache hit
(its first blocks filled by an earlier request with the same prompt), after a
load from the kvstore (those blocks saved through the worker's KV connector,
wiped, and loaded into other blocks, as a second worker would), and after a
preemption (dropped after some tokens and recomputed from its prompt
plus what it had generated, as the scheduler resumes a preempted request).
``LogitsRecorder`` keeps every logits row the runner samples from, keyed by
request and sequence length, so two runs compare position by position, bit
for bit.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.services.contracts.step import KVTransfer
from kvmesh.worker.kv_connector import KVConnectorWorker
from kvmesh.worker.local_driver import LocalDriver
from kvmesh.worker.model_runner import ModelRunner

from .kv_connector_helpers import (
    InMemoryKVBlockStore,
    block_hashes,
    connector_step,
    drain,
    loop_thread,
    settle,
)

TARGET = "target"
# Positions are sequence lengths when the logits were taken: the logits that
# choose token number `length` (0-based) of the sequence.
Logits = dict[int, torch.Tensor]


class LogitsRecorder:
    """Wraps ``runner._sample`` to keep each sampled row's logits (a copy)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.logits: dict[str, Logits] = {}
        self.tokens: dict[str, dict[int, int]] = {}

    @contextlib.contextmanager
    def recording(self) -> Iterator[LogitsRecorder]:
        original = self.runner._sample

        def sample(logits: torch.Tensor, sample_rows: np.ndarray):  # type: ignore[no-untyped-def]
            batch = self.runner.input_batch
            req_of = {row: req_id for req_id, row in batch.row_of.items()}
            lengths = [int(batch.num_tokens[row]) for row in sample_rows]
            result = original(logits, sample_rows)
            tokens = result.token_ids.tolist()
            for i, row in enumerate(sample_rows.tolist()):
                req_id = req_of[row]
                self.logits.setdefault(req_id, {})[lengths[i]] = logits[i].clone()
                self.tokens.setdefault(req_id, {})[lengths[i]] = tokens[i]
            return result

        self.runner._sample = sample  # type: ignore[method-assign]
        try:
            yield self
        finally:
            del self.runner._sample  # back to the class's method


@dataclass(frozen=True)
class Scenario:
    """One way to run the target request: ``others`` prompts run beside it
    (``before`` of them ahead of it in the batch), its prompt chunked at
    ``chunk_size`` tokens per step, ``prefix_blocks`` of it already in the cache,
    ``kvstore_blocks`` of it loaded from the kvstore, or preempted after
    ``preempt_after`` generated tokens."""

    name: str
    others: int = 0
    before: int = 0
    chunk_size: int | None = None
    prefix_blocks: int = 0
    kvstore_blocks: int = 0
    preempt_after: int = 0
    threads: int | None = None


@dataclass
class Workload:
    target_prompt: list[int]
    max_new_tokens: int
    params: SamplingParams
    seed: int = 0
    other_prompts: list[list[int]] = field(default_factory=list)

    def others(self, count: int) -> list[list[int]]:
        rng = random.Random(self.seed + count)
        while len(self.other_prompts) < count:
            length = rng.randint(3, 90)
            self.other_prompts.append([rng.randrange(100, 40_000) for _ in range(length)])
        return self.other_prompts[:count]


def run_scenario(runner: ModelRunner, workload: Workload, scenario: Scenario) -> Logits:
    """The target's logits by sequence length, as this scenario computed them."""
    return record_scenario(runner, workload, scenario).logits[TARGET]


def record_scenario(runner: ModelRunner, workload: Workload, scenario: Scenario) -> LogitsRecorder:
    """Every sampled row's logits and token in this scenario (the target's under ``TARGET``)."""
    runner.reset()
    recorder = LogitsRecorder(runner)
    previous_threads = torch.get_num_threads()
    if scenario.threads is not None:
        torch.set_num_threads(scenario.threads)
    try:
        with recorder.recording():
            _drive(runner, workload, scenario)
    finally:
        torch.set_num_threads(previous_threads)
    return recorder


def _drive(runner: ModelRunner, workload: Workload, scenario: Scenario) -> None:
    prompt, params, budget = workload.target_prompt, workload.params, workload.max_new_tokens
    driver = LocalDriver(runner, chunk_size=scenario.chunk_size, free_on_finish=False)
    prefix: list[int] = []
    computed = 0
    if scenario.prefix_blocks:
        # An earlier request with the same prompt leaves its blocks behind.
        driver.add_request("donor", prompt, params, 1)
        driver.run()
        prefix = driver.finished["donor"].block_ids[: scenario.prefix_blocks]
        computed = len(prefix) * driver.block_size
        assert computed < len(prompt), "the prefix must leave a prompt token to compute"
    if scenario.kvstore_blocks:
        prefix = _load_from_kvstore(runner, driver, prompt, params, scenario.kvstore_blocks)
        computed = len(prefix) * driver.block_size
        assert computed < len(prompt), "the prefix must leave a prompt token to compute"
    others = workload.others(scenario.others)
    for index, other in enumerate(others[: scenario.before]):
        driver.add_request(f"other-{index}", other, params, 3 + index % 7)
    driver.add_request(TARGET, prompt, params, budget, prefix, computed)
    for index, other in enumerate(others[scenario.before :], start=scenario.before):
        driver.add_request(f"other-{index}", other, params, 3 + index % 7)
    if scenario.preempt_after:
        _step_until(driver, lambda: _generated(driver) >= scenario.preempt_after)
        _preempt(driver, TARGET)
    driver.run()


def _load_from_kvstore(
    runner: ModelRunner,
    driver: LocalDriver,
    prompt: list[int],
    params: SamplingParams,
    num_blocks: int,
) -> list[int]:
    """The prompt's first ``num_blocks`` blocks as a kvstore load leaves them:
    computed by an earlier request, saved through the KV connector, their
    blocks wiped (NaN: a stale read would show), then loaded into other
    blocks. Returns the loaded block ids."""
    driver.add_request("donor", prompt, params, 1)
    driver.run()
    donor_blocks = driver.finished["donor"].block_ids[:num_blocks]
    hashes = block_hashes("batch-invariance-prefix", num_blocks)
    with loop_thread() as loop:
        connector = KVConnectorWorker(runner.kv_caches, InMemoryKVBlockStore(), loop)
        saved = settle(
            connector, connector_step(connector, saves=[KVTransfer("donor", donor_blocks, hashes)])
        )
        assert len(saved.saved_block_hashes) == num_blocks, saved
        for layer in runner.kv_caches:
            for cache in layer:
                cache[donor_blocks] = float("nan")
        loaded = [driver.free_blocks.popleft() for _ in range(num_blocks)]
        connector_step(connector, loads=[KVTransfer(TARGET, loaded, hashes)])
        drain(connector)
        applied = connector_step(connector)
        assert applied.finished_loads == {TARGET: num_blocks}, applied
    return loaded


def _generated(driver: LocalDriver) -> int:
    request = driver.requests.get(TARGET) or driver.finished[TARGET]
    return len(request.output_token_ids)


def _step_until(driver: LocalDriver, done: Callable[[], bool]) -> None:
    while not done():
        driver.step()


def _preempt(driver: LocalDriver, req_id: str) -> None:
    """Drop the request's KV and resend it from scratch with what it generated
    (recompute preemption), as the scheduler resumes a preempted request."""
    request = driver.requests.pop(req_id)
    driver._to_drop.add(req_id)
    driver.free_blocks.extend(request.owned_block_ids)
    driver.step()  # the worker drops the row (the step runs the others, if any)
    resumed = driver.add_request(
        req_id, request.prompt_token_ids, request.sampling_params, request.max_new_tokens
    )
    resumed.output_token_ids = list(request.output_token_ids)


def differences(reference: Logits, other: Logits) -> tuple[int, int, float]:
    """(positions compared, positions whose logits differ in any bit, max |diff|)."""
    common = sorted(set(reference) & set(other))
    differ = 0
    worst = 0.0
    for length in common:
        a, b = reference[length], other[length]
        if not torch.equal(a, b):
            differ += 1
            worst = max(worst, float((a.double() - b.double()).abs().max()))
    return len(common), differ, worst


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("batch of 2", others=1),
    Scenario("batch of 4, middle", others=3, before=1),
    Scenario("batch of 16, last", others=15, before=15),
    Scenario("batch of 65", others=64, before=20),
    Scenario("chunked by 1", chunk_size=1),
    Scenario("chunked by 7", chunk_size=7),
    Scenario("chunked by 16", chunk_size=16),
    Scenario("chunked by 40", chunk_size=40),
    Scenario("chunked by 16, batch of 8", chunk_size=16, others=7, before=3),
    Scenario("prefix hit, 1 block", prefix_blocks=1),
    Scenario("prefix hit, 3 blocks", prefix_blocks=3),
    Scenario("kvstore load, 2 blocks", kvstore_blocks=2),
    Scenario("preempted after 3 tokens", preempt_after=3),
    Scenario("preempted after 3, batch of 6", preempt_after=3, others=5, before=2),
    Scenario("2 threads", threads=2),
)
