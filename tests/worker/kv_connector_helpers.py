"""Test doubles for the worker's KV connector: an in-memory store and an event-loop thread."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

from kvmesh.services.contracts.step import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVTransfer,
    SchedulerOutput,
)
from kvmesh.worker.kv_cache import KVCache
from kvmesh.worker.kv_connector import KVConnectorWorker


class InMemoryKVBlockStore:
    """A ``KVBlockStore`` (one layout) in a dict, with switches for the failures a real
    store has."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, bytes] = {}
        # Raised by every call while set (a store that is down).
        self.error: Exception | None = None
        # Seconds every get waits before answering (a slow store).
        self.get_delay_s = 0.0
        # While set, puts wait for it (a store that does not answer yet).
        self.put_gate: asyncio.Event | None = None

    async def get_blocks(self, hashes: list[bytes]) -> list[bytes | None]:
        if self.get_delay_s:
            await asyncio.sleep(self.get_delay_s)
        if self.error is not None:
            raise self.error
        return [self.blocks.get(block_hash) for block_hash in hashes]

    async def put_blocks(self, hashes: list[bytes], datas: list[bytes]) -> list[bool]:
        if self.put_gate is not None:
            await self.put_gate.wait()
        if self.error is not None:
            raise self.error
        for block_hash, data in zip(hashes, datas, strict=True):
            self.blocks[block_hash] = data
        return [True] * len(hashes)


@contextmanager
def loop_thread() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop running on its own thread, as the worker's gRPC loop does."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-loop", daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def drain(connector: KVConnectorWorker) -> None:
    """Block until every fetch and put the connector started has finished."""
    asyncio.run_coroutine_threadsafe(connector.drain(), connector.loop).result(timeout=30)


def connector_step(
    connector: KVConnectorWorker,
    loads: Iterable[KVTransfer] = (),
    saves: Iterable[KVTransfer] = (),
    finished_req_ids: Iterable[str] = (),
) -> KVConnectorOutput:
    """One step's connector work alone (what execute_model does around its forward)."""
    scheduler_output = SchedulerOutput.make_empty()
    scheduler_output.kv_connector_metadata = KVConnectorMetadata(list(loads), list(saves))
    scheduler_output.finished_req_ids = set(finished_req_ids)
    connector.start_step(scheduler_output)
    return connector.get_finished()


def settle(connector: KVConnectorWorker, output: KVConnectorOutput) -> KVConnectorOutput:
    """``output`` plus what the next step reports once its store calls have finished.

    A fast store may finish a put before ``get_finished`` of the very step that
    started it, so a test must read both reports.
    """
    drain(connector)
    later = connector_step(connector)
    return KVConnectorOutput(
        finished_loads={**output.finished_loads, **later.finished_loads},
        saved_block_hashes=output.saved_block_hashes + later.saved_block_hashes,
        failed_save_hashes=output.failed_save_hashes + later.failed_save_hashes,
    )


def block_hashes(name: str, count: int) -> list[bytes]:
    return [hashlib.sha256(f"{name}/{i}".encode()).digest() for i in range(count)]


def random_kv_caches(
    dtype: torch.dtype, num_blocks: int = 8, num_layers: int = 3, seed: int = 0
) -> list[KVCache]:
    """Small caches ``[num_blocks, block_size=4, kv_heads=2, head_dim=8]`` full of noise."""
    generator = torch.Generator().manual_seed(seed)
    shape = (num_blocks, 4, 2, 8)
    return [
        (
            torch.randn(shape, generator=generator).to(dtype),
            torch.randn(shape, generator=generator).to(dtype),
        )
        for _ in range(num_layers)
    ]


def block_bits(kv_caches: list[KVCache], block_id: int) -> list[torch.Tensor]:
    """A block's raw bits in every layer (K and V), for bitwise comparisons."""
    return [
        cache[block_id].contiguous().view(torch.uint8) for layer in kv_caches for cache in layer
    ]


def same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
