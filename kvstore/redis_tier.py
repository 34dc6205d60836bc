"""A Redis tier, written through and shared by every kvstore that names the same Redis.

Why write-through rather than a spill target below disk: Redis is the only
tier another host can see. Writing every committed block to it (in the
background, off the put's path) lets a kvstore on another node serve a
prefix this one computed, which is the point of a networked tier; as a spill
target it would only hold what two local tiers had already thrown away.
Redis bounds its own memory: run it with ``maxmemory`` and
``maxmemory-policy allkeys-lru`` (and a database of its own, since the block
count reported is its DBSIZE).

Each value is a record (header with size and CRC-32, then the bytes), set
with one SET, which Redis applies atomically: a reader sees a whole record or
none. Every read checks the record; a corrupt or truncated one is deleted and
counted, never served. Redis errors never reach callers: a failed read is a
miss, a failed write is logged and counted. A ``SharedTier`` (kvstore/tier.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from kvmesh.kvstore.block import CorruptBlockError, StoredBlock
from kvmesh.kvstore.tier import TierStats

logger = logging.getLogger(__name__)

KEY_PREFIX = b"kvmesh:kv:"
# Bytes of background writes allowed in flight; beyond it new writes are
# skipped (counted) so a slow Redis cannot grow the kvstore's memory.
MAX_PENDING_WRITE_BYTES = 256 << 20
# Per-command socket timeout: a hung Redis must look like a miss quickly.
DEFAULT_TIMEOUT_S = 2.0
_ERRORS = (RedisError, OSError, asyncio.TimeoutError)


@dataclass(frozen=True)
class RedisTierStats:
    # From DBSIZE and INFO memory at the last refresh().
    num_blocks: int
    bytes_used: int
    corrupt_blocks: int
    # Commands that failed (connection refused, timeout, ...).
    errors: int
    writes: int
    # Background writes dropped because MAX_PENDING_WRITE_BYTES were in flight.
    writes_skipped: int


class RedisTier:
    def __init__(self, client: aioredis.Redis, *, max_pending_bytes: int = MAX_PENDING_WRITE_BYTES):
        self._redis = client
        self._max_pending_bytes = max_pending_bytes
        self._pending: set[asyncio.Task[bool]] = set()
        self._pending_bytes = 0
        self._healthy = True
        self._num_blocks = 0
        self._bytes_used = 0
        self._corrupt_blocks = 0
        self._errors = 0
        self._writes = 0
        self._writes_skipped = 0

    @classmethod
    def from_url(cls, url: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> RedisTier:
        client = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        return cls(client)

    @property
    def name(self) -> str:
        return "redis"

    async def put(self, key: bytes, block: StoredBlock) -> bool:
        try:
            await self._redis.set(KEY_PREFIX + key, block.record_header() + block.data)
        except _ERRORS as e:
            self._failed("SET", e)
            return False
        self._succeeded()
        self._writes += 1
        return True

    def write_through(self, key: bytes, block: StoredBlock) -> None:
        """Start writing a block without waiting (skipped if too many bytes are in flight)."""
        if self._pending_bytes + block.size > self._max_pending_bytes:
            self._writes_skipped += 1
            return
        self._pending_bytes += block.size
        task = asyncio.create_task(self.put(key, block))
        self._pending.add(task)

        def done(finished: asyncio.Task[bool]) -> None:
            self._pending.discard(finished)
            self._pending_bytes -= block.size

        task.add_done_callback(done)

    async def flush(self) -> None:
        """Wait for the background writes started so far."""
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)

    async def get_many(self, keys: Sequence[bytes]) -> list[StoredBlock | None]:
        """Verified blocks in ``keys`` order (None: absent, corrupt or Redis failing)."""
        if not keys:
            return []
        records = await self._pipelined("GET", keys)
        if records is None:
            return [None] * len(keys)
        blocks: list[StoredBlock | None] = []
        corrupt = []
        for key, record in zip(keys, records, strict=True):
            if record is None:
                blocks.append(None)
                continue
            try:
                blocks.append(StoredBlock.from_record(record))
            except CorruptBlockError as e:
                logger.warning("redis tier: block %s is corrupt (%s); dropping it", key.hex(), e)
                corrupt.append(key)
                blocks.append(None)
        if corrupt:
            self._corrupt_blocks += len(corrupt)
            await self._delete(corrupt)
        return blocks

    async def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Presence of each key, in one round trip (all False while Redis fails)."""
        if not keys:
            return []
        counts = await self._pipelined("EXISTS", keys)
        if counts is None:
            return [False] * len(keys)
        return [bool(count) for count in counts]

    async def delete_many(self, keys: Sequence[bytes]) -> int:
        await self.flush()  # a write still in flight would resurrect the block
        return await self._delete(keys)

    async def _delete(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        try:
            deleted = await self._redis.delete(*(KEY_PREFIX + key for key in keys))
        except _ERRORS as e:
            self._failed("DEL", e)
            return 0
        self._succeeded()
        return int(deleted)

    async def refresh(self) -> None:
        """Read the block count and memory use (DBSIZE, INFO memory)."""
        try:
            self._num_blocks = int(await self._redis.dbsize())
            self._bytes_used = int((await self._redis.info("memory"))["used_memory"])
        except _ERRORS as e:
            self._failed("DBSIZE/INFO", e)
            return
        self._succeeded()

    def snapshot(self) -> TierStats:
        # Redis bounds itself (maxmemory): no capacity or evictions seen from here.
        return TierStats(self._num_blocks, self._bytes_used, 0, 0, self._corrupt_blocks)

    def stats(self) -> RedisTierStats:
        return RedisTierStats(
            num_blocks=self._num_blocks,
            bytes_used=self._bytes_used,
            corrupt_blocks=self._corrupt_blocks,
            errors=self._errors,
            writes=self._writes,
            writes_skipped=self._writes_skipped,
        )

    async def close(self) -> None:
        await self.flush()
        await self._redis.aclose()

    async def _pipelined(self, command: str, keys: Sequence[bytes]) -> list | None:
        """``command key`` for every key in one round trip; None if Redis failed."""
        pipe = self._redis.pipeline(transaction=False)
        for key in keys:
            pipe.execute_command(command, KEY_PREFIX + key)
        try:
            replies = await pipe.execute()
        except _ERRORS as e:
            self._failed(command, e)
            return None
        self._succeeded()
        return replies

    def _failed(self, command: str, error: BaseException) -> None:
        self._errors += 1
        # One warning per outage, not one per command.
        if self._healthy:
            logger.warning("redis tier: %s failed (%r); treating Redis as a miss", command, error)
            self._healthy = False

    def _succeeded(self) -> None:
        if not self._healthy:
            logger.info("redis tier: Redis answers again")
            self._healthy = True
