"""Content hashes of full KV blocks, chained so a hash names the whole prefix.

A block's hash covers its parent's hash, its token ids and extra keys (the
cache salt and the LoRA adapter id), so two blocks with equal tokens but
different prefixes, salts or adapters never share KV (an adapter changes every
layer's K and V). Only full blocks are hashed: a
partial block's content is still changing.

The default ``sha256`` runs over a fixed little-endian serialization, so the
same prefix has the same hash in every process (the kvstore keys blocks by it).

A shared contract, not the scheduler's own: the scheduler hashes for its
prefix cache and the kvstore keys, and the gateway's router hashes prompts
the same way to find the replica that holds them.
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


def first_block_extra_keys(cache_salt: str | None, lora_id: str | None) -> ExtraKeys:
    """The extra keys of a prompt's first block.

    A salt alone is ``(salt,)`` (hashes from before adapters existed stay
    valid); an adapter makes it ``("lora", id)`` or ``("lora", id, salt)``,
    never one key long, so no salt can pose as an adapter.
    """
    if lora_id is None:
        return (cache_salt,) if cache_salt is not None else ()
    return ("lora", lora_id) if cache_salt is None else ("lora", lora_id, cache_salt)


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None,
    hasher: BlockHasher,
    lora_id: str | None = None,
) -> None:
    """Append the hashes of full blocks of ``token_ids`` not hashed yet."""
    num_full_blocks = len(token_ids) // block_size
    first_extra = first_block_extra_keys(cache_salt, lora_id)
    for index in range(len(block_hashes), num_full_blocks):
        parent = block_hashes[-1] if block_hashes else None
        # Salt and adapter go into the first block only: chaining carries them onwards.
        extra: ExtraKeys = first_extra if index == 0 else ()
        start = index * block_size
        block_hashes.append(hasher(parent, token_ids[start : start + block_size], extra))
