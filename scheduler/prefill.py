"""``Scheduler.Prefill``: compute a prompt's KV for another replica and hand it over.

The prefill replica of prefill/decode disaggregation (``kvmesh up
--disaggregated``) runs each prompt it is given as an ordinary request with a
one-token budget, whose output nobody sees. With the KV connector on, every
block it fills is saved to the kvstore; the call answers once the request
finished AND every block the decode replica can use was reported saved (or
failed) by the worker, with those blocks leased in the store so that nothing
evicts them before the decode replica loads them:

1. the prompt is looked up in the store (a prefix stored there is loaded, as
   for any request) and queued with ``max_tokens=1``, published to nobody;
2. its one output (or its error) comes to ``take_outputs`` instead of the
   subscribers;
3. the connector's wait for the saves of its loadable blocks: the first
   ``(len(prompt) - 1) // block_size``, since the decode replica recomputes
   the last prompt token for its logits and so never loads a block holding
   it; the service loop keeps stepping while the wait is open;
4. the blocks are leased and the lease is the answer.

A caller that goes away (cancels the call) aborts the request, or drops the
wait. Every failure is an error of the call, which the gateway answers by
letting the decode replica compute the prompt.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Protocol

from kvmesh.protos import scheduler_pb2
from kvmesh.scheduler.kv_connector import KVConnectorScheduler
from kvmesh.scheduler.kv_leases import StoreLeases
from kvmesh.scheduler.output import RequestOutput
from kvmesh.scheduler.request import Request
from kvmesh.services.contracts.errors import InvalidRequestError, UnavailableError
from kvmesh.services.contracts.finish_reason import FinishReason
from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.services.contracts.step_codec import sampling_params_to_proto

logger = logging.getLogger(__name__)

# One greedy token that nobody reads: the prompt's KV is the product.
_PREFILL_SAMPLING = sampling_params_to_proto(
    SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
)


@dataclass
class _Prefill:
    request: Request
    # Leading prompt blocks the decode replica can load (the ones to save).
    num_loadable: int
    # Resolved once the request finished and its saves settled.
    done: asyncio.Future[None]
    # Finished; waiting for its saves (outputs are no longer its own).
    saving: bool = False


class PrefillEngine(Protocol):
    """What a prefill needs of the engine it runs on (``SchedulerEngine`` in
    scheduler/service.py, which owns the runner: a protocol, so the two do
    not import each other)."""

    async def lookup_stored_prefix(self, msg: scheduler_pb2.AddRequestRequest) -> None: ...

    def add_request(self, msg: scheduler_pb2.AddRequestRequest, publish: bool = True) -> Request:
        """Queue a request; ``publish=False`` keeps its outputs from the subscribers."""
        ...

    def abort(self, request_ids: list[str]) -> list[str]: ...


class PrefillRunner:
    """Serves ``Scheduler.Prefill`` on one engine (needs ``--kv-offload``).

    ``connector`` is the engine core's (None: the KV connector is off).
    """

    def __init__(
        self,
        engine: PrefillEngine,
        connector: KVConnectorScheduler | None,
        block_size: int,
        leases: StoreLeases | None,
    ) -> None:
        self.engine = engine
        self.connector = connector
        self.block_size = block_size
        self.leases = leases
        self._prefills: dict[str, _Prefill] = {}

    @property
    def num_in_flight(self) -> int:
        return len(self._prefills)

    async def prefill(self, msg: scheduler_pb2.PrefillRequest) -> scheduler_pb2.PrefillResponse:
        connector = self.connector
        if connector is None or self.leases is None:
            raise UnavailableError("this scheduler cannot prefill for others: --kv-offload is off")
        block_size = self.block_size
        num_loadable = (len(msg.prompt_token_ids) - 1) // block_size
        if msg.prompt_token_ids and num_loadable == 0:
            # No block the decode replica could load: nothing worth computing here.
            return scheduler_pb2.PrefillResponse(kv_transfer=scheduler_pb2.KVTransferParams())
        add = scheduler_pb2.AddRequestRequest(
            request_id=msg.request_id,
            prompt_token_ids=msg.prompt_token_ids,
            sampling_params=_PREFILL_SAMPLING,
            priority=msg.priority,
        )
        if msg.HasField("cache_salt"):
            add.cache_salt = msg.cache_salt
        if msg.HasField("parallel_group"):
            add.parallel_group = msg.parallel_group
        await self.engine.lookup_stored_prefix(add)
        if msg.request_id in self._prefills:  # finished, still saving: not in the core
            raise InvalidRequestError(f"request id {msg.request_id!r} is already in use")
        request = self.engine.add_request(add, publish=False)
        prefill = self._prefills[msg.request_id] = _Prefill(
            request, num_loadable, asyncio.get_running_loop().create_future()
        )
        try:
            await prefill.done
        except asyncio.CancelledError:
            self._abandon(prefill)
            raise
        finally:
            del self._prefills[msg.request_id]
        hashes = request.block_hashes[:num_loadable]
        lease_ids, num_blocks = await self.leases.lease(hashes)
        logger.info(
            "request %s: prefilled; %d of %d prompt blocks stored and leased",
            msg.request_id,
            num_blocks,
            num_loadable,
        )
        return scheduler_pb2.PrefillResponse(
            kv_transfer=scheduler_pb2.KVTransferParams(
                lease_ids=lease_ids, num_stored_tokens=num_blocks * block_size
            )
        )

    def _abandon(self, prefill: _Prefill) -> None:
        """The caller went away: abort the request, or stop waiting for its saves."""
        request_id = prefill.request.request_id
        if prefill.saving:
            connector = self.connector
            assert connector is not None
            connector.cancel_save_wait(request_id)
        else:
            self.engine.abort([request_id])
        logger.info("request %s: prefill abandoned by its caller", request_id)

    def take_outputs(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Keep the outputs of prefills (called after every step, before publishing);
        returns the others. Also completes prefills whose saves settled."""
        connector = self.connector
        if connector is None:
            return outputs
        kept = [out for out in outputs if not self._take(out)] if self._prefills else outputs
        for request_id in connector.pop_settled_save_waits():
            prefill = self._prefills.get(request_id)
            if prefill is not None and not prefill.done.done():
                prefill.done.set_result(None)
        return kept

    def _take(self, out: RequestOutput) -> bool:
        prefill = self._prefills.get(out.request_id)
        if prefill is None or prefill.saving:
            return False
        if out.finish_reason is None:
            return True  # more prompt to go (cannot happen with one token, but harmless)
        if out.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
            prefill.done.set_exception(
                UnavailableError(f"prefill failed: {out.error or 'aborted'}")
            )
            return True
        request = prefill.request
        connector = self.connector
        assert connector is not None
        prefill.saving = True
        if connector.wait_for_saves(
            request.request_id, request.block_hashes[: prefill.num_loadable]
        ):
            prefill.done.set_result(None)
        return True
