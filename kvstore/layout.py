"""The layout tag of KV blocks and the store key derived from it.

A block hash names a token prefix, not the bytes a cache holds for it: the
same prefix has different KV under another model, dtype, block size, byte
layout or tensor-parallel rank. The store therefore keys every block by
``namespace + block_hash`` where the namespace is a hash of the layout, so a
block is never served to a cache of another shape.

The namespace is SHA-256 over a canonical encoding defined here (fixed field
order, length-prefixed UTF-8 strings, big-endian integers, a version tag),
truncated to 16 bytes. Not the protobuf wire format: protobuf does not
promise a canonical serialization across versions and languages, and a
connector in another process must derive the same bytes. 128 bits make a
collision between two real layouts negligible. Never Python's ``hash()``,
which is salted per process.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from dataclasses import dataclass

from kvmesh.protos import kvstore_pb2
from kvmesh.services.contracts.errors import InvalidRequestError

NAMESPACE_BYTES = 16
MAX_BLOCK_HASH_BYTES = 64
# Bumped only if the encoding below changes (which orphans every stored block).
_ENCODING_TAG = b"kvmesh.kvlayout.v1"


@dataclass(frozen=True)
class KVLayout:
    """What makes KV bytes of one block hash interchangeable (see KVLayout in the proto)."""

    model: str
    dtype: str
    block_size: int
    layout_version: int
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if not self.model or not self.dtype:
            raise InvalidRequestError("KVLayout needs a model and a dtype")
        if self.block_size <= 0 or self.layout_version <= 0:
            raise InvalidRequestError("KVLayout block_size and layout_version must be positive")
        if not 0 <= self.tp_rank < self.tp_size:
            raise InvalidRequestError(
                f"KVLayout tp_rank {self.tp_rank} outside [0, tp_size={self.tp_size})"
            )

    def canonical_bytes(self) -> bytes:
        """The deterministic encoding the namespace hashes."""
        parts = [_ENCODING_TAG]
        for text in (self.model, self.dtype):
            encoded = text.encode("utf-8")
            parts.append(struct.pack(">I", len(encoded)) + encoded)
        parts.append(
            struct.pack(">4I", self.block_size, self.layout_version, self.tp_rank, self.tp_size)
        )
        return b"".join(parts)

    @functools.cached_property
    def namespace(self) -> bytes:
        """16 bytes that prefix the store key of every block of this layout."""
        return hashlib.sha256(self.canonical_bytes()).digest()[:NAMESPACE_BYTES]

    def block_key(self, block_hash: bytes) -> bytes:
        """The store key of one block of this layout."""
        if not 0 < len(block_hash) <= MAX_BLOCK_HASH_BYTES:
            raise InvalidRequestError(
                f"block hash must be 1..{MAX_BLOCK_HASH_BYTES} bytes, got {len(block_hash)}"
            )
        return self.namespace + block_hash

    def to_proto(self) -> kvstore_pb2.KVLayout:
        return kvstore_pb2.KVLayout(
            model=self.model,
            dtype=self.dtype,
            block_size=self.block_size,
            layout_version=self.layout_version,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
        )

    @classmethod
    def from_proto(cls, message: kvstore_pb2.KVLayout) -> KVLayout:
        """Validate a layout from the wire (InvalidRequestError if incomplete)."""
        return cls(
            model=message.model,
            dtype=message.dtype,
            block_size=message.block_size,
            layout_version=message.layout_version,
            tp_rank=message.tp_rank,
            tp_size=message.tp_size,
        )
