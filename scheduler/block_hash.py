"""Content hashes of full KV blocks, chained so a hash names the whole prefix.

A block's hash covers its parent's hash, its token ids and extra keys (the
cache salt; later adapter ids), so two blocks with equal tokens but different
prefixes, or different salts, never share KV. Only full blocks are hashed: a
partial block's content is still changing.

The default ``sha256`` runs over a fixed little-endian serialization, so the
same prefix has the same hash in every process (the kvstore keys blocks by it).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Sequence

BlockHash = bytes
ExtraKeys = tuple[str | int, ...]
BlockHasher = Callable[[BlockHash | None, Sequence[int], ExtraKeys], BlockHash]

# Parent of the first block: a fixed value so the chain has a well-known start.
_ROOT_HASH = hashlib.sha256(b"kvmesh.block_hash.root.v1").digest()


def _serialize(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: ExtraKeys) -> bytes:
    # Length-prefixed fields keep the encoding unambiguous; "<q" makes it
    # independent of the host's byte order.
    n = len(token_ids)
    extra = json.dumps(list(extra_keys), separators=(",", ":")).encode() if extra_keys else b""
    return b"".join(
        (
            parent if parent is not None else _ROOT_HASH,
            struct.pack(f"<I{n}q", n, *token_ids),
            struct.pack("<I", len(extra)),
            extra,
        )
    )


def sha256_block_hash(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: ExtraKeys = ()
) -> BlockHash:
    return hashlib.sha256(_serialize(parent, token_ids, extra_keys)).digest()


def builtin_block_hash(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: ExtraKeys = ()
) -> BlockHash:
    # Python's hash(): 64 bits and randomized per process for strings, so only
    # for a single-process scheduler that never shares hashes.
    value = hash((parent, tuple(token_ids), extra_keys))
    return value.to_bytes(8, "little", signed=True)


BLOCK_HASHERS: dict[str, BlockHasher] = {
    "sha256": sha256_block_hash,
    "builtin": builtin_block_hash,
}


def get_block_hasher(name: str) -> BlockHasher:
    try:
        return BLOCK_HASHERS[name]
    except KeyError:
        choices = sorted(BLOCK_HASHERS)
        raise ValueError(f"unknown prefix hash {name!r}; choose from {choices}") from None


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None,
    hasher: BlockHasher,
) -> None:
    """Append the hashes of full blocks of ``token_ids`` not hashed yet."""
    num_full_blocks = len(token_ids) // block_size
    for index in range(len(block_hashes), num_full_blocks):
        parent = block_hashes[-1] if block_hashes else None
        # The salt goes into the first block only: chaining carries it onwards.
        extra: ExtraKeys = (cache_salt,) if index == 0 and cache_salt is not None else ()
        start = index * block_size
        block_hashes.append(hasher(parent, token_ids[start : start + block_size], extra))
