"""Per-request block tables on top of the block pool, with prefix-cache lookups.

The one owner of block arithmetic: the scheduler counts tokens, this class
turns them into blocks. The scheduler asks four things: how much of a request
is already cached (``get_computed_blocks``), to make room for its next tokens
(``allocate_slots``), to register what the worker has computed
(``cache_full_blocks``), and to give everything back (``free``).

KV-cache groups (services/contracts/kv_cache_groups.py, vLLM v1's hybrid KV
cache): each group of layers has its own block table per request, all of the
same length (one entry per block of the request's tokens), the blocks from the
one pool. A sliding-window group's entries for blocks that left the window of
every future query are the pool's null block; the blocks themselves went back
to the pool as the window slid. A model with one full-attention group (Llama)
takes none of these paths: its tables, pool and counts are exactly as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

from kvmesh.scheduler.block_pool import BlockPool, KVCacheBlock, KVCacheIntegrityError
from kvmesh.scheduler.request import Request
from kvmesh.services.contracts.block_hash import BlockHash, extend_block_hashes, get_block_hasher
from kvmesh.services.contracts.kv_cache_groups import num_skipped_blocks, window_blocks
from kvmesh.services.contracts.math_utils import cdiv

logger = logging.getLogger(__name__)

# Told which of a request's blocks ``cache_full_blocks`` just registered:
# (request, its blocks, start, end) for blocks[start:end].
BlocksCachedHook = Callable[[Request, Sequence[KVCacheBlock], int, int], None]
# Prefix hits, one list per KV-cache group (all of one length); () for none.
GroupBlocks = tuple[list[KVCacheBlock], ...]


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

    - With KV-cache groups every statement above holds per group, and a
      group's table has one entry per block of the request like group 0's.
      Before each allocation a sliding-window group gives back the blocks
      that no query from ``num_computed_tokens`` on can read and points their
      entries at the null block; a prefix hit of such a group needs only the
      blocks inside the window before the hit's end (vLLM's rule), the
      earlier entries being null. The connector hook hears of group 0 only.

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
        group_windows: Sequence[int | None] = (None,),
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if not group_windows:
            raise ValueError("at least one KV-cache group")
        self.block_size = block_size
        self.enable_caching = enable_caching
        # Per KV-cache group, its window (None: full attention).
        self.group_windows = tuple(group_windows)
        self.num_groups = len(self.group_windows)
        # The groups that free blocks as their window slides.
        self._windowed = [g for g, w in enumerate(self.group_windows) if w is not None]
        self.block_pool = BlockPool(
            num_blocks,
            enable_caching,
            num_groups=self.num_groups,
            reserve_null_block=bool(self._windowed),
        )
        self._hasher = get_block_hasher(prefix_hash)
        # request_id -> its blocks in logical order (group 0's table).
        self._req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request_id -> the tables of groups 1.. (only with several groups).
        self._req_to_group_blocks: dict[str, list[list[KVCacheBlock]]] = {}
        # request_id -> per windowed group (in ``_windowed`` order), its
        # leading entries that point at the null block.
        self._num_nulled: dict[str, list[int]] = {}
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

    def get_computed_blocks(self, request: Request) -> tuple[GroupBlocks, int]:
        """Longest cached prefix of a request that holds no blocks, as blocks
        (one list per KV-cache group) and a token count.

        Takes no reference and changes nothing but the request's block hashes:
        pass the blocks to ``allocate_slots`` in the same step to keep them.
        """
        if not self.enable_caching:
            return (), 0
        self.update_block_hashes(request)
        # At most num_tokens - 1 tokens may come from the cache: the last token
        # must still be computed, since its logits are what the next token is
        # sampled from. Rounded down to a block boundary (only full blocks hit).
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes
        if self.num_groups == 1 and not self._windowed:
            computed: list[KVCacheBlock] = []
            lookup = self.block_pool.cached_block_hash_to_block.get
            for block_hash in hashes[:max_hit_blocks]:
                block = lookup(block_hash)
                if block is None:
                    break
                computed.append(block)
            return (computed,), len(computed) * self.block_size
        # The longest hit every group can serve: a group's answer only lowers
        # the bound of the others, and a windowed group's hit at a shorter
        # length needs other blocks, so ask again until no answer moves.
        num_hit = max_hit_blocks
        moved = True
        while moved and num_hit:
            moved = False
            for group in range(self.num_groups):
                found = self._longest_hit(group, hashes, num_hit)
                if found < num_hit:
                    num_hit, moved = found, True
        if not num_hit:
            return (), 0
        return self._hit_blocks(hashes, num_hit), num_hit * self.block_size

    def _longest_hit(self, group: int, hashes: Sequence[BlockHash], max_blocks: int) -> int:
        """Blocks of the longest prefix, at most ``max_blocks``, whose KV ``group``
        holds: every block for full attention; for a window, the blocks the
        next query reads (those right before the end), scanned from the right."""
        cache = self.block_pool.caches[group]
        window = self.group_windows[group]
        if window is None:
            num = 0
            while num < max_blocks and hashes[num] in cache:
                num += 1
            return num
        needed = window_blocks(window, self.block_size)
        if needed == 0:
            return max_blocks
        run = 0
        for index in range(max_blocks - 1, -1, -1):
            if hashes[index] in cache:
                run += 1
                if run >= needed:
                    return index + run
            else:
                run = 0
        # The leading run is a hit however short: nothing before it is needed.
        return run

    def _hit_blocks(self, hashes: Sequence[BlockHash], num_hit: int) -> GroupBlocks:
        """Each group's blocks of a hit of ``num_hit`` blocks that every group serves;
        a windowed group's blocks before its window are the null block."""
        caches = self.block_pool.caches
        null = self.block_pool.null_block
        out: list[list[KVCacheBlock]] = []
        for group, window in enumerate(self.group_windows):
            cache = caches[group]
            first = 0
            if window is not None:
                first = max(num_hit - window_blocks(window, self.block_size), 0)
            assert first == 0 or null is not None
            blocks: list[KVCacheBlock] = [null] * first if null is not None else []
            blocks.extend(cache[block_hash] for block_hash in hashes[first:num_hit])
            out.append(blocks)
        return tuple(out)

    def num_blocks_to_allocate(self, request: Request) -> int:
        """Blocks a request that holds none would take for its tokens so far,
        less its cached prefix: the load its admission adds. Read-only but
        for the request's block hashes. A windowed group counts what it holds
        once its prompt is in (a chunked prefill holds a chunk more meanwhile)."""
        _, num_hit_tokens = self.get_computed_blocks(request)
        num_hit_blocks = num_hit_tokens // self.block_size
        num_blocks = cdiv(request.num_tokens, self.block_size)
        return sum(
            num_blocks
            - max(
                num_hit_blocks,
                num_skipped_blocks(request.num_tokens - 1, window, self.block_size),
            )
            for window in self.group_windows
        )

    def _tables(self, request_id: str) -> list[list[KVCacheBlock]]:
        """The request's table of every group (it must hold blocks)."""
        blocks = self._req_to_blocks[request_id]
        if self.num_groups == 1:
            return [blocks]
        return [blocks, *self._req_to_group_blocks[request_id]]

    def _free_skipped(self, request_id: str, num_computed_tokens: int) -> None:
        """Windowed groups: give back the blocks no query from
        ``num_computed_tokens`` on reads, their entries now the null block."""
        nulled = self._num_nulled[request_id]
        tables = self._tables(request_id)
        null = self.block_pool.null_block
        for index, group in enumerate(self._windowed):
            table = tables[group]
            window = self.group_windows[group]
            skip = min(num_skipped_blocks(num_computed_tokens, window, self.block_size), len(table))
            start = nulled[index]
            if skip <= start:
                continue
            freed = table[start:skip]
            table[start:skip] = [null] * (skip - start)  # type: ignore[list-item]
            nulled[index] = skip
            # Oldest first to the free queue: the least likely to be hit again.
            self.block_pool.free_blocks(freed)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: GroupBlocks = (),
        num_watermark_blocks: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens after the computed ones.

        ``new_computed_blocks`` are prefix hits from ``get_computed_blocks``,
        passed only on admission: the caller ensures the request holds no
        blocks yet and that its ``num_computed_tokens`` does not count the hits.
        Windowed groups first give back the blocks that left their window.

        Returns group 0's blocks newly taken from the free queue (every group
        took as many: ``get_new_group_block_ids``): ``[]`` when the blocks held
        already have room, None (and nothing taken) when fewer than needed +
        ``num_watermark_blocks`` are free.
        """
        request_id = request.request_id
        req_blocks = self._req_to_blocks.get(request_id)
        block_size = self.block_size
        if self._windowed and req_blocks is not None:
            self._free_skipped(request_id, request.num_computed_tokens)
        # The common decode: the held blocks still have room. Compared in
        # tokens, which is cdiv(tokens, block_size) <= held without a division.
        if (
            req_blocks is not None
            and request.num_computed_tokens + num_new_tokens <= len(req_blocks) * block_size
        ):
            return []

        num_held = len(req_blocks) if req_blocks is not None else 0
        num_hit_blocks = len(new_computed_blocks[0]) if new_computed_blocks else 0
        if num_hit_blocks and num_held:
            raise ValueError(f"{request} already holds blocks; prefix hits come at admission")
        num_total_tokens = (
            request.num_computed_tokens + num_hit_blocks * block_size + num_new_tokens
        )
        num_new_blocks = max(cdiv(num_total_tokens, block_size) - num_held - num_hit_blocks, 0)
        # Hits on free blocks take them off the free queue, so they count too
        # (the null block is never free).
        num_free_hits = sum(
            1 for hits in new_computed_blocks for block in hits if block.ref_cnt == 0
        )
        num_needed = num_new_blocks * self.num_groups + num_free_hits
        if num_needed + num_watermark_blocks > self.block_pool.get_num_free_blocks():
            return None

        if req_blocks is None:
            req_blocks = self._req_to_blocks[request_id] = []
            self._num_cached_blocks[request_id] = 0
            if self.num_groups > 1:
                self._req_to_group_blocks[request_id] = [[] for _ in range(self.num_groups - 1)]
            if self._windowed:
                self._num_nulled[request_id] = [0] * len(self._windowed)
        tables = self._tables(request_id)
        if num_hit_blocks:
            for table, hits in zip(tables, new_computed_blocks, strict=True):
                self.block_pool.touch(hits)
                table.extend(hits)
            # Hit blocks are cached already; skip them when caching later.
            self._num_cached_blocks[request_id] = num_hit_blocks
            if self._windowed:
                null = self.block_pool.null_block
                self._num_nulled[request_id] = [
                    sum(1 for block in new_computed_blocks[group] if block is null)
                    for group in self._windowed
                ]
        if not num_new_blocks:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        for table in tables[1:]:
            table.extend(self.block_pool.get_new_blocks(num_new_blocks))
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
        hashes = request.block_hashes
        self.block_pool.cache_full_blocks(blocks, hashes, num_cached, num_full_blocks)
        if self.num_groups > 1:
            for group, table in enumerate(self._req_to_group_blocks[request_id], start=1):
                self.block_pool.cache_full_blocks(
                    table, hashes, num_cached, num_full_blocks, group=group
                )
        self._num_cached_blocks[request_id] = num_full_blocks
        if self._on_blocks_cached is not None:
            self._on_blocks_cached(request, blocks, num_cached, num_full_blocks)

    def free_excess_blocks(self, request: Request, num_tokens: int) -> int:
        """Give back the request's blocks past the first ``cdiv(num_tokens, block_size)``.

        Speculative decoding: slots allocated for drafts the worker rejected
        hold KV nobody will read; the worker drops the same tail (the step
        contract's rule). Those blocks were never cached: ``cache_full_blocks``
        only registers blocks whose tokens are all computed and accepted.
        Returns how many blocks went back (per group).
        """
        blocks = self._req_to_blocks.get(request.request_id)
        num_keep = cdiv(num_tokens, self.block_size)
        if not blocks or len(blocks) <= num_keep:
            return 0
        if num_keep < self._num_cached_blocks[request.request_id]:
            raise KVCacheIntegrityError(f"{request}: would free cached blocks past {num_keep}")
        num_excess = len(blocks) - num_keep
        for table in self._tables(request.request_id):
            excess = table[num_keep:]
            del table[num_keep:]
            self.block_pool.free_blocks(reversed(excess))
        return num_excess

    def free(self, request: Request) -> None:
        """Give back all of the request's blocks, tail first; a no-op if it holds none."""
        request_id = request.request_id
        blocks = self._req_to_blocks.pop(request_id, None)
        self._num_cached_blocks.pop(request_id, None)
        group_tables = self._req_to_group_blocks.pop(request_id, [])
        self._num_nulled.pop(request_id, None)
        if blocks is None:
            return
        # Reverse order: the tail is the least shared part of a prefix, so
        # it should be the first to be evicted.
        for table in (blocks, *group_tables):
            self.block_pool.free_blocks(reversed(table))

    def get_blocks(self, request_id: str, group: int = 0) -> list[KVCacheBlock]:
        """The request's blocks of ``group`` in logical order (empty if it holds
        none); do not mutate."""
        if group == 0:
            return self._req_to_blocks.get(request_id, [])
        tables = self._req_to_group_blocks.get(request_id)
        return tables[group - 1] if tables is not None else []

    def get_block_ids(self, request_id: str) -> list[int]:
        """Group 0's block ids of the request, in logical order."""
        return [block.block_id for block in self._req_to_blocks.get(request_id, ())]

    def get_group_block_ids(self, request_id: str) -> list[list[int]]:
        """The block ids of groups 1.. (empty with one group), in logical order."""
        return [
            [block.block_id for block in table]
            for table in self._req_to_group_blocks.get(request_id, ())
        ]

    def get_new_group_block_ids(self, request_id: str, num_new: int) -> list[list[int]]:
        """The last ``num_new`` block ids of groups 1..: what the allocation
        that gave group 0 ``num_new`` blocks gave each of them."""
        if not num_new:
            return [[] for _ in range(self.num_groups - 1)]
        return [
            [block.block_id for block in table[-num_new:]]
            for table in self._req_to_group_blocks.get(request_id, ())
        ]

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
        requests holding it, no request holds a block twice, every group's
        table has one length, and only windowed groups hold null entries,
        all leading. With
        ``holders`` (the scheduler's running requests): exactly these hold
        blocks, enough for their computed tokens.
        """
        self.block_pool.check_integrity()
        null = self.block_pool.null_block
        num_holders = [0] * self.block_pool.num_blocks
        for request_id in self._req_to_blocks:
            tables = self._tables(request_id)
            if len({len(table) for table in tables}) != 1:
                raise KVCacheIntegrityError(f"request {request_id}'s group tables differ in length")
            for table in tables:
                ids = [block.block_id for block in table if block is not null]
                if len(set(ids)) != len(ids):
                    raise KVCacheIntegrityError(f"request {request_id} holds a block twice: {ids}")
                for block_id in ids:
                    num_holders[block_id] += 1
        for group, window in enumerate(self.group_windows):
            for request_id in self._req_to_blocks:
                table = self._tables(request_id)[group]
                num_null = sum(1 for block in table if block is null)
                if window is None and num_null:
                    raise KVCacheIntegrityError(
                        f"request {request_id}: null block in full-attention group {group}"
                    )
                if num_null and any(block is not null for block in table[:num_null]):
                    raise KVCacheIntegrityError(
                        f"request {request_id}: null blocks not leading in group {group}"
                    )
        for block in self.block_pool.blocks:
            if block is null:
                continue
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
