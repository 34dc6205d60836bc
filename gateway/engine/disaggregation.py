"""Prefill/decode disaggregation, gateway side: each prompt goes to the prefill replica first.

With ``--prefill-scheduler-addr`` (set by ``kvmesh up --disaggregated``) the
gateway asks the prefill replica's scheduler to compute a request's prompt
(``Scheduler.Prefill``) before it submits the request to its own scheduler,
the decode replica, which the detokenizer streams from. The prefill answers
with the kvstore leases its blocks wait under (``KVTransferParams``); they
travel in ``AddRequestRequest.kv_transfer``, the decode scheduler finds the
blocks in the store as any stored prefix, loads them and ends the leases.

A prefill is an optimisation, never a dependency: any failure (prefill replica
down, overloaded, slow past ``timeout_s``, its worker lost) only means the
decode replica computes the prompt itself, with the same output.

A client that goes away during the prefill does not cancel the call: the
prefill replica may already hold a lease whose id only its answer carries (a
cancelled call loses it, and the blocks stay pinned for the whole TTL). The
gateway aborts the request there instead (``abort``), which ends the compute,
and waits for the answer in the background; a transfer that still arrives is
admitted to the decode replica and aborted, which ends its leases
(``GrpcEngineClient._abandon_prefill``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import grpc
from prometheus_client import Counter

from kvmesh.protos import scheduler_pb2, scheduler_pb2_grpc
from kvmesh.services.contracts.errors import error_from_rpc
from kvmesh.services.runtime.grpc_security import NO_INTERNAL_AUTH, InternalSecurity
from kvmesh.services.runtime.grpc_server import internal_channel

logger = logging.getLogger(__name__)

_PREFILLS = Counter(
    "kvmesh:gateway_prefills",
    "prefills asked of the prefill replica, by outcome: transferred (KV handed to the decode "
    "replica), nothing_to_transfer (no full block to hand over), failed (the decode replica "
    "computes the prompt), abandoned (the client went away first)",
    ["outcome"],
)


class PrefillClient:
    """Asks one prefill replica's scheduler for the KV of each prompt."""

    def __init__(
        self,
        address: str,
        timeout_s: float,
        security: InternalSecurity = NO_INTERNAL_AUTH,
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
    ) -> None:
        """``interceptors``: the tracing ones, so a traced prompt's Prefill call
        joins its request's trace."""
        self.address = address
        self.timeout_s = timeout_s
        self._channel = internal_channel(address, security, interceptors)
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        # Warn once per outage, not once per request.
        self._failing = False
        # Requests whose caller went away: their calls end quietly.
        self._abandoned: set[str] = set()

    async def close(self) -> None:
        await self._channel.close()

    async def prefill(
        self, msg: scheduler_pb2.AddRequestRequest
    ) -> scheduler_pb2.KVTransferParams | None:
        """The KV transfer for ``msg``'s prompt, or None: the decode replica computes it.

        Never raises but ``CancelledError`` (the caller went away).
        """
        request = scheduler_pb2.PrefillRequest(
            request_id=msg.request_id, prompt_token_ids=msg.prompt_token_ids, priority=msg.priority
        )
        if msg.HasField("cache_salt"):
            request.cache_salt = msg.cache_salt
        if msg.HasField("parallel_group"):
            request.parallel_group = msg.parallel_group
        try:
            reply = await self._stub.Prefill(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            if self._ends_abandoned(msg.request_id):
                return None
            _PREFILLS.labels("failed").inc()
            error = error_from_rpc(exc)
            log = logger.info if self._failing else logger.warning
            log(
                "request %s: prefill replica %s failed (%s: %s); the decode replica computes it",
                msg.request_id,
                self.address,
                error.kind.name,
                error.message,
            )
            self._failing = True
            return None
        self._failing = False
        if self._ends_abandoned(msg.request_id):
            return reply.kv_transfer if reply.kv_transfer.lease_ids else None
        transfer = reply.kv_transfer
        if transfer.num_stored_tokens <= 0:
            _PREFILLS.labels("nothing_to_transfer").inc()
            return None
        _PREFILLS.labels("transferred").inc()
        return transfer

    def _ends_abandoned(self, request_id: str) -> bool:
        """Whether the call for ``request_id`` was abandoned (then counted so, once)."""
        if request_id not in self._abandoned:
            return False
        self._abandoned.discard(request_id)
        _PREFILLS.labels("abandoned").inc()
        return True

    async def abort(self, request_id: str) -> None:
        """Stop computing ``request_id``'s prompt (its caller went away); its
        ``prefill`` call then ends, with a transfer if the prompt was done."""
        self._abandoned.add(request_id)
        try:
            await self._stub.AbortRequests(
                scheduler_pb2.AbortRequestsRequest(request_ids=[request_id]), timeout=10
            )
        except grpc.aio.AioRpcError as exc:
            logger.info("request %s: prefill abort failed: %s", request_id, exc.details())
