"""Asynchronous scheduling: step n+1 is scheduled before step n's output is back.

A simulated worker keeps a persistent batch, a KV cache of slots (each slot
records the token prefix whose KV it holds) and samples a token that is a pure
function of the sequence it attends to, like greedy decoding. Every step it
checks that each position it reads holds the KV of exactly that prefix, so a
block freed and reused while a step was in flight, or a prefix-cache hit on
unwritten KV, fails the test. The same workloads must give the same tokens with
and without async scheduling.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

import pytest

from kvmesh.scheduler.output import RequestOutput
from kvmesh.scheduler.request import Request
from kvmesh.scheduler.scheduler import Scheduler
from kvmesh.services.contracts.finish_reason import FinishReason
from kvmesh.services.contracts.step import ModelRunnerOutput, SchedulerOutput
from tests.scheduler.factories import make_request, make_scheduler, random_workload

EOS = 2
BLOCK_SIZE = 4


def greedy_token(sequence: tuple[int, ...]) -> int:
    """The 'model': a deterministic token from the whole sequence, EOS now and then."""
    value = hash(sequence) % 97
    return EOS if value < 3 else 10 + value


@dataclass
class SimulatedWorker:
    """Applies SchedulerOutputs in order, like worker/model_runner.py, with a checked KV cache."""

    block_size: int = BLOCK_SIZE
    tokens: dict[str, list[int]] = field(default_factory=dict)
    num_computed: dict[str, int] = field(default_factory=dict)
    block_tables: dict[str, list[int]] = field(default_factory=dict)
    # slot -> the token prefix (ending at that slot's position) whose KV it holds
    kv: dict[int, tuple[int, ...]] = field(default_factory=dict)
    num_steps: int = 0

    def _slot(self, req_id: str, position: int) -> int:
        block = self.block_tables[req_id][position // self.block_size]
        return block * self.block_size + position % self.block_size

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if out.total_num_scheduled_tokens:
            self.num_steps += 1
        for req_id in out.finished_req_ids:
            self.tokens.pop(req_id, None)
            self.num_computed.pop(req_id, None)
            self.block_tables.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.tokens, f"{new.req_id} sent in full twice"
            self.tokens[new.req_id] = [*new.prompt_token_ids, *new.output_token_ids]
            self.num_computed[new.req_id] = new.num_computed_tokens
            self.block_tables[new.req_id] = list(new.block_ids)
        cached = out.scheduled_cached_reqs
        for req_id, new_blocks, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            assert req_id in self.tokens, f"deltas for {req_id}, which the worker does not hold"
            assert num_computed == self.num_computed[req_id]
            self.block_tables[req_id].extend(new_blocks)
        written: set[int] = set()
        req_ids, sampled = [], []
        for req_id, num_scheduled in out.num_scheduled_tokens.items():
            sequence = self.tokens[req_id]
            start, end = self.num_computed[req_id], self.num_computed[req_id] + num_scheduled
            assert end <= len(sequence), f"{req_id}: scheduled past the tokens the worker knows"
            assert end <= len(self.block_tables[req_id]) * self.block_size
            for position in range(start, end):
                slot = self._slot(req_id, position)
                assert slot not in written, "two requests write one slot in one step"
                written.add(slot)
                self.kv[slot] = tuple(sequence[: position + 1])
            for position in range(end):
                # Attention reads every earlier position: each must hold its own prefix.
                assert self.kv.get(self._slot(req_id, position)) == tuple(
                    sequence[: position + 1]
                ), f"{req_id}: stale KV at position {position}"
            self.num_computed[req_id] = end
            req_ids.append(req_id)
            if end == len(sequence):
                token = greedy_token(tuple(sequence))
                sequence.append(token)
                sampled.append([token])
            else:
                sampled.append([])
        return ModelRunnerOutput(step_id=out.step_id, req_ids=req_ids, sampled_token_ids=sampled)


@dataclass
class Run:
    tokens: dict[str, list[int]]
    finish: dict[str, FinishReason | None]
    num_worker_steps: int
    aborted: set[str]


def drive(
    sched: Scheduler,
    worker: SimulatedWorker,
    arrivals: dict[int, list[Request]] | None = None,
    aborts: dict[int, list[str]] | None = None,
    max_iterations: int = 10_000,
) -> Run:
    """The service loop: synchronous, or ``steps_in_flight`` steps in flight when the
    config says so (micro-batches: each step's requests disjoint from the others')."""
    arrivals, aborts = arrivals or {}, aborts or {}
    in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
    tokens: dict[str, list[int]] = {}
    finish: dict[str, FinishReason | None] = {}
    aborted: set[str] = set()
    depth = sched.config.steps_in_flight
    micro_batches = sched.config.num_micro_batches > 1

    def collect(outputs: list[RequestOutput]) -> None:
        for output in outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finish_reason is not None:
                finish[output.request_id] = output.finish_reason

    for iteration in range(max_iterations):
        for request in arrivals.pop(iteration, []):
            sched.add_request(request)
        if iteration in aborts:
            aborted.update(sched.abort_requests(aborts.pop(iteration)))
        if not (sched.has_unfinished_requests() or in_flight or arrivals):
            break
        scheduled = False
        if sched.has_unfinished_requests():
            out = sched.schedule()
            if micro_batches:
                for earlier, _ in in_flight:
                    shared = set(earlier.num_scheduled_tokens) & set(out.num_scheduled_tokens)
                    assert not shared, f"{shared} in two micro-batches in flight"
            if out.total_num_scheduled_tokens or out.finished_req_ids:
                # The worker runs steps in order; executing at submit time is
                # the same as executing later, since nothing else reaches it.
                in_flight.append((out, worker.execute(out)))
                scheduled = True
        if in_flight and (len(in_flight) >= depth or not scheduled):
            out, result = in_flight.popleft()
            collect(sched.update_from_output(out, result))
        sched.check_integrity()
    else:
        raise AssertionError("workload did not finish")
    return Run(tokens, finish, worker.num_steps, aborted)


def _request(req_id: str, n_prompt: int, max_tokens: int, **kwargs) -> Request:
    # The prompt depends on the id only, so a sync and an async run see the same one.
    seed = sum(map(ord, req_id)) * 31
    kwargs.setdefault("prompt_token_ids", [10 + (seed + 7 * i) % 900 for i in range(n_prompt)])
    return make_request(n_prompt, max_tokens, request_id=req_id, eos_token_ids=(EOS,), **kwargs)


def test_async_step_counts_for_one_request_match_sync_exactly() -> None:
    runs = {}
    for async_scheduling in (False, True):
        sched = make_scheduler(block_size=BLOCK_SIZE, async_scheduling=async_scheduling)
        sched.add_request(_request("a", 6, max_tokens=3, ignore_eos=True))
        runs[async_scheduling] = drive(sched, SimulatedWorker())
    assert runs[True].tokens == runs[False].tokens
    assert len(runs[True].tokens["a"]) == 3
    assert runs[True].finish == {"a": FinishReason.LENGTH}
    # One prefill + two decodes: the in-flight token is the last one, so no
    # wasted fourth step is scheduled.
    assert runs[True].num_worker_steps == runs[False].num_worker_steps == 3


def test_async_schedules_the_next_decode_before_the_token_is_known() -> None:
    sched = make_scheduler(block_size=BLOCK_SIZE, async_scheduling=True)
    request = _request("a", 4, max_tokens=4, ignore_eos=True)
    sched.add_request(request)
    first = sched.schedule()
    assert first.num_scheduled_tokens == {"a": 4}
    assert (request.num_computed_tokens, request.num_output_placeholders) == (4, 1)
    second = sched.schedule()  # step 1's token is still in the worker
    assert second.num_scheduled_tokens == {"a": 1}
    assert second.scheduled_cached_reqs.num_computed_tokens == [4]
    # Position 4 starts a second block: allocated for the pending token.
    assert len(second.scheduled_cached_reqs.new_block_ids[0]) == 1
    assert (request.num_computed_tokens, request.num_output_placeholders) == (5, 2)
    worker = SimulatedWorker()
    outputs = sched.update_from_output(first, worker.execute(first))
    assert [o.new_token_ids for o in outputs] == [[worker.tokens["a"][4]]]
    assert request.num_output_placeholders == 1
    assert request.num_tokens == 5


def test_request_finishing_at_step_n_while_scheduled_in_n_plus_1_is_discarded() -> None:
    prompt = [11, 12, 13, 14, 15]
    # The 'model' picks EOS as the second output token for this prompt.
    first = greedy_token(tuple(prompt))
    sched = make_scheduler(block_size=BLOCK_SIZE, async_scheduling=True)
    request = _request("a", 5, max_tokens=10, prompt_token_ids=prompt)
    sched.add_request(request)
    worker = SimulatedWorker()
    step1 = sched.schedule()
    result1 = worker.execute(step1)
    step2 = sched.schedule()
    result2 = worker.execute(step2)
    outputs = sched.update_from_output(step1, result1)
    assert [o.new_token_ids for o in outputs] == [[first]]
    step3 = sched.schedule()
    result3 = worker.execute(step3)
    # Make step 2's token an EOS, as if the model had sampled it.
    result2.sampled_token_ids = [[EOS]]
    outputs = sched.update_from_output(step2, result2)
    assert [(o.new_token_ids, o.finish_reason) for o in outputs] == [([EOS], FinishReason.STOP)]
    assert request.num_output_tokens == 2
    assert step3.num_scheduled_tokens == {"a": 1}  # already in flight when step 2 ended
    assert sched.update_from_output(step3, result3) == []  # its token is thrown away
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == sched.config.num_kv_blocks
    step4 = sched.schedule()
    assert step4.finished_req_ids == {"a"}  # the worker drops it only now
    assert step4.total_num_scheduled_tokens == 0


def test_preempting_a_request_with_a_token_in_flight_recomputes_it() -> None:
    runs = {}
    for async_scheduling in (False, True):
        # 5 blocks of 4: two 8-token prompts fit, their decodes do not.
        sched = make_scheduler(
            num_kv_blocks=5,
            block_size=BLOCK_SIZE,
            max_model_len=20,
            watermark=0.0,
            async_scheduling=async_scheduling,
        )
        sched.add_request(_request("a", 8, max_tokens=6, ignore_eos=True))
        sched.add_request(_request("b", 8, max_tokens=6, ignore_eos=True))
        before = sched._num_preemptions
        runs[async_scheduling] = drive(sched, SimulatedWorker())
        assert sched._num_preemptions > before
    assert runs[True].tokens == runs[False].tokens
    assert {len(t) for t in runs[True].tokens.values()} == {6}
    assert runs[True].finish == {"a": FinishReason.LENGTH, "b": FinishReason.LENGTH}


def test_preempted_in_flight_token_is_dropped_and_recomputed_identically() -> None:
    sched = make_scheduler(
        num_kv_blocks=5, block_size=BLOCK_SIZE, max_model_len=20, watermark=0.0,
        async_scheduling=True,
    )  # fmt: skip
    a = _request("a", 8, max_tokens=6, ignore_eos=True)
    b = _request("b", 8, max_tokens=6, ignore_eos=True)
    sched.add_request(a)
    sched.add_request(b)
    worker = SimulatedWorker()
    step1 = sched.schedule()  # both prefills: 4 blocks
    result1 = worker.execute(step1)
    step2 = sched.schedule()  # both need a 3rd block, one is free: b is preempted
    assert step2.num_scheduled_tokens == {"a": 1}
    assert step2.finished_req_ids == {"b"}
    assert (b.num_computed_tokens, b.num_output_placeholders) == (0, 0)
    worker.execute(step2)
    outputs = sched.update_from_output(step1, result1)
    # b's token from step 1 belongs to a KV that no longer exists: dropped.
    assert [o.request_id for o in outputs] == ["a"]
    assert b.num_output_tokens == 0


def test_abort_with_steps_in_flight_frees_blocks_and_tells_the_worker() -> None:
    sched = make_scheduler(block_size=BLOCK_SIZE, async_scheduling=True)
    sched.add_request(_request("a", 6, max_tokens=10, ignore_eos=True))
    sched.add_request(_request("b", 6, max_tokens=10, ignore_eos=True))
    worker = SimulatedWorker()
    step1 = sched.schedule()
    result1 = worker.execute(step1)
    step2 = sched.schedule()
    result2 = worker.execute(step2)
    assert sched.abort_requests(["a"]) == ["a"]
    outputs = sched.update_from_output(step1, result1)
    assert [o.request_id for o in outputs] == ["b"]
    step3 = sched.schedule()
    assert step3.finished_req_ids == {"a"}
    assert set(step3.num_scheduled_tokens) == {"b"}
    worker.execute(step3)
    assert [o.request_id for o in sched.update_from_output(step2, result2)] == ["b"]
    sched.check_integrity()
    assert "a" not in worker.tokens


@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_give_identical_tokens_sync_and_async(seed: int) -> None:
    specs, config = random_workload(random.Random(seed), BLOCK_SIZE)
    runs = {}
    for async_scheduling in (False, True):
        sched = make_scheduler(async_scheduling=async_scheduling, **config)
        arrivals: dict[int, list[Request]] = {}
        for req_id, prompt, max_tokens, ignore_eos, arrival in specs:
            request = _request(
                req_id, len(prompt), max_tokens, prompt_token_ids=prompt, ignore_eos=ignore_eos
            )
            arrivals.setdefault(arrival, []).append(request)
        runs[async_scheduling] = drive(sched, SimulatedWorker(), arrivals)
    assert runs[True].tokens == runs[False].tokens
    assert runs[True].finish == runs[False].finish
    assert set(runs[True].finish) == {spec[0] for spec in specs}


@pytest.mark.parametrize("seed", range(6))
def test_random_aborts_in_async_mode_keep_kv_consistent(seed: int) -> None:
    rng = random.Random(100 + seed)
    sched = make_scheduler(
        num_kv_blocks=10, block_size=BLOCK_SIZE, max_model_len=24, max_num_seqs=4,
        max_num_batched_tokens=16, watermark=0.0, async_scheduling=True,
    )  # fmt: skip
    arrivals: dict[int, list[Request]] = {}
    aborts: dict[int, list[str]] = {}
    for i in range(8):
        arrival = rng.randint(0, 8)
        request = _request(f"r{i}", rng.randint(1, 12), rng.randint(6, 12), ignore_eos=True)
        arrivals.setdefault(arrival, []).append(request)
        if i % 2:
            # A few steps after its arrival: mid-prefill or mid-decode, a step in flight.
            aborts.setdefault(arrival + rng.randint(1, 4), []).append(request.request_id)
    ids = [r.request_id for requests in arrivals.values() for r in requests]
    # drive() checks the KV of every position read, and integrity after every op.
    run = drive(sched, SimulatedWorker(), arrivals, aborts)
    assert run.aborted
    assert set(run.finish) | run.aborted == set(ids)
    assert not set(run.finish) & run.aborted
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 10
