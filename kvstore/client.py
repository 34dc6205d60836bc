"""Asyncio client of the kvstore, for the KV connector in the worker and the scheduler.

The kvstore is a cache. CALLERS MUST TREAT ANY ERROR AS A MISS and go on:
a failed ``lookup_prefix`` means no stored prefix, a failed ``get_blocks``
means recompute those blocks, a failed ``put_blocks`` means they were not
stored, a failed ``lease`` means nothing is pinned. No failure of the store
may fail a request. Every method raises ``KVStoreError`` (and nothing else)
on failure, with the RPC and the reason in its message, and gives up after
its timeout (the client's ``timeout_s`` unless the call passes its own).

Blocks are keyed by (layout, block hash): the same hash under another
``KVLayout`` is another block (kvstore/layout.py). Bytes travel in chunks of
at most ``CHUNK_BYTES``, each block with a CRC-32 that the server checks
before committing it and this client checks before returning it, so a block
is only ever returned whole and intact.

    async with KVStoreClient("127.0.0.1:50055") as kv:
        n = await kv.lookup_prefix([layout], hashes)
        result = await kv.get_blocks(layout, hashes[:n], lease_ttl_s=30)
        ...
        if result.lease is not None:
            await kv.release(result.lease.lease_id)
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType

import grpc

from kvmesh.kvstore.block import CHUNK_BYTES, PutOutcome, crc32
from kvmesh.kvstore.layout import KVLayout
from kvmesh.protos import kvstore_pb2, kvstore_pb2_grpc
from kvmesh.services.runtime.grpc_security import NO_INTERNAL_AUTH, InternalSecurity
from kvmesh.services.runtime.grpc_server import internal_channel

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0
# Anything a block can be given as: its bytes, or a buffer over them (e.g. a
# numpy array or a CPU tensor's memory), sent without a full copy up front.
BlockData = bytes | bytearray | memoryview
_KNOWN_OUTCOMES = {int(outcome) for outcome in PutOutcome}


class KVStoreError(Exception):
    """A kvstore call failed (unreachable, timed out, refused, or a broken stream)."""


@dataclass(frozen=True)
class Lease:
    """A lease on blocks; release it with ``KVStoreClient.release(lease_id)``."""

    lease_id: int
    # Per requested hash: whether the lease pins that block.
    leased: tuple[bool, ...]


@dataclass(frozen=True)
class GetResult:
    # Per requested hash: the block's bytes, or None (not stored, or corrupt).
    blocks: list[bytes | None]
    # The lease asked for with lease_ttl_s > 0, else None.
    lease: Lease | None


class KVStoreClient:
    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        chunk_bytes: int = CHUNK_BYTES,
        security: InternalSecurity = NO_INTERNAL_AUTH,
    ) -> None:
        self.address = address
        self._timeout_s = timeout_s
        self._chunk_bytes = chunk_bytes
        self._channel = internal_channel(address, security)
        self._stub = kvstore_pb2_grpc.KVStoreStub(self._channel)

    async def __aenter__(self) -> KVStoreClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def lookup_prefix(
        self,
        layouts: Sequence[KVLayout],
        block_hashes: Sequence[bytes],
        *,
        timeout_s: float | None = None,
    ) -> int:
        """How many leading ``block_hashes`` are stored under every layout in ``layouts``.

        Pass every TP rank's layout to learn the prefix all ranks can load.
        Moves no bytes.
        """
        request = kvstore_pb2.LookupPrefixRequest(
            layouts=[layout.to_proto() for layout in layouts], block_hashes=block_hashes
        )
        with _rpc_errors("LookupPrefix"):
            reply = await self._stub.LookupPrefix(request, timeout=self._timeout(timeout_s))
        return reply.num_prefix_blocks

    async def put_blocks(
        self,
        layout: KVLayout,
        blocks: Sequence[tuple[bytes, BlockData]],
        *,
        timeout_s: float | None = None,
    ) -> list[PutOutcome]:
        """Store (block_hash, bytes) pairs; one PutOutcome per block, in order.

        Each block is put in two phases (begin, bytes, commit with its
        CRC-32): the store makes it visible only once all of it arrived
        intact. If this call fails midway, blocks already committed stay
        stored and the one in transit leaves nothing.
        """
        messages = _put_messages(layout.to_proto(), blocks, self._chunk_bytes)
        with _rpc_errors("PutBlocks"):
            reply = await self._stub.PutBlocks(messages, timeout=self._timeout(timeout_s))
        if len(reply.outcomes) != len(blocks) or not set(reply.outcomes) <= _KNOWN_OUTCOMES:
            raise KVStoreError(
                f"PutBlocks: outcomes {list(reply.outcomes)} for {len(blocks)} blocks"
            )
        return [PutOutcome(outcome) for outcome in reply.outcomes]

    async def get_blocks(
        self,
        layout: KVLayout,
        block_hashes: Sequence[bytes],
        *,
        lease_ttl_s: float = 0.0,
        timeout_s: float | None = None,
    ) -> GetResult:
        """Fetch blocks (None for those not stored), each checked against its CRC-32.

        With ``lease_ttl_s`` > 0 the found blocks are also leased: pinned in
        the store's memory for that long, or until released.
        """
        request = kvstore_pb2.GetBlocksRequest(
            layout=layout.to_proto(), block_hashes=block_hashes, lease_ttl_seconds=lease_ttl_s
        )
        reader = _BlockStreamReader(block_hashes)
        call = self._stub.GetBlocks(request, timeout=self._timeout(timeout_s))
        with _rpc_errors("GetBlocks"):
            try:
                async for message in call:
                    reader.feed(message)
            except KVStoreError:
                call.cancel()  # a broken stream: stop the server sending the rest
                raise
        blocks = reader.finish()
        lease = None
        if lease_ttl_s > 0:
            lease = Lease(reader.header.lease_id, tuple(reader.header.leased))
        return GetResult(blocks, lease)

    async def lease(
        self,
        layout: KVLayout,
        block_hashes: Sequence[bytes],
        ttl_s: float,
        *,
        timeout_s: float | None = None,
    ) -> Lease:
        """Pin stored blocks in the store's memory for ``ttl_s`` seconds (or until released)."""
        request = kvstore_pb2.LeaseBlocksRequest(
            layout=layout.to_proto(), block_hashes=block_hashes, ttl_seconds=ttl_s
        )
        with _rpc_errors("LeaseBlocks"):
            reply = await self._stub.LeaseBlocks(request, timeout=self._timeout(timeout_s))
        return Lease(reply.lease_id, tuple(reply.leased))

    async def release(self, lease_id: int, *, timeout_s: float | None = None) -> bool:
        """End a lease early; False if it had already ended."""
        request = kvstore_pb2.ReleaseLeaseRequest(lease_id=lease_id)
        with _rpc_errors("ReleaseLease"):
            reply = await self._stub.ReleaseLease(request, timeout=self._timeout(timeout_s))
        return reply.released

    async def delete(
        self, layout: KVLayout, block_hashes: Sequence[bytes], *, timeout_s: float | None = None
    ) -> int:
        """Drop blocks from every tier; returns the copies dropped."""
        request = kvstore_pb2.DeleteBlocksRequest(
            layout=layout.to_proto(), block_hashes=block_hashes
        )
        with _rpc_errors("DeleteBlocks"):
            reply = await self._stub.DeleteBlocks(request, timeout=self._timeout(timeout_s))
        return reply.num_deleted

    async def stats(self, *, timeout_s: float | None = None) -> kvstore_pb2.KVStoreStats:
        with _rpc_errors("GetStats"):
            return await self._stub.GetStats(
                kvstore_pb2.GetStatsRequest(), timeout=self._timeout(timeout_s)
            )

    def _timeout(self, timeout_s: float | None) -> float:
        return self._timeout_s if timeout_s is None else timeout_s


