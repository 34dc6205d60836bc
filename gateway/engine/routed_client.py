"""The gateway's EngineClient over a set of engine replicas: route, then delegate.

Each replica (a scheduler, its worker and its detokenizer) gets its own
``GrpcEngineClient``, so submitting, streaming, aborting and failing
requests stay exactly what they are with one replica. On top:

- membership from a ``ReplicaDiscovery``: a listed replica joins once its
  scheduler answers (GetInfo) and its detokenizer stream is open; an unlisted
  one leaves, failing its requests in flight;
- readiness: each replica's scheduler is probed every poll period; a failed
  or slow probe takes the replica out of the picks at once, a good one puts it
  back (``Router.set_routable``). Its requests in flight are left to it: a
  replica whose scheduler dies has its detokenizer fail them, one whose worker
  dies has its scheduler fail (or migrate) them, so neither waits for a probe.
  An unroutable replica is probed every ``FAST_PROBE_PERIOD_S`` instead, and at
  once when it refuses a request or its detokenizer stream comes back, so a
  restarted stage is routable again within ~50 ms of being ready, not at the
  next poll (issue 43: about 2 s, in which every new request got 503);
- waiting, not refusing: a request that finds no routable replica (a stage
  restarting, the router not yet told) waits for one, at most
  ``wait_for_replica_s`` (the gateway's ``--migration-timeout-s``), the same
  patience a migrated request gets. ``check_ready`` (the HTTP ``/ready``) asks
  the routable replicas themselves, so it answers 200 only when a request
  would be routed now;
- the prefix index and loads from each replica's KV event stream, followed
  while there are two or more replicas to choose between: with one, every
  request goes to it whatever the index says, and not following spares its
  scheduler a stream message per engine step (served 128/128, against the
  commit before, on the 2-core "AMD EPYC" family 25 model 17, Zen 4 with
  AVX512-BF16, no AMX: 0.83-0.91 scheduler CPU-seconds per run against 0.92-1.01);
- ``generate`` picks a replica by the routing policy and remembers it, so an
  abort reaches the replica that has the request; a replica that refuses
  with UNAVAILABLE before admitting the request leaves the picks and the
  request is routed again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field, replace

from kvmesh.gateway.engine.client import GenerationDelta, GenerationRequest, ModelInfo
from kvmesh.gateway.engine.grpc_client import GrpcEngineClient
from kvmesh.gateway.routing.config import RouterConfig
from kvmesh.gateway.routing.discovery import ReplicaDiscovery, ReplicaSet
from kvmesh.gateway.routing.kv_event_subscriber import follow_kv_events
from kvmesh.gateway.routing.metrics import (
    REPLICA_WAIT_SECONDS,
    REPLICA_WAITS,
    ROUTABLE_REPLICAS,
    ROUTER_DECISIONS,
)
from kvmesh.gateway.routing.router import Router, RoutingDecision
from kvmesh.protos import scheduler_pb2_grpc
from kvmesh.services.contracts.errors import UnavailableError
from kvmesh.services.contracts.replica_set import ReplicaAddress
from kvmesh.services.runtime.grpc_security import NO_INTERNAL_AUTH, InternalSecurity
from kvmesh.services.runtime.grpc_server import internal_channel
from kvmesh.services.runtime.tracing import Tracing, span_or_nothing

logger = logging.getLogger(__name__)

# A readiness probe slower than this counts as failed.
PROBE_TIMEOUT_S = 3.0
# How often an unroutable replica is probed: how soon its return is seen. A
# probe is one small unary call, and only replicas that are down get these.
FAST_PROBE_PERIOD_S = 0.05


@dataclass(eq=False)
class ReplicaHandle:
    """One joined replica: its client, and the tasks that follow it."""

    address: ReplicaAddress
    client: GrpcEngineClient
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    # Following its KV events (only while the router has a choice to make).
    events: asyncio.Task[None] | None = None
    # Set to have its prober look now (a refusal, a stream back).
    probe_now: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def name(self) -> str:
        return self.address.name


class RoutedEngineClient:
    def __init__(
        self,
        discovery: ReplicaDiscovery,
        make_client: Callable[[ReplicaAddress], GrpcEngineClient],
        routing_policy: str,
        probe_period_s: float,
        overlap_weight: float = 1.0,
        security: InternalSecurity = NO_INTERNAL_AUTH,
        tracing: Tracing | None = None,
        wait_for_replica_s: float = 0.0,
    ) -> None:
        """``wait_for_replica_s``: how long a request waits for a routable replica
        before it is refused with UNAVAILABLE (0: refused at once)."""
        self._discovery = discovery
        self._wait_for_replica_s = wait_for_replica_s
        # Set while at least one replica is routable; requests wait on it.
        self._any_routable = asyncio.Event()
        # What the KV event streams present to the schedulers (the stack's token).
        self._security = security
        # Each pick is a ``route`` span of the request's trace (None: tracing off).
        self._tracing = tracing
        self._make_client = make_client
        self._policy = routing_policy
        self._overlap_weight = overlap_weight
        self._probe_period_s = probe_period_s
        # Created when the first replica joins: it needs the engine's block size.
        self.router: Router | None = None
        self._model_info: ModelInfo | None = None
        self._replicas: dict[str, ReplicaHandle] = {}
        self._joining: dict[str, asyncio.Task[None]] = {}
        # The replica serving each request in flight.
        self._owner: dict[str, ReplicaHandle] = {}
        self._watcher: asyncio.Task[None] | None = None
        self._first_ready = asyncio.Event()
        self._num_listed_at_start = 0
        self._background: set[asyncio.Task[None]] = set()

    # ---- lifecycle -------------------------------------------------------------

    async def start(self, timeout: float = 600.0) -> None:
        """Follow the discovery; return once one replica is ready (UnavailableError if none)."""
        self._watcher = asyncio.create_task(self._watch(), name="replica-discovery")
        ready = asyncio.create_task(self._first_ready.wait())
        await asyncio.wait({ready, self._watcher}, timeout=timeout, return_when="FIRST_COMPLETED")
        if not ready.done():
            ready.cancel()
            if self._watcher.done():
                self._watcher.result()  # the discovery's own error, if it failed
            raise UnavailableError(f"no engine replica was ready within {timeout:.0f}s")

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        for task in self._joining.values():
            task.cancel()
        for name in list(self._replicas):
            await self._leave(name, "the gateway is stopping")

    @property
    def model_info(self) -> ModelInfo:
        if self._model_info is None:
            raise UnavailableError("no engine replica joined yet")
        return self._model_info

    # ---- membership ------------------------------------------------------------

    async def _watch(self) -> None:
        async for replicas in self._discovery.watch():
            self._num_listed_at_start = self._num_listed_at_start or len(replicas)
            await self._apply(replicas)

    async def _apply(self, replicas: ReplicaSet) -> None:
        listed = {r.name: r for r in replicas}
        for name in [*self._replicas, *self._joining]:
            known = self._replicas.get(name)
            if name not in listed or (known is not None and known.address != listed[name]):
                await self._leave(name, "the replica left the replica set")
        for name, address in listed.items():
            if name not in self._replicas and name not in self._joining:
                logger.info("replica %s listed: scheduler %s", name, address.scheduler_addr)
                self._joining[name] = asyncio.create_task(self._join(address), name=f"join {name}")

    async def _join(self, address: ReplicaAddress) -> None:
        client = self._make_client(address)
        try:
            await client.start(timeout=float("inf"))  # cancelled if the replica is unlisted
        except BaseException:
            await client.close()
            raise
        finally:
            self._joining.pop(address.name, None)
        info = client.model_info
        if self.router is None:
            if info.kv_block_size is None:
                raise RuntimeError(f"replica {address.name} reports no KV block size")
            self.router = Router(
                RouterConfig(
                    block_size=info.kv_block_size,
                    policy=self._policy,
                    overlap_weight=self._overlap_weight,
                )
            )
            # The gateway's bound on calls in flight is sized for the replicas listed.
            capacity = (info.capacity or 0) * max(1, self._num_listed_at_start) or None
            self._model_info = replace(info, capacity=capacity)
        elif info.kv_block_size != self.router.config.block_size:
            logger.error(
                "replica %s uses KV blocks of %s tokens, the others %d: not routing to it",
                address.name,
                info.kv_block_size,
                self.router.config.block_size,
            )
            await client.close()
            return
        handle = ReplicaHandle(address, client)
        # The replica's own news (its detokenizer stream broke or came back, its
        # scheduler was lost) reaches the router now rather than at the next probe.
        client.on_connection_change = lambda up: self._connection_changed(handle, up)
        self._replicas[address.name] = handle
        self.router.add_replica(address.name)
        self.router.set_routable(address.name, False)  # until its first probe passes
        handle.tasks = [
            asyncio.create_task(self._probe_forever(handle), name=f"probe {address.name}")
        ]
        self._follow_kv_events_while_choosing()

    def _follow_kv_events_while_choosing(self) -> None:
        """Follow every replica's KV events when there are two or more, none when
        there is one (a later stream starts with a resync: nothing is missed)."""
        assert self.router is not None
        choosing = len(self._replicas) > 1
        for handle in self._replicas.values():
            if choosing and handle.events is None:
                handle.events = asyncio.create_task(
                    self._follow_kv_events(handle.address), name=f"kv events {handle.name}"
                )
            elif not choosing and handle.events is not None:
                handle.events.cancel()
                handle.events = None
                self.router.forget_cache(handle.name)

    async def _follow_kv_events(self, address: ReplicaAddress) -> None:
        assert self.router is not None
        channel = internal_channel(address.scheduler_addr, self._security)
        try:
            await follow_kv_events(
                self.router, address.name, scheduler_pb2_grpc.KVEventsStub(channel)
            )
        finally:
            await channel.close()

    async def _leave(self, name: str, reason: str) -> None:
        joining = self._joining.pop(name, None)
        if joining is not None:
            joining.cancel()
        handle = self._replicas.pop(name, None)
        if handle is None:
            return
        for task in handle.tasks:
            task.cancel()
        if handle.events is not None:
            handle.events.cancel()
        if self.router is not None:
            self.router.remove_replica(name)
            self._routable_count_changed()
            self._follow_kv_events_while_choosing()
        handle.client.fail_in_flight(f"engine replica {name} is gone: {reason}")
        logger.warning("replica %s left: %s", name, reason)
        # Let the aborts of its requests go out before its channel closes.
        self._in_background(_close_later(handle.client))

    # ---- readiness -------------------------------------------------------------

    async def _probe(self, handle: ReplicaHandle) -> bool:
        """Ask the replica whether it takes requests; route to it (or not) by the answer."""
        assert self.router is not None
        ready = True
        try:
            await asyncio.wait_for(handle.client.check_ready(), PROBE_TIMEOUT_S)
        except (UnavailableError, TimeoutError) as error:
            ready = False
            if self.router.has_replica(handle.name) and self.router.replica(handle.name).routable:
                logger.warning("replica %s not ready: %s", handle.name, error)
        self._set_routable(handle.name, ready)
        if ready:
            self._first_ready.set()
        return ready

    async def _probe_forever(self, handle: ReplicaHandle) -> None:
        loop = asyncio.get_running_loop()
        while True:
            handle.probe_now.clear()
            started = loop.time()
            ready = await self._probe(handle)
            # A replica that is down is looked at often: its return is what
            # waiting requests wait for.
            period = (
                self._probe_period_s if ready else min(self._probe_period_s, FAST_PROBE_PERIOD_S)
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(handle.probe_now.wait(), period)
            # Never faster than the fast period: a replica that passes probes but
            # refuses requests must not spin a probe-refuse loop.
            await asyncio.sleep(max(0.0, started + FAST_PROBE_PERIOD_S / 2 - loop.time()))

    def _connection_changed(self, handle: ReplicaHandle, up: bool) -> None:
        """The replica's client saw its streams break (``up`` False) or come back."""
        if not up and self.router is not None and self.router.has_replica(handle.name):
            self._set_routable(handle.name, False)
        handle.probe_now.set()

    def _set_routable(self, name: str, routable: bool) -> None:
        assert self.router is not None
        if self.router.has_replica(name):
            self.router.set_routable(name, routable)
        self._routable_count_changed()

    def _routable_count_changed(self) -> None:
        assert self.router is not None
        ROUTABLE_REPLICAS.set(self.router.num_routable)
        if self.router.num_routable:
            self._any_routable.set()
        else:
            self._any_routable.clear()

    async def check_ready(self) -> None:
        """Ready when a routable replica says so now: a request sent next is routed.

        The replicas are asked, not the router's last probe, which may predate a
        stage's death by a poll period; one that fails leaves the picks.
        """
        if self.router is None:
            raise UnavailableError("no engine replica is ready")
        routable = [
            handle for name, handle in self._replicas.items() if self.router.replica(name).routable
        ]
        for handle in routable:
            if await self._probe(handle):
                return
            handle.probe_now.set()  # down: its prober switches to the fast period now
        raise UnavailableError("no engine replica is ready")

    async def _wait_for_routable(self, deadline: float) -> None:
        """Wait until a replica is routable or ``deadline`` (loop time) passes
        (then UnavailableError)."""
        loop = asyncio.get_running_loop()
        while self.router is None or not self.router.num_routable:
            left = deadline - loop.time()
            if left <= 0:
                raise UnavailableError(
                    "no engine replica is ready"
                    + (
                        f" (waited {self._wait_for_replica_s:g}s, --migration-timeout-s)"
                        if self._wait_for_replica_s
                        else ""
                    )
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._any_routable.wait(), left)

    # ---- requests --------------------------------------------------------------

    def _route(self, request: GenerationRequest) -> tuple[ReplicaHandle, RoutingDecision]:
        if self.router is None:
            raise UnavailableError("no engine replica is ready")
        with span_or_nothing(self._tracing, "route") as span:
            decision = self.router.pick(request.prompt_token_ids, request.cache_salt)
            if span is not None:
                span.set_attributes(
                    {
                        "kvmesh.replica": decision.replica,
                        "kvmesh.routing_reason": decision.reason.value,
                        "kvmesh.num_overlap_blocks": decision.num_overlap_blocks,
                    }
                )
        ROUTER_DECISIONS.labels(decision.replica, self._policy, decision.reason.value).inc()
        return self._replicas[decision.replica], decision

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        rid = request.request_id
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._wait_for_replica_s
        # When it first found no replica to take it (None: it never waited).
        waiting_since: float | None = None
        # Each refusal takes one replica out of the picks until a probe after
        # it passes; with none left, the request waits for one until the deadline.
        while True:
            if self.router is None or not self.router.num_routable:
                waiting_since = waiting_since or loop.time()
                try:
                    await self._wait_for_routable(deadline)
                except BaseException:
                    self._count_wait(loop.time() - waiting_since)
                    raise
            handle, decision = self._route(request)
            stream = handle.client.generate(request)
            self._owner[rid] = handle
            try:
                first = await anext(stream)
            except UnavailableError as error:
                self._owner.pop(rid, None)
                logger.warning("request %s: replica %s refused it (%s)", rid, handle.name, error)
                self._set_routable(handle.name, False)
                handle.probe_now.set()
                continue
            except BaseException:
                self._owner.pop(rid, None)
                await stream.aclose()
                raise
            if waiting_since is not None:
                self._count_wait(loop.time() - waiting_since)
            logger.debug(
                "request %s -> %s (%s, %d/%d blocks cached)",
                rid,
                decision.replica,
                decision.reason.value,
                decision.num_overlap_blocks,
                decision.num_cacheable_blocks,
            )
            try:
                yield first
                async for delta in stream:
                    yield delta
            finally:
                self._owner.pop(rid, None)
                await stream.aclose()
            return

    @staticmethod
    def _count_wait(seconds: float) -> None:
        REPLICA_WAITS.inc()
        REPLICA_WAIT_SECONDS.observe(seconds)

    async def abort(self, request_id: str) -> None:
        handle = self._owner.get(request_id)
        if handle is not None:
            await handle.client.abort(request_id)

    def _in_background(self, work: Coroutine[object, object, None]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


async def _close_later(client: GrpcEngineClient, grace_s: float = 1.0) -> None:
    await asyncio.sleep(grace_s)
    with contextlib.suppress(Exception):
        await client.close()
