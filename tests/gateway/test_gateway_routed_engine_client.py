"""The gateway over several replicas: each request goes where the policy says and stays
there (aborts included); unready, refusing and unlisted replicas leave the picks at once
and rejoin when ready; the routing metrics count what happened."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest
from prometheus_client import REGISTRY

from kvmesh.gateway.engine.client import GenerationRequest, ModelInfo
from kvmesh.gateway.engine.routed_client import RoutedEngineClient
from kvmesh.protos import scheduler_pb2
from kvmesh.services.contracts.errors import UnavailableError
from kvmesh.services.contracts.replica_set import ReplicaAddress
from kvmesh.services.contracts.sampling_params import DetokenizeParams, SamplingParams
from tests.gateway.fakes import FakeEngineClient

BLOCK_SIZE = 4
INFO = ModelInfo("m", 128, 1000, (0,), capacity=10, kv_block_size=BLOCK_SIZE)
# Unreachable on purpose: the KV event followers retry in the background.
ADDRESSES = {
    name: ReplicaAddress(name, f"127.0.0.1:{port}", "127.0.0.1:1")
    for name, port in (("a", 1), ("b", 2))
}


@dataclass
class FakeReplica(FakeEngineClient):
    """One replica's client: a fake engine that also starts, closes and fails its requests."""

    in_flight_failures: list[str] = field(default_factory=list)

    async def start(self, timeout: float) -> None:
        return None

    async def close(self) -> None:
        return None

    def fail_in_flight(self, reason: str) -> None:
        self.in_flight_failures.append(reason)


class PushedDiscovery:
    """Replica sets a test hands over one at a time."""

    def __init__(self, *names: str) -> None:
        self.sets: asyncio.Queue[frozenset[ReplicaAddress]] = asyncio.Queue()
        self.push(*names)

    def push(self, *names: str) -> None:
        self.sets.put_nowait(frozenset(ADDRESSES[n] for n in names))

    async def watch(self) -> AsyncIterator[frozenset[ReplicaAddress]]:
        while True:
            yield await self.sets.get()


def make_request(rid: str, prompt: list[int], max_tokens: int = 2) -> GenerationRequest:
    return GenerationRequest(
        rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), DetokenizeParams()
    )


