"""Per-request block tables on top of the block pool, with prefix-cache lookups.

The scheduler asks three things: how much of a request is already cached
(``get_computed_blocks``), whether there is room for its next tokens
(``allocate_slots``), and to give everything back (``free``). Blocks become
cached only after the worker has computed them (``cache_blocks``, called from
``update_from_output``), so a hit never points at KV that is not written yet.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from scheduler.block_hash import extend_block_hashes, get_block_hasher
from scheduler.block_pool import BlockPool, KVCacheBlock, KVCacheIntegrityError
from scheduler.request import Request

logger = logging.getLogger(__name__)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        prefix_hash: str = "sha256",
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self._hasher = get_block_hasher(prefix_hash)
        # request_id -> its blocks in logical order.
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request_id -> how many leading blocks are already registered in the cache.
        self.num_cached_blocks: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def update_block_hashes(self, request: Request) -> None:
        """Hash the request's newly full blocks (cheap no-op between block boundaries)."""
        if self.enable_caching and len(request.block_hashes) < (
            len(request.all_token_ids) // self.block_size
        ):
            extend_block_hashes(
                request.block_hashes,
                request.all_token_ids,
                self.block_size,
                request.cache_salt,
                self._hasher,
            )

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request, as blocks and a token count.

        Takes no reference; pass the blocks to ``allocate_slots`` to keep them.
        """
        if not self.enable_caching:
            return [], 0
        self.update_block_hashes(request)
        # At most num_tokens - 1 tokens may come from the cache: the last token
        # must still be computed, since its logits are what the next token is
        # sampled from. Rounded down to a block boundary (only full blocks hit).
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        computed: list[KVCacheBlock] = []
        lookup = self.block_pool.cached_block_hash_to_block.get
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = lookup(block_hash)
            if block is None:
                break
            computed.append(block)
        return computed, len(computed) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_watermark_blocks: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens after the computed ones.

        ``new_computed_blocks`` are prefix hits from ``get_computed_blocks`` (only
        on admission). Returns the blocks newly taken from the free queue, or None
        (and changes nothing) when fewer than needed + ``num_watermark_blocks``
        are free.
        """
        block_size = self.block_size
        req_blocks = self.req_to_blocks.get(request.request_id)
        num_held = len(req_blocks) if req_blocks is not None else 0
        num_hit_blocks = len(new_computed_blocks)
        num_total_tokens = (
            request.num_computed_tokens + num_hit_blocks * block_size + num_new_tokens
        )
        num_required_blocks = -(-num_total_tokens // block_size)
        num_new_blocks = num_required_blocks - num_held - num_hit_blocks
        if num_new_blocks <= 0 and not num_hit_blocks and req_blocks is not None:
            return []  # hot path: a decode that still fits in its last block

        # Hits on free blocks take them off the free queue, so they count too.
        num_free_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        num_needed = max(num_new_blocks, 0) + num_free_hits
        if num_needed + num_watermark_blocks > self.block_pool.get_num_free_blocks():
            return None

        if req_blocks is None:
            req_blocks = self.req_to_blocks[request.request_id] = []
            self.num_cached_blocks[request.request_id] = 0
        if num_hit_blocks:
            self.block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
            # Hit blocks are cached already; skip them when caching later.
            self.num_cached_blocks[request.request_id] = len(req_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        req_blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks that are now full and computed."""
        if not self.enable_caching:
            return
        request_id = request.request_id
        num_full_blocks = num_computed_tokens // self.block_size
        num_cached = self.num_cached_blocks.get(request_id)
        if num_cached is None or num_full_blocks <= num_cached:
            return
        self.update_block_hashes(request)
        self.block_pool.cache_full_blocks(
            self.req_to_blocks[request_id], request.block_hashes, num_cached, num_full_blocks
        )
        self.num_cached_blocks[request_id] = num_full_blocks

    def free(self, request: Request) -> None:
        """Give back all of the request's blocks, tail first."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if blocks:
            # Reverse order: the tail is the least shared part of a prefix, so
            # it should be the first to be evicted.
            self.block_pool.free_blocks(reversed(blocks))

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; blocks in use keep their KV uncached."""
        if not self.enable_caching:
            return False
        self.block_pool.reset_prefix_cache()
        return True

    def check_integrity(self) -> None:
        """Pool invariants, plus: each block's ref count equals the number of
        requests holding it, and no request holds a block twice."""
        self.block_pool.check_integrity()
        holders = [0] * self.block_pool.num_blocks
        for request_id, blocks in self.req_to_blocks.items():
            ids = [block.block_id for block in blocks]
            if len(set(ids)) != len(ids):
                raise KVCacheIntegrityError(f"request {request_id} holds a block twice: {ids}")
            for block_id in ids:
                holders[block_id] += 1
        for block in self.block_pool.blocks:
            if block.ref_cnt != holders[block.block_id]:
                raise KVCacheIntegrityError(
                    f"{block} has ref_cnt {block.ref_cnt} but {holders[block.block_id]} holders"
                )
