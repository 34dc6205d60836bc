"""Random workloads on a tiny block pool (so preemption happens) keep every
invariant after every operation, and the worker's view stays consistent —
with the KV connector too: stored prefixes, loads that finish whole, short or
after their request was aborted."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.scheduler.request_status import RequestStatus
from kvmesh.scheduler.scheduler import Scheduler
from kvmesh.services.contracts.block_hash import extend_block_hashes, sha256_block_hash
from kvmesh.services.runtime.config import SCHEDULING_POLICIES
from tests.scheduler.factories import make_output, make_request, make_scheduler

EOS = 2
SHARED = list(range(300, 324))

add_op = st.tuples(
    st.just("add"),
    st.integers(1, 24),  # prompt length
    st.integers(1, 12),  # max_tokens
    st.integers(0, 2),  # 0: unique prompt, 1: shared 16-token prefix, 2: shared prompt
    st.sampled_from([None, "salt"]),
    st.integers(0, 2),  # priority
)
step_op = st.tuples(st.just("step"), st.integers(0, 6))  # 0 samples EOS
finish_op = st.tuples(st.sampled_from(["finish", "abort"]), st.integers(0, 1000))
# The store holds the shared prompt's first blocks (connector on).
store_op = st.tuples(st.just("store"), st.sampled_from([None, "salt"]), st.integers(1, 6))
ops = st.lists(st.one_of(add_op, step_op, step_op, finish_op, store_op), max_size=60)


class FakeWorker:
    """Applies each SchedulerOutput like a worker with a persistent batch would,
    failing on anything the contract forbids."""

    def __init__(self) -> None:
        self.block_tables: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}
        # Connector loads sent and not reported yet: req_id -> target blocks.
        self.loads: dict[str, list[int]] = {}

    def apply(self, sched: Scheduler, out) -> None:
        for req_id in out.finished_req_ids:
            if req_id in self.loads or req_id not in self.block_tables:
                # A request aborted while its KV loaded (sent or only planned).
                assert req_id not in self.block_tables
                self.loads.pop(req_id, None)
                continue
            del self.block_tables[req_id]
            del self.num_computed[req_id]
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.block_tables, f"{new.req_id} sent in full twice"
            self.block_tables[new.req_id] = list(new.block_ids)
            self.num_computed[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for req_id, new_blocks, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            assert self.num_computed[req_id] == num_computed
            self.block_tables[req_id].extend(new_blocks)
        assert set(self.block_tables) == {r.request_id for r in sched.running}
        assert set(out.num_scheduled_tokens) <= set(self.block_tables)
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            assert self.block_tables[req_id] == sched.get_block_ids(req_id)
            self.num_computed[req_id] += num_tokens
            assert len(self.block_tables[req_id]) * 4 >= self.num_computed[req_id]
        for load in out.kv_connector_metadata.loads:
            assert load.req_id not in self.block_tables and load.req_id not in self.loads
            assert load.block_ids == sched.get_block_ids(load.req_id)[-len(load.block_ids) :]
            self.loads[load.req_id] = list(load.block_ids)
        # Two live requests share a block only if it is a cached, full block;
        # a block being loaded into belongs to its load alone.
        owners: dict[int, int] = {}
        for table in self.block_tables.values():
            for block_id in table:
                owners[block_id] = owners.get(block_id, 0) + 1
        blocks = sched.kv_cache_manager.block_pool.blocks
        for block_id, count in owners.items():
            assert count == 1 or blocks[block_id].block_hash is not None
        for target in self.loads.values():
            assert not owners.keys() & set(target), "a step computes into blocks being loaded"


def _step(sched: Scheduler, worker: FakeWorker, choice: int) -> None:
    # Loads sent by earlier steps finish now, with choice deciding how much arrived.
    finished_loads = {req_id: choice % (len(target) + 1) for req_id, target in worker.loads.items()}
    worker.loads.clear()
    out = sched.schedule()
    assert out.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
    assert len(out.num_scheduled_tokens) <= sched.config.max_num_seqs
    worker.apply(sched, out)
    token = EOS if choice == 0 else 10 + choice
    tokens = dict.fromkeys(out.num_scheduled_tokens, token)
    result = make_output(out, tokens, scheduler=sched)
    result.kv_connector_output.finished_loads = finished_loads
    for output in sched.update_from_output(out, result):
        assert output.new_token_ids or output.finish_reason is not None


def _shared_prompt_hashes(salt: str | None) -> list[bytes]:
    hashes: list[bytes] = []
    extend_block_hashes(hashes, SHARED, 4, salt, sha256_block_hash)
    return hashes


@settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    operations=ops,
    policy=st.sampled_from(SCHEDULING_POLICIES),
    caching=st.sampled_from(["off", "on", "connector"]),
    budget=st.sampled_from([4, 9, 32]),
    threshold=st.sampled_from([0, 5]),
)
def test_random_workloads_keep_block_invariants(
    operations, policy, caching, budget, threshold
) -> None:
    sched = make_scheduler(
        num_kv_blocks=8,
        block_size=4,
        max_model_len=32,
        max_num_seqs=4,
        max_num_batched_tokens=budget,
        long_prefill_token_threshold=threshold,
        policy=policy,
        enable_prefix_caching=caching != "off",
        enable_kv_connector=caching == "connector",
        watermark=0.2,
    )
    worker = FakeWorker()
    submitted = []
    for op in operations:
        if op[0] == "add":
            _, n_prompt, max_tokens, sharing, salt, priority = op
            if sharing == 0:
                prompt = None
            elif sharing == 1:
                prompt = [*SHARED[:16], *range(900, 900 + n_prompt)][:n_prompt]
            else:
                prompt = SHARED[:n_prompt]
            request = make_request(
                n_prompt,
                max_tokens,
                prompt_token_ids=prompt,
                cache_salt=salt,
                priority=priority,
                arrival_time=float(len(submitted)),
            )
            sched.add_request(request)
            submitted.append(request)
        elif op[0] == "step":
            _step(sched, worker, op[1])
        elif op[0] == "store":
            if sched.connector is not None:
                _, salt, num_blocks = op
                sched.connector.record_stored(_shared_prompt_hashes(salt)[:num_blocks])
        elif submitted:
            target = submitted[op[1] % len(submitted)].request_id
            if op[0] == "abort":
                sched.abort_requests([target])
            else:
                sched.finish_requests([target], RequestStatus.FINISHED_STOPPED)
        sched.check_integrity()

    # Everything drains: no request is stuck behind the tiny pool.
    for _ in range(2_000):
        if not sched.has_unfinished_requests() and not sched.has_connector_work():
            break
        _step(sched, worker, 1)
        sched.check_integrity()
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.usage == 0.0
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    for request in submitted:
        assert request.status.is_finished()
        assert request.num_output_tokens <= request.sampling_params.max_tokens
        assert request.num_tokens <= 32
        if request.status == RequestStatus.FINISHED_LENGTH_CAPPED:
            assert request.num_output_tokens == min(
                request.sampling_params.max_tokens, 32 - request.num_prompt_tokens
            )
