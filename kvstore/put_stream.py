"""One PutBlocks stream applied to the store: begin, data, commit per block.

The stream holds at most one open block. Whatever ends the stream before
that block's commit (the client cancels or disconnects, a deadline passes, a
protocol error) must lead to ``close()``, which aborts it, so the store keeps
nothing of it. Blocks committed earlier in the stream stay stored: each block
is its own transaction.
"""

from __future__ import annotations

import logging

from kvmesh.kvstore.block import PutOutcome
from kvmesh.kvstore.layout import KVLayout
from kvmesh.kvstore.pending_put import PendingPut
from kvmesh.kvstore.tiered import TieredStore
from kvmesh.protos import kvstore_pb2
from kvmesh.services.contracts.errors import InvalidRequestError

logger = logging.getLogger(__name__)


class _OpenBlock:
    """The block between its begin and its commit. ``pending`` is None when the
    store had no room: its bytes are then received and dropped."""

    __slots__ = ("pending", "received", "size")

    def __init__(self, pending: PendingPut | None, size: int) -> None:
        self.pending = pending
        self.size = size
        self.received = 0


class PutStream:
    def __init__(self, store: TieredStore) -> None:
        self._store = store
        self._layout: KVLayout | None = None
        self._open: _OpenBlock | None = None
        self.outcomes: list[PutOutcome] = []
        self.bytes_received = 0

    def feed(self, chunk: kvstore_pb2.PutChunk) -> None:
        """Apply one message; InvalidRequestError on a protocol violation."""
        if self._layout is None:
            if not chunk.HasField("layout"):
                raise InvalidRequestError("the first PutChunk must carry the layout")
            self._layout = KVLayout.from_proto(chunk.layout)
        if chunk.HasField("begin"):
            self._begin(chunk.begin)
        if chunk.data:
            self._write(chunk.data)
        if chunk.HasField("commit"):
            self._commit(chunk.commit.crc32)

    def close(self) -> None:
        """End the stream: abort the block still open, if any."""
        block, self._open = self._open, None
        if block is not None and block.pending is not None:
            logger.info(
                "put of block %s aborted after %s of %s bytes",
                block.pending.key.hex(),
                block.received,
                block.size,
            )
            self._store.abort_put(block.pending)

    def _begin(self, begin: kvstore_pb2.PutBegin) -> None:
        if self._open is not None:
            raise InvalidRequestError("PutBegin while another block is open (commit it first)")
        assert self._layout is not None
        key = self._layout.block_key(begin.block_hash)
        self._open = _OpenBlock(self._store.begin_put(key, begin.size), begin.size)

    def _write(self, data: bytes) -> None:
        block = self._open
        if block is None:
            raise InvalidRequestError("PutChunk data outside a block (no PutBegin)")
        self.bytes_received += len(data)
        if block.received + len(data) > block.size:
            raise InvalidRequestError(
                f"block declared {block.size} bytes; {block.received + len(data)} sent"
            )
        block.received += len(data)
        if block.pending is not None:
            block.pending.write(data)

    def _commit(self, crc32: int) -> None:
        block, self._open = self._open, None
        if block is None:
            raise InvalidRequestError("PutCommit without an open block")
        if block.pending is None:
            self.outcomes.append(PutOutcome.NO_ROOM)
        else:
            self.outcomes.append(self._store.commit_put(block.pending, crc32))
