"""KVStoreClient failure behaviour: clear KVStoreErrors, timeouts, damaged streams."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from kvmesh.kvstore.block import crc32
from kvmesh.kvstore.client import KVStoreClient, KVStoreError, _BlockStreamReader
from kvmesh.kvstore.layout import KVLayout
from kvmesh.protos import kvstore_pb2

LAYOUT = KVLayout("m", "bfloat16", 16, 1)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_unreachable_store_raises_kvstore_error_within_the_timeout() -> None:
    async with KVStoreClient(f"127.0.0.1:{_closed_port()}", timeout_s=0.5) as client:
        start = time.monotonic()
        with pytest.raises(KVStoreError, match=r"LookupPrefix: (UNAVAILABLE|DEADLINE_EXCEEDED)"):
            await client.lookup_prefix([LAYOUT], [b"h"])
        with pytest.raises(KVStoreError, match="PutBlocks"):
            await client.put_blocks(LAYOUT, [(b"h", b"data")])
        with pytest.raises(KVStoreError, match="GetBlocks"):
            await client.get_blocks(LAYOUT, [b"h"])
        assert time.monotonic() - start < 5


async def test_hung_store_times_out() -> None:
    # A listener that accepts and never speaks HTTP/2.
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server, KVStoreClient(f"127.0.0.1:{port}", timeout_s=0.3) as client:
        start = time.monotonic()
        with pytest.raises(KVStoreError):
            await client.stats()
        assert time.monotonic() - start < 3


def _header(*found: bool) -> kvstore_pb2.GetBlocksChunk:
    return kvstore_pb2.GetBlocksChunk(header=kvstore_pb2.GetBlocksHeader(found=found))


def _begin(
    block_hash: bytes, data: bytes, checksum: int, size: int | None = None
) -> kvstore_pb2.GetBlocksChunk:
    """A block's first message carrying ``data`` (of ``size`` bytes in all, default len(data))."""
    size = len(data) if size is None else size
    begin = kvstore_pb2.BlockBegin(block_hash=block_hash, size=size, crc32=checksum)
    return kvstore_pb2.GetBlocksChunk(begin=begin, data=data)


def test_reader_reassembles_chunks_and_drops_a_block_failing_its_crc() -> None:
    reader = _BlockStreamReader([b"a", b"b", b"c"])
    reader.feed(_header(True, False, True))
    reader.feed(_begin(b"a", b"xx", crc32(b"xxyy"), size=4))
    reader.feed(kvstore_pb2.GetBlocksChunk(data=b"yy"))
    reader.feed(_begin(b"c", b"zz", crc32(b"zz") ^ 1))  # damaged in transit
    assert reader.finish() == [b"xxyy", None, None]


@pytest.mark.parametrize(
    "messages",
    [
        [],  # no header
        [_header(True)],  # announced block never came
        [_header(True), _begin(b"a", b"x", 0, size=2)],  # block cut short
        [_header(False), _begin(b"a", b"x", crc32(b"x"))],  # block not announced
        [_header(True), _begin(b"b", b"x", crc32(b"x"))],  # another block than asked
        [_header(True), kvstore_pb2.GetBlocksChunk(data=b"x")],  # data outside a block
    ],
)
def test_reader_rejects_broken_streams(messages: list) -> None:
    reader = _BlockStreamReader([b"a"])
    with pytest.raises(KVStoreError):
        for message in messages:
            reader.feed(message)
        reader.finish()
