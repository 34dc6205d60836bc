"""Prefill/decode disaggregation in the scheduler service, without a model.

The prefill side (``Scheduler.Prefill``) answers only once its blocks are saved
and leased; the decode side holds the leases its requests bring until they ran.
An in-memory worker plays the connector's saves (put into a real in-process
kvstore a few steps late, or failed); leases are the store's own.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import pytest
import pytest_asyncio
from prometheus_client import CollectorRegistry

from kvmesh.kvstore.client import KVStoreClient
from kvmesh.kvstore.layout import KVLayout
from kvmesh.kvstore.testing import FakeClock, serve_store
from kvmesh.kvstore.tiered import TieredStore
from kvmesh.protos import common_pb2, scheduler_pb2
from kvmesh.scheduler.config import SchedulerConfig
from kvmesh.scheduler.kv_leases import HeldLeases, StoreLeases
from kvmesh.scheduler.metrics import SchedulerMetrics
from kvmesh.scheduler.service import SchedulerEngine, SchedulerServicer
from kvmesh.services.contracts.block_hash import extend_block_hashes, sha256_block_hash
from kvmesh.services.contracts.errors import OverloadedError, UnavailableError
from kvmesh.services.contracts.step import KVConnectorOutput, ModelRunnerOutput
from tests.scheduler.factories import make_request, make_scheduler
from tests.scheduler.test_scheduler_engine_async import InMemoryWorkerClient

BLOCK = 4
LAYOUT = KVLayout(model="m", dtype="float32", block_size=BLOCK, layout_version=1)
BLOCK_BYTES = b"kv" * 8
TTL_S = 10.0


class SavingWorkerClient(InMemoryWorkerClient):
    """Also plays the connector's saves: the blocks a step names are put into the
    store and reported ``delay`` steps later (while ``hold`` is unset), or
    reported failed if their hash is in ``fail``. ``broken``: the stream fails.
    Clearing ``stepping`` freezes steps in the worker."""

    def __init__(self, store: KVStoreClient, delay: int = 2) -> None:
        super().__init__()
        self.store = store
        self.delay = delay
        self.hold = False
        self.broken = False
        self.fail: set[bytes] = set()
        self.stepping = asyncio.Event()
        self.stepping.set()
        self._num_steps = 0
        self._saving: list[tuple[int, list[bytes]]] = []

    async def receive(self, step_id: int) -> ModelRunnerOutput:
        await self.stepping.wait()
        if self.broken:
            raise UnavailableError("worker stream failed: UNAVAILABLE")
        meta = self.queue[0].kv_connector_metadata
        hashes = [h for transfer in meta.saves for h in transfer.block_hashes]
        result = await super().receive(step_id)
        self._num_steps += 1
        if hashes:
            self._saving.append((self._num_steps + self.delay, hashes))
        if self.hold:
            return result
        due = [h for at, hs in self._saving if at <= self._num_steps for h in hs]
        self._saving = [(at, hs) for at, hs in self._saving if at > self._num_steps]
        saved = [h for h in due if h not in self.fail]
        if saved:
            await self.store.put_blocks(LAYOUT, [(h, BLOCK_BYTES) for h in saved])
        result.kv_connector_output = KVConnectorOutput(
            saved_block_hashes=saved, failed_save_hashes=[h for h in due if h in self.fail]
        )
        return result

    async def connect(self, timeout: float):  # a broken worker never comes back here
        await asyncio.sleep(3600)


@dataclass
class Replica:
    engine: SchedulerEngine
    worker: SavingWorkerClient
    store: KVStoreClient
    clock: FakeClock


def _engine(
    worker: InMemoryWorkerClient, leases: StoreLeases | None, async_scheduling: bool = False
) -> SchedulerEngine:
    config = SchedulerConfig(
        num_kv_blocks=32,
        block_size=BLOCK,
        max_model_len=64,
        enable_kv_connector=leases is not None,
        async_scheduling=async_scheduling,
    )
    return SchedulerEngine(
        config,
        worker,  # type: ignore[arg-type]
        [2],
        SchedulerMetrics("test", registry=CollectorRegistry()),
        max_waiting_requests=1,
        kv_leases=leases,
    )


# The test's own loop: the engine's step loop runs beside the test.
@pytest_asyncio.fixture(params=[False, True], ids=["sync", "async"], loop_scope="function")
async def replica(request: pytest.FixtureRequest) -> AsyncIterator[Replica]:
    """A running prefill-capable engine over a store of 64 blocks."""
    clock = FakeClock()
    store = TieredStore(64 * len(BLOCK_BYTES), high_watermark=1, low_watermark=1, clock=clock)
    async with serve_store(store) as address, KVStoreClient(address) as client:
        worker = SavingWorkerClient(client)
        leases = StoreLeases(client, [LAYOUT], ttl_s=TTL_S)
        engine = _engine(worker, leases, async_scheduling=request.param)
        stop = asyncio.Event()
        loop_task = asyncio.create_task(engine.run(stop))
        try:
            yield Replica(engine, worker, client, clock)
        finally:
            stop.set()
            await asyncio.wait_for(loop_task, 10)
            await leases.drain()


def _prefill_msg(rid: str, num_tokens: int = 13) -> scheduler_pb2.PrefillRequest:
    return scheduler_pb2.PrefillRequest(
        request_id=rid, prompt_token_ids=list(range(300, 300 + num_tokens))
    )


def _hashes(msg: scheduler_pb2.PrefillRequest) -> list[bytes]:
    hashes: list[bytes] = []
    extend_block_hashes(hashes, msg.prompt_token_ids, BLOCK, None, sha256_block_hash)
    return hashes


def _assert_nothing_held(engine: SchedulerEngine) -> None:
    assert engine.core.live_request_ids() == []
    assert engine.prefills.num_in_flight == 0
    assert not engine.core.has_connector_work()
    assert engine.core.make_stats().kv_cache_usage == 0
    engine.core.check_integrity()


async def _num_leases(replica: Replica) -> int:
    return (await replica.store.stats()).num_leases


async def _until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.005)


async def test_prefill_answers_once_every_loadable_block_is_saved_and_leased(replica) -> None:
    _, published = replica.engine.subscribe()
    reply = await asyncio.wait_for(replica.engine.prefills.prefill(_prefill_msg("p")), 10)
    # 13 tokens: blocks 0-2 hold tokens 0-11, which the decode replica loads (it
    # recomputes the last token for its logits). The store leases only stored
    # blocks, so all three were saved before the answer although the worker
    # reports saves two steps late.
    transfer = reply.kv_transfer
    assert transfer.num_stored_tokens == 3 * BLOCK and len(transfer.lease_ids) == 1
    assert await _num_leases(replica) == 1
    assert published.empty()  # its one token is published to nobody
    _assert_nothing_held(replica.engine)


async def test_a_failed_save_shortens_the_transfer_to_the_blocks_before_it(replica) -> None:
    prompt = _prefill_msg("p", num_tokens=17)  # 4 loadable blocks
    replica.worker.fail = {_hashes(prompt)[2]}
    reply = await asyncio.wait_for(replica.engine.prefills.prefill(prompt), 10)
    assert reply.kv_transfer.num_stored_tokens == 2 * BLOCK
    _assert_nothing_held(replica.engine)


async def test_a_prompt_without_a_loadable_block_is_not_computed(replica) -> None:
    reply = await replica.engine.prefills.prefill(_prefill_msg("short", num_tokens=BLOCK))
    assert reply.kv_transfer == scheduler_pb2.KVTransferParams()
    assert replica.engine.core.make_stats().prefix_cache_queries == 0
    assert await _num_leases(replica) == 0


async def test_a_caller_gone_during_the_prefill_aborts_it(replica) -> None:
    engine = replica.engine
    engine.config = engine.core.config = dataclasses.replace(
        engine.config, max_num_batched_tokens=8
    )  # a 60-token prompt takes 8 steps
    replica.worker.stepping.clear()
    call = asyncio.create_task(engine.prefills.prefill(_prefill_msg("p", 60)))
    await _until(lambda: engine.core.num_running == 1)  # its first chunk is in the worker
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    replica.worker.stepping.set()
    await _until(lambda: not engine.core.has_unfinished_requests())
    await _until(lambda: not engine.core.has_connector_work())
    assert replica.worker.num_computed["p"] < 60  # aborted, not run to its end
    _assert_nothing_held(engine)
    assert await _num_leases(replica) == 0


async def test_a_caller_gone_while_the_saves_run_leaves_no_wait_and_no_lease(replica) -> None:
    engine = replica.engine
    replica.worker.hold = True  # saves never finish while held
    call = asyncio.create_task(engine.prefills.prefill(_prefill_msg("p")))
    await _until(lambda: engine.prefills.num_in_flight == 1)
    await _until(lambda: not engine.core.has_unfinished_requests())
    assert engine.core.has_connector_work()  # finished, waiting for its saves
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    # The saves are still running, but nobody waits for them: the loop may idle.
    await _until(lambda: not engine.core.has_connector_work())
    _assert_nothing_held(engine)
    assert await _num_leases(replica) == 0
    replica.worker.hold = False


async def test_a_lost_worker_ends_a_prefill_waiting_for_its_saves(replica) -> None:
    engine = replica.engine
    replica.worker.hold = True
    call = asyncio.create_task(engine.prefills.prefill(_prefill_msg("p")))
    await _until(lambda: engine.prefills.num_in_flight == 1)
    await _until(lambda: not engine.core.has_unfinished_requests())
    replica.worker.broken = True
    # Settled with whatever reached the store: here nothing, so nothing to load.
    reply = await asyncio.wait_for(call, 5)
    assert reply.kv_transfer == scheduler_pb2.KVTransferParams()
    await engine.prefills.leases.drain()  # type: ignore[union-attr]
    assert not engine.healthy and await _num_leases(replica) == 0  # the empty lease ended
    _assert_nothing_held(engine)


async def test_a_lost_worker_fails_a_prefill_still_computing(replica) -> None:
    engine = replica.engine
    replica.worker.broken = True
    with pytest.raises(UnavailableError, match="prefill failed: worker unavailable"):
        await asyncio.wait_for(engine.prefills.prefill(_prefill_msg("p")), 5)
    _assert_nothing_held(engine)


async def test_a_full_queue_refuses_a_prefill() -> None:
    engine = _engine(InMemoryWorkerClient(), StoreLeases(None, [LAYOUT], ttl_s=TTL_S))  # type: ignore[arg-type]
    queued = asyncio.create_task(engine.prefills.prefill(_prefill_msg("a")))
    await _until(lambda: engine.core.num_waiting == 1)  # no step loop: it stays queued
    with pytest.raises(OverloadedError):
        await engine.prefills.prefill(_prefill_msg("b"))
    queued.cancel()
    with pytest.raises(asyncio.CancelledError):
        await queued
    engine._apply_pending_control()
    _assert_nothing_held(engine)


async def test_decode_side_holds_the_lease_until_its_request_ran(replica) -> None:
    engine = replica.engine
    _, published = engine.subscribe()
    servicer = SchedulerServicer(engine, scheduler_pb2.SchedulerInfo())
    transfer = (await engine.prefills.prefill(_prefill_msg("p"))).kv_transfer
    msg = scheduler_pb2.AddRequestRequest(
        request_id="d",
        prompt_token_ids=_prefill_msg("p").prompt_token_ids,
        sampling_params=common_pb2.SamplingParams(max_tokens=3, ignore_eos=True),
        kv_transfer=transfer,
    )
    await servicer.AddRequest(msg, None)
    assert engine.transfer_leases.num_held == 1
    while not any(o.finish_reason for o in (await asyncio.wait_for(published.get(), 5)).outputs):
        pass
    await _until(lambda: engine.transfer_leases.num_held == 0)
    await engine.transfer_leases.leases.drain()  # type: ignore[union-attr]
    assert await _num_leases(replica) == 0


async def test_a_refused_decode_request_ends_its_lease_at_once(replica) -> None:
    engine = replica.engine
    servicer = SchedulerServicer(engine, scheduler_pb2.SchedulerInfo())
    transfer = (await engine.prefills.prefill(_prefill_msg("p"))).kv_transfer
    msg = scheduler_pb2.AddRequestRequest(
        request_id="refused", prompt_token_ids=[5] * 13, kv_transfer=transfer
    )
    with pytest.raises(UnavailableError, match="detokenizer"):  # nobody subscribed
        await servicer.AddRequest(msg, None)
    assert engine.transfer_leases.num_held == 0
    await engine.transfer_leases.leases.drain()  # type: ignore[union-attr]
    assert await _num_leases(replica) == 0


class RecordingLeases:
    def __init__(self) -> None:
        self.released: list[int] = []

    def release_soon(self, lease_ids: list[int]) -> None:
        self.released.extend(lease_ids)


def test_held_leases_end_when_their_request_runs_or_ends_first() -> None:
    leases = RecordingLeases()
    held = HeldLeases(leases)  # type: ignore[arg-type]
    core = make_scheduler(block_size=BLOCK, num_kv_blocks=32, max_model_len=64, max_num_seqs=1)
    for rid, lease_id in (("ran", 1), ("aborted", 2)):
        msg = scheduler_pb2.AddRequestRequest(
            request_id=rid, kv_transfer=scheduler_pb2.KVTransferParams(lease_ids=[lease_id])
        )
        with held.held_for(msg):
            core.add_request(make_request(9, request_id=rid))
    with (
        pytest.raises(OverloadedError),
        held.held_for(
            scheduler_pb2.AddRequestRequest(
                request_id="refused", kv_transfer=scheduler_pb2.KVTransferParams(lease_ids=[3])
            )
        ),
    ):
        raise OverloadedError("queue full")
    assert leases.released == [3] and held.num_held == 2
    held.release_settled(core)  # both still waiting: the blocks must stay
    assert leases.released == [3]
    core.schedule()  # one seat: "ran" is admitted, "aborted" keeps waiting
    held.release_settled(core)
    assert leases.released == [3, 1]
    core.abort_requests("aborted")
    held.release_settled(core)
    assert leases.released == [3, 1, 2] and held.num_held == 0


async def test_a_lease_the_decode_side_never_ends_expires_and_frees_its_blocks(replica) -> None:
    """Decode never comes: the blocks stay pinned until the TTL, then are evictable."""
    prompt = _prefill_msg("p")
    transfer = (await replica.engine.prefills.prefill(prompt)).kv_transfer
    assert transfer.num_stored_tokens == 3 * BLOCK
    hashes = _hashes(prompt)[:3]

    async def fill_the_store(seed: int) -> None:
        filler = [bytes([seed, i]) * 16 for i in range(64)]  # as many blocks as it holds
        await replica.store.put_blocks(LAYOUT, [(h, BLOCK_BYTES) for h in filler])

    await fill_the_store(1)
    assert await replica.store.lookup_prefix([LAYOUT], hashes) == 3  # pinned
    replica.clock.now += TTL_S + 0.1
    assert await _num_leases(replica) == 0
    await fill_the_store(2)
    assert await replica.store.lookup_prefix([LAYOUT], hashes) == 0  # evicted


async def test_without_the_connector_prefill_is_unavailable() -> None:
    engine = _engine(InMemoryWorkerClient(), leases=None)
    with pytest.raises(UnavailableError, match="kv-offload"):
        await engine.prefills.prefill(_prefill_msg("p"))
