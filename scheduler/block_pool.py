"""The pool of physical KV blocks: ref counts, an LRU free queue, the prefix-cache map.

Contract:
- A block is either on the free queue with ``ref_cnt == 0`` or held by requests
  with ``ref_cnt > 0``, never both.
- A free block may still carry a hash: its KV stays reusable until the block is
  handed out again, at which point the old hash is dropped (evicted).
- Eviction order is the free queue order: blocks are taken from the front.
  A block whose last holder lets go joins the back if it is cached (LRU among
  cached prefixes) and the front if it is not (a partial tail, a duplicate of
  a cached block, or caching off): reusing a block no prefix can hit costs
  nothing, so it goes before any cached one. Callers free a request's blocks
  in reverse so that the tail of a sequence, the least likely to be shared,
  goes first.
- Every change of the prefix cache (a block registered under its hash, a
  cached block evicted, the whole cache reset) is told to ``event_sink``
  (kvmesh.scheduler.kv_events), if one was given, as it happens; for KV-cache
  group 0 only (services/contracts/kv_cache_groups.py), whose hashes are the
  ones a router can match: the other groups cache the same prefixes again.
- With KV-cache groups each group has its own prefix cache (the same hash
  names one block per group); a block is cached in at most one of them.
- With ``reserve_null_block`` block 0 is the null block: held forever, never
  cached, freed or counted as free or used. A sliding-window group's table
  points at it for blocks that left the window (the kernels never read it).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from kvmesh.scheduler.kv_events import AllBlocksCleared, BlockRemoved, KVEventSink, chain_runs
from kvmesh.services.contracts.block_hash import BlockHash

logger = logging.getLogger(__name__)


class KVCacheIntegrityError(RuntimeError):
    """The pool's bookkeeping contradicts itself (a bug, never user input)."""


class KVCacheBlock:
    """Metadata of one physical block; the tensors live in the worker."""

    __slots__ = (
        "block_hash",
        "block_id",
        "cache_group",
        "next_free_block",
        "prev_free_block",
        "ref_cnt",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set once the block is full and computed; None while it is not cached.
        self.block_hash: BlockHash | None = None
        # The KV-cache group whose prefix cache holds it (meaningful while cached).
        self.cache_group = 0
        # Links of the free queue; both None when the block is not on it.
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = self.block_hash is not None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, cached={cached})"