async def wait_for(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


async def run(engine: RoutedEngineClient, request: GenerationRequest) -> list[str | None]:
    return [delta.finish_reason async for delta in engine.generate(request)]


@pytest.fixture
def replicas() -> dict[str, FakeReplica]:
    return {name: FakeReplica(decode=lambda ids: "x" * len(ids), info=INFO) for name in "ab"}


@contextlib.asynccontextmanager
async def routed(
    replicas: dict[str, FakeReplica], policy: str, discovery: PushedDiscovery
) -> AsyncIterator[RoutedEngineClient]:
    """The gateway's client over ``replicas``, once every listed one is routable."""
    engine = RoutedEngineClient(discovery, lambda a: replicas[a.name], policy, 0.01)
    await engine.start(timeout=5)
    try:
        await wait_for(lambda: engine.router.num_routable == len(discovery_names(engine)))
        yield engine
    finally:
        await engine.close()


def discovery_names(engine: RoutedEngineClient) -> list[str]:
    return [n for n in ADDRESSES if engine.router and engine.router.has_replica(n)]


def decisions(replica: str, policy: str, reason: str) -> float:
    labels = {"replica": replica, "policy": policy, "reason": reason}
    return REGISTRY.get_sample_value("kvmesh_router_decisions_total", labels) or 0.0


async def test_round_robin_spreads_requests_and_counts_them(replicas) -> None:
    async with routed(replicas, "round-robin", PushedDiscovery("a", "b")) as engine:
        before = decisions("a", "round-robin", "round_robin")
        for i in range(4):
            assert (await run(engine, make_request(f"r{i}", [1, 2, 3])))[-1] == "length"
        assert [len(replicas[n].requests) for n in "ab"] == [2, 2]
        assert decisions("a", "round-robin", "round_robin") == before + 2
        assert engine.model_info.capacity == 2 * INFO.capacity  # sized for both replicas


async def test_kv_policy_sends_a_prompt_to_the_replica_holding_its_prefix(replicas) -> None:
    async with routed(replicas, "kv", PushedDiscovery("a", "b")) as engine:
        prompt = list(range(40))
        hashes = engine.router.prompt_block_hashes(prompt)
        stored = scheduler_pb2.KVCacheEvent(stored=scheduler_pb2.BlockStored(block_hashes=hashes))
        idle = scheduler_pb2.ReplicaLoad()
        snapshot = scheduler_pb2.KVEventBatch(
            instance_id=7, sequence=1, resync=True, events=[stored], load=idle
        )
        engine.router.apply_kv_events("b", snapshot)
        for i in range(3):
            await run(engine, make_request(f"p{i}", [*prompt, 100 + i]))
            # b's next load report: the request finished, nothing is running.
            engine.router.apply_kv_events(
                "b", scheduler_pb2.KVEventBatch(instance_id=7, sequence=1, load=idle)
            )
        busy = scheduler_pb2.ReplicaLoad(num_running=1, num_active_blocks=5)
        engine.router.apply_kv_events(
            "b", scheduler_pb2.KVEventBatch(instance_id=7, sequence=1, load=busy)
        )
        await run(engine, make_request("other", [7] * 40))  # nothing cached: the idler replica
        assert [len(replicas[n].requests) for n in "ab"] == [1, 3]
        assert replicas["a"].requests[0].request_id == "other"


async def test_abort_reaches_the_replica_serving_the_request(replicas) -> None:
    async with routed(replicas, "round-robin", PushedDiscovery("a", "b")) as engine:
        for replica in replicas.values():
            replica.hang_after_deltas = 1
        streams = [engine.generate(make_request(f"h{i}", [1, 2], max_tokens=5)) for i in range(2)]
        for stream in streams:
            await anext(stream)
        owner = next(n for n in "ab" if replicas[n].requests[0].request_id == "h1")
        await engine.abort("h1")
        assert replicas[owner].aborted == ["h1"]
        assert all(not replicas[n].aborted for n in "ab" if n != owner)
        for stream in streams:
            await stream.aclose()


async def test_an_unready_replica_leaves_the_picks_and_rejoins(replicas) -> None:
    async with routed(replicas, "round-robin", PushedDiscovery("a", "b")) as engine:
        replicas["b"].ready = False
        await wait_for(lambda: engine.router.num_routable == 1)
        assert REGISTRY.get_sample_value("kvmesh_router_routable_replicas") == 1
        for i in range(3):
            await run(engine, make_request(f"u{i}", [1, 2]))
        assert (len(replicas["a"].requests), len(replicas["b"].requests)) == (3, 0)
        replicas["a"].ready = False
        await wait_for(lambda: engine.router.num_routable == 0)
        with pytest.raises(UnavailableError):
            await engine.check_ready()
        with pytest.raises(UnavailableError):
            await run(engine, make_request("none", [1, 2]))
        replicas["b"].ready = True
        await wait_for(lambda: engine.router.num_routable == 1)
        await engine.check_ready()
        await run(engine, make_request("back", [1, 2]))
        assert [r.request_id for r in replicas["b"].requests] == ["back"]


async def test_a_refusing_replica_is_skipped_for_the_same_request(replicas) -> None:
    async with routed(replicas, "round-robin", PushedDiscovery("a", "b")) as engine:
        replicas["a"].fail_with = UnavailableError("scheduler unreachable")
        replicas["b"].fail_with = None
        for i in range(2):  # whichever comes first, both end on b
            assert (await run(engine, make_request(f"s{i}", [1, 2])))[-1] == "length"
        assert len(replicas["b"].requests) == 2
        assert not engine.router.replica("a").routable or replicas["a"].ready


async def test_an_unlisted_replica_fails_its_requests_in_flight(replicas) -> None:
    discovery = PushedDiscovery("a", "b")
    async with routed(replicas, "round-robin", discovery) as engine:
        discovery.push("a")
        await wait_for(lambda: not engine.router.has_replica("b"))
        assert replicas["b"].in_flight_failures and not replicas["a"].in_flight_failures
        discovery.push("a", "b")
        await wait_for(lambda: engine.router.has_replica("b") and engine.router.num_routable == 2)


@contextlib.asynccontextmanager
async def slow_polling(
    replicas: dict[str, FakeReplica], wait_for_replica_s: float, names: str = "a"
) -> AsyncIterator[RoutedEngineClient]:
    """Probes every 30 s: whatever the router learns sooner, it learned another way."""
    engine = RoutedEngineClient(
        PushedDiscovery(*names),
        lambda a: replicas[a.name],
        "round-robin",
        30.0,
        wait_for_replica_s=wait_for_replica_s,
    )
    await engine.start(timeout=5)
    try:
        await wait_for(lambda: engine.router.num_routable == len(names))
        yield engine
    finally:
        await engine.close()


def waits() -> tuple[float, float]:
    count = REGISTRY.get_sample_value("kvmesh_router_replica_waits_total") or 0.0
    seconds = REGISTRY.get_sample_value("kvmesh_router_replica_wait_seconds_sum") or 0.0
    return count, seconds


async def test_a_request_finding_no_routable_replica_waits_for_one(replicas) -> None:
    async with slow_polling(replicas, wait_for_replica_s=10.0) as engine:
        count, seconds = waits()
        # The replica's client sees its streams break: out of the picks now.
        replicas["a"].ready = False
        replicas["a"].on_connection_change(False)
        assert engine.router.num_routable == 0
        with pytest.raises(UnavailableError):
            await engine.check_ready()
        waiting = asyncio.ensure_future(run(engine, make_request("w", [1, 2])))
        await asyncio.sleep(0.3)
        assert not waiting.done() and not replicas["a"].requests
        # Back: found by the fast probe of an unroutable replica, not the 30 s poll.
        back_at = asyncio.get_running_loop().time()
        replicas["a"].ready = True
        assert (await waiting)[-1] == "length"
        assert asyncio.get_running_loop().time() - back_at < 0.1
        await engine.check_ready()
        new_count, new_seconds = waits()
        assert new_count == count + 1
        assert 0.3 < new_seconds - seconds < 1.0


async def test_the_wait_is_bounded_and_then_refused(replicas) -> None:
    async with slow_polling(replicas, wait_for_replica_s=0.3) as engine:
        count, _ = waits()
        replicas["a"].ready = False
        replicas["a"].fail_with = UnavailableError("scheduler unreachable")
        started = asyncio.get_running_loop().time()
        with pytest.raises(UnavailableError, match="--migration-timeout-s"):
            await run(engine, make_request("late", [1, 2]))
        assert 0.3 <= asyncio.get_running_loop().time() - started < 1.0
        assert waits()[0] == count + 1


async def test_ready_asks_the_replica_rather_than_the_last_probe(replicas) -> None:
    async with slow_polling(replicas, wait_for_replica_s=5.0) as engine:
        replicas["a"].ready = False  # dead since the last probe, 30 s ago
        with pytest.raises(UnavailableError):
            await engine.check_ready()
        assert engine.router.num_routable == 0  # and it left the picks
        replicas["a"].ready = True
        await wait_for(lambda: engine.router.num_routable == 1, timeout_s=0.5)
        await engine.check_ready()


async def test_a_stream_back_is_probed_at_once(replicas) -> None:
    async with slow_polling(replicas, wait_for_replica_s=5.0, names="ab") as engine:
        replicas["b"].ready = False
        replicas["b"].on_connection_change(False)
        assert not engine.router.replica("b").routable
        await asyncio.sleep(0.2)
        replicas["b"].ready = True
        replicas["b"].on_connection_change(True)
        await wait_for(lambda: engine.router.replica("b").routable, timeout_s=0.1)