@contextlib.contextmanager
def _rpc_errors(method: str) -> Iterator[None]:
    try:
        yield
    except grpc.aio.AioRpcError as e:
        raise KVStoreError(f"kvstore {method}: {e.code().name}: {e.details()}") from e
    except grpc.aio.UsageError as e:
        raise KVStoreError(f"kvstore {method}: {e}") from e


def _put_messages(
    layout: kvstore_pb2.KVLayout, blocks: Sequence[tuple[bytes, BlockData]], chunk_bytes: int
) -> Iterator[kvstore_pb2.PutChunk]:
    """Each block as begin + data chunks + commit (one message when it fits a chunk)."""
    first = True
    for block_hash, data in blocks:
        view = memoryview(data).cast("B")
        size = view.nbytes
        checksum = 0
        for offset in range(0, max(size, 1), chunk_bytes):
            end = min(offset + chunk_bytes, size)
            piece = (
                data
                if isinstance(data, bytes) and end - offset == size
                else bytes(view[offset:end])
            )
            checksum = crc32(piece, checksum)
            message = kvstore_pb2.PutChunk(data=piece)
            if first:
                message.layout.CopyFrom(layout)
                first = False
            if offset == 0:
                message.begin.block_hash = block_hash
                message.begin.size = size
            if end == size:
                message.commit.crc32 = checksum
            yield message


class _BlockStreamReader:
    """Reassembles a GetBlocks stream: header, then each found block's chunks."""

    def __init__(self, block_hashes: Sequence[bytes]) -> None:
        self._hashes = block_hashes
        self.header: kvstore_pb2.GetBlocksHeader | None = None
        self._blocks: list[bytes | None] = [None] * len(block_hashes)
        self._pending: Iterator[int] = iter(())
        # The block being received: (index, size, crc32, chunks, bytes so far).
        self._index = -1
        self._begin: kvstore_pb2.BlockBegin | None = None
        self._chunks: list[bytes] = []
        self._received = 0

    def feed(self, message: kvstore_pb2.GetBlocksChunk) -> None:
        if self.header is None:
            if not message.HasField("header") or len(message.header.found) != len(self._hashes):
                raise KVStoreError("GetBlocks: stream did not start with a matching header")
            self.header = message.header
            self._pending = (i for i, found in enumerate(message.header.found) if found)
            return
        if message.HasField("begin"):
            if self._begin is not None:
                raise KVStoreError("GetBlocks: a block began before the previous one ended")
            self._index = next(self._pending, -1)
            if self._index < 0 or message.begin.block_hash != self._hashes[self._index]:
                raise KVStoreError("GetBlocks: block out of order or not announced")
            self._begin = message.begin
        if self._begin is None:
            raise KVStoreError("GetBlocks: data outside a block")
        self._chunks.append(message.data)
        self._received += len(message.data)
        if self._received > self._begin.size:
            raise KVStoreError("GetBlocks: more bytes than the block's size")
        if self._received == self._begin.size:
            self._complete()

    def finish(self) -> list[bytes | None]:
        if self.header is None or self._begin is not None or next(self._pending, -1) >= 0:
            raise KVStoreError("GetBlocks: stream ended before every announced block arrived")
        return self._blocks

    def _complete(self) -> None:
        assert self._begin is not None
        data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        if crc32(data) == self._begin.crc32:
            self._blocks[self._index] = data
        else:
            # Treated as a miss: never hand damaged KV to the caller.
            logger.warning(
                "GetBlocks: block %s failed its CRC-32; dropped", self._begin.block_hash.hex()
            )
        self._begin = None
        self._chunks = []
        self._received = 0
