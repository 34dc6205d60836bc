"""Per-request block tables on top of the block pool, with prefix-cache lookups.

The one owner of block arithmetic: the scheduler counts tokens, this class
turns them into blocks. The scheduler asks four things: how much of a request
is already cached (``get_computed_blocks``), to make room for its next tokens
(``allocate_slots``), to register what the worker has computed
(``cache_full_blocks``), and to give everything back (``free``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

from kvmesh.scheduler.block_pool import BlockPool, KVCacheBlock, KVCacheIntegrityError
from kvmesh.scheduler.request import Request
from kvmesh.services.contracts.block_hash import extend_block_hashes, get_block_hasher
from kvmesh.services.contracts.math_utils import cdiv

logger = logging.getLogger(__name__)

# Told which of a request's blocks ``cache_full_blocks`` just registered:
# (request, its blocks, start, end) for blocks[start:end].
BlocksCachedHook = Callable[[Request, Sequence[KVCacheBlock], int, int], None]


class KVCacheManager:
    """Maps each request to the physical blocks holding its KV, in logical order.

    Contract:
    - Every block a request gets comes from ``allocate_slots``: prefix hits
      (``new_computed_blocks``) and fresh blocks alike. It is the one place
      where blocks are taken, so it is where a KV connector hooks allocation.
    - A request's blocks cover its computed tokens and the ones it was last
      scheduled for: ``len(blocks) * block_size >= num_computed_tokens +
      num_new_tokens`` after a successful ``allocate_slots``.
    - A block enters the prefix cache only through ``cache_full_blocks``, once
      the worker has computed all of its tokens, so a hit never points at KV
      that is not written yet. A request's blocks are offered in order: the
      first ``num_cached_blocks`` were hits or registered (unless another
      block already held the same content), the rest not yet. The
      ``on_blocks_cached`` hook (the KV connector's save path) hears of
      every block the moment it becomes full and computed, once.
    - Blocks are shared only through prefix hits, so a shared block is full;
      a partly filled block has exactly one holder, who alone appends to it.
    - ``free`` is the only way blocks go back. A freed cached block keeps its
      KV (and hash) on the free queue until it is handed out again (evicted)
      or ``reset_prefix_cache`` runs, not before.

    Not thread-safe: one Scheduler owns one manager and calls it from one task.
    ``check_integrity`` verifies the invariants; tests call it after every step.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        prefix_hash: str = "sha256",
        on_blocks_cached: BlocksCachedHook | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self._hasher = get_block_hasher(prefix_hash)
        # request_id -> its blocks in logical order.
        self._req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request_id -> how many leading blocks are already registered in the cache.
        self._num_cached_blocks: dict[str, int] = {}
        self._on_blocks_cached = on_blocks_cached

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached free blocks count as free)."""
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
                request.lora_request.lora_id if request.lora_request is not None else None,
            )

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of a request that holds no blocks, as blocks and a token count.

        Takes no reference and changes nothing but the request's block hashes:
        pass the blocks to ``allocate_slots`` in the same step to keep them.
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

    def num_blocks_to_allocate(self, request: Request) -> int:
        """Blocks a request that holds none would take for its tokens so far,
        less its cached prefix: the load its admission adds. Read-only but
        for the request's block hashes."""
        _, num_hit_tokens = self.get_computed_blocks(request)
        return cdiv(request.num_tokens, self.block_size) - num_hit_tokens // self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_watermark_blocks: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens after the computed ones.

        ``new_computed_blocks`` are prefix hits from ``get_computed_blocks``,
        passed only on admission: the caller ensures the request holds no
        blocks yet and that its ``num_computed_tokens`` does not count the hits.

        Returns the blocks newly taken from the free queue: ``[]`` when the
        blocks held already have room, None (and nothing changed) when fewer
        than needed + ``num_watermark_blocks`` are free.
        """
        req_blocks = self._req_to_blocks.get(request.request_id)
        block_size = self.block_size
        # The common decode: the held blocks still have room. Compared in
        # tokens, which is cdiv(tokens, block_size) <= held without a division.
        if (
            req_blocks is not None
            and request.num_computed_tokens + num_new_tokens <= len(req_blocks) * block_size
        ):
            return []

        num_held = len(req_blocks) if req_blocks is not None else 0
        num_hit_blocks = len(new_computed_blocks)
        if num_hit_blocks and num_held:
            raise ValueError(f"{request} already holds blocks; prefix hits come at admission")
        num_total_tokens = (
            request.num_computed_tokens + num_hit_blocks * block_size + num_new_tokens
        )
        num_new_blocks = max(cdiv(num_total_tokens, block_size) - num_held - num_hit_blocks, 0)
        # Hits on free blocks take them off the free queue, so they count too.
        num_free_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        num_needed = num_new_blocks + num_free_hits
        if num_needed + num_watermark_blocks > self.block_pool.get_num_free_blocks():
            return None

        request_id = request.request_id
        if req_blocks is None:
            req_blocks = self._req_to_blocks[request_id] = []
            self._num_cached_blocks[request_id] = 0
        if num_hit_blocks:
            self.block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
            # Hit blocks are cached already; skip them when caching later.
            self._num_cached_blocks[request_id] = len(req_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        req_blocks.extend(new_blocks)
        return new_blocks

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks that ``num_computed_tokens`` newly fills.

        Call after every step with the tokens the worker has computed (at
        most what ``allocate_slots`` made room for). Between block boundaries
        this is a cheap no-op, so it sits on the per-request path of every step.
        """
        if not self.enable_caching:
            return
        request_id = request.request_id
        num_full_blocks = num_computed_tokens // self.block_size
        num_cached = self._num_cached_blocks.get(request_id)
        if num_cached is None or num_full_blocks <= num_cached:
            return
        self.update_block_hashes(request)
        blocks = self._req_to_blocks[request_id]
        self.block_pool.cache_full_blocks(blocks, request.block_hashes, num_cached, num_full_blocks)
        self._num_cached_blocks[request_id] = num_full_blocks
        if self._on_blocks_cached is not None:
            self._on_blocks_cached(request, blocks, num_cached, num_full_blocks)

    def free_excess_blocks(self, request: Request, num_tokens: int) -> int:
        """Give back the request's blocks past the first ``cdiv(num_tokens, block_size)``.

        Speculative decoding: slots allocated for drafts the worker rejected
        hold KV nobody will read; the worker drops the same tail (the step
        contract's rule). Those blocks were never cached: ``cache_full_blocks``
        only registers blocks whose tokens are all computed and accepted.
        Returns how many blocks went back.
        """
        blocks = self._req_to_blocks.get(request.request_id)
        num_keep = cdiv(num_tokens, self.block_size)
        if not blocks or len(blocks) <= num_keep:
            return 0
        if num_keep < self._num_cached_blocks[request.request_id]:
            raise KVCacheIntegrityError(f"{request}: would free cached blocks past {num_keep}")
        excess = blocks[num_keep:]
        del blocks[num_keep:]
        self.block_pool.free_blocks(reversed(excess))
        return len(excess)

    def free(self, request: Request) -> None:
        """Give back all of the request's blocks, tail first; a no-op if it holds none."""
        blocks = self._req_to_blocks.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        if blocks:
            # Reverse order: the tail is the least shared part of a prefix, so
            # it should be the first to be evicted.
            self.block_pool.free_blocks(reversed(blocks))

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """The request's blocks in logical order (empty if it holds none); do not mutate."""
        return self._req_to_blocks.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self._req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; blocks in use keep their KV uncached.

        Returns False (and does nothing) when prefix caching is off.
        """
        if not self.enable_caching:
            return False
        self.block_pool.reset_prefix_cache()
        return True

    def check_integrity(self, holders: Iterable[Request] | None = None) -> None:
        """Raise KVCacheIntegrityError unless the invariants hold.

        Pool invariants, plus: each block's ref count equals the number of
        requests holding it, and no request holds a block twice. With
        ``holders`` (the scheduler's running requests): exactly these hold
        blocks, enough for their computed tokens.
        """
        self.block_pool.check_integrity()
        num_holders = [0] * self.block_pool.num_blocks
        for request_id, blocks in self._req_to_blocks.items():
            ids = [block.block_id for block in blocks]
            if len(set(ids)) != len(ids):
                raise KVCacheIntegrityError(f"request {request_id} holds a block twice: {ids}")
            for block_id in ids:
                num_holders[block_id] += 1
        for block in self.block_pool.blocks:
            if block.ref_cnt != num_holders[block.block_id]:
                raise KVCacheIntegrityError(
                    f"{block} has ref_cnt {block.ref_cnt} but {num_holders[block.block_id]} holders"
                )
        if holders is None:
            return
        holder_ids: set[str] = set()
        for request in holders:
            holder_ids.add(request.request_id)
            num_blocks = len(self.get_blocks(request.request_id))
            if num_blocks * self.block_size < request.num_computed_tokens:
                raise KVCacheIntegrityError(f"{request} holds only {num_blocks} blocks")
        if holder_ids != set(self._req_to_blocks):
            raise KVCacheIntegrityError(
                f"blocks held by {sorted(self._req_to_blocks)}, expected {sorted(holder_ids)}"
            )