class FreeKVCacheBlockQueue:
    """Doubly-linked list of free blocks: O(1) pop from the front, append, and
    removal from the middle (a prefix-cache hit on a free block)."""

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        # Sentinels spare every operation a None check.
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self.num_free_blocks = 0
        prev = self._head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self._tail
        self._tail.prev_free_block = prev
        self.num_free_blocks = len(blocks)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is self._tail or block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out: list[KVCacheBlock] = []
        block = self._head.next_free_block
        for _ in range(n):
            assert block is not None
            out.append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt
        assert block is not None
        self._head.next_free_block = block
        block.prev_free_block = self._head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise KVCacheIntegrityError(f"{block} is not on the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put ``blocks`` at the front, ``blocks[0]`` first out."""
        if not blocks:
            return
        first = self._head.next_free_block
        assert first is not None
        prev = self._head
        for block in blocks:
            if block.prev_free_block is not None or block.next_free_block is not None:
                raise KVCacheIntegrityError(f"{block} is already on the free queue")
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = first
        first.prev_free_block = prev
        self.num_free_blocks += len(blocks)

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise KVCacheIntegrityError(f"{block} is already on the free queue")
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterable[KVCacheBlock]:
        block = self._head.next_free_block
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free_block


class BlockPool:
    """Hands out blocks, takes them back, and remembers which hold cached prefixes."""

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        event_sink: KVEventSink | None = None,
        num_groups: int = 1,
        reserve_null_block: bool = False,
    ) -> None:
        if num_blocks <= int(reserve_null_block):
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if num_groups <= 0:
            raise ValueError(f"num_groups must be positive, got {num_groups}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # The block that stands for "left the window" in block tables.
        self.null_block: KVCacheBlock | None = None
        if reserve_null_block:
            self.null_block = self.free_block_queue.popleft()
            self.null_block.ref_cnt = 1
        # Per KV-cache group, one block per hash: a second block computed with
        # the same content (two requests prefilling the same prefix at once)
        # just stays uncached.
        self.caches: list[dict[BlockHash, KVCacheBlock]] = [{} for _ in range(num_groups)]
        self.cached_block_hash_to_block = self.caches[0]
        # Hears of every change of the prefix cache (routers index replicas by it).
        self.event_sink = event_sink

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests can hold: all but the null block."""
        return self.num_blocks - (self.null_block is not None)

    def get_num_used_blocks(self) -> int:
        """Blocks held by requests now (the null block not counted)."""
        return self.num_usable_blocks - self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        return 1.0 - self.free_block_queue.num_free_blocks / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash, group: int = 0) -> KVCacheBlock | None:
        return self.caches[group].get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take blocks from the front of the free queue (least recently freed)."""
        blocks = self.free_block_queue.popleft_n(num_blocks)
        caches = self.caches
        evicted: list[BlockHash] = []
        for block in blocks:
            if block.block_hash is not None:
                # Reusing the block overwrites its KV: its old prefix is gone.
                cache = caches[block.cache_group]
                if cache.get(block.block_hash) is block:
                    del cache[block.block_hash]
                    if block.cache_group == 0:
                        evicted.append(block.block_hash)
                block.block_hash = None
            block.ref_cnt = 1
        if evicted and self.event_sink is not None:
            self.event_sink(BlockRemoved(tuple(evicted)))
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cached blocks (a prefix hit); free ones leave the queue.
        The null block is skipped."""
        null = self.null_block
        for block in blocks:
            if block is null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks nobody holds join the free queue in the
        given order (first evicted first): cached ones at the back, the others
        at the front (see the module docstring). The null block is skipped."""
        uncached: list[KVCacheBlock] = []
        null = self.null_block
        for block in ordered_blocks:
            if block is null:
                continue
            if block.ref_cnt <= 0:
                raise KVCacheIntegrityError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    uncached.append(block)
                else:
                    self.free_block_queue.append(block)
        self.free_block_queue.prepend_n(uncached)

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        group: int = 0,
    ) -> None:
        """Register ``blocks[num_cached_blocks:num_full_blocks]`` (now full and
        computed) under their hashes in ``group``'s cache (null blocks: skipped)."""
        if not self.enable_caching:
            return
        cache = self.caches[group]
        null = self.null_block
        stored: list[int] = []
        for index in range(num_cached_blocks, num_full_blocks):
            block = blocks[index]
            if block.block_hash is not None or block is null:
                continue  # came from a prefix hit (already cached), or left the window
            block_hash = block_hashes[index]
            if block_hash in cache:
                continue  # same content already cached in another block
            block.block_hash = block_hash
            block.cache_group = group
            cache[block_hash] = block
            stored.append(index)
        if stored and self.event_sink is not None and group == 0:
            for event in chain_runs(block_hashes, stored):
                self.event_sink(event)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use keep their KV, uncached)."""
        for cache in self.caches:
            for block in cache.values():
                block.block_hash = None
            cache.clear()
        if self.event_sink is not None:
            self.event_sink(AllBlocksCleared())
        logger.info("prefix cache reset")

    def check_integrity(self) -> None:
        """Raise KVCacheIntegrityError if the bookkeeping contradicts itself."""
        on_queue: set[int] = set()
        prev = self.free_block_queue._head
        for block in self.free_block_queue:
            if block.block_id in on_queue:
                raise KVCacheIntegrityError(f"{block} is on the free queue twice")
            if block.prev_free_block is not prev:
                raise KVCacheIntegrityError(f"broken free-queue link at {block}")
            if block.ref_cnt != 0:
                raise KVCacheIntegrityError(f"{block} is on the free queue but referenced")
            on_queue.add(block.block_id)
            prev = block
        if len(on_queue) != self.free_block_queue.num_free_blocks:
            raise KVCacheIntegrityError(
                f"free queue holds {len(on_queue)} blocks, counter says "
                f"{self.free_block_queue.num_free_blocks}"
            )
        null = self.null_block
        if null is not None and (
            null.ref_cnt != 1 or null.block_hash is not None or null.block_id in on_queue
        ):
            raise KVCacheIntegrityError(f"the null block {null} was handed out or cached")
        for block in self.blocks:
            if block.block_id not in on_queue:
                if block.ref_cnt <= 0:
                    raise KVCacheIntegrityError(f"{block} is neither free nor referenced")
                if block.prev_free_block is not None or block.next_free_block is not None:
                    raise KVCacheIntegrityError(f"{block} is referenced but still linked")
            if block.block_hash is not None and (
                self.caches[block.cache_group].get(block.block_hash) is not block
            ):
                raise KVCacheIntegrityError(f"{block} has a hash the cache map does not know")
        for group, cache in enumerate(self.caches):
            for block_hash, block in cache.items():
                if block.block_hash != block_hash or block.cache_group != group:
                    raise KVCacheIntegrityError(
                        f"group {group}'s cache map entry points at {block} of another hash/group"
                    )
