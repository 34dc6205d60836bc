"""A block in the middle of a two-phase put: invisible until committed.

``begin_put`` creates one (reserving its size in memory), chunks are written
into it, and ``commit_put`` checks the exact size and CRC-32 before the bytes
become a block anyone can read. The chunks live here, not in the store's
block table, so a put that is abandoned at any point (abort, disconnect,
error) leaves no trace but a reservation that ``abort_put`` returns.
"""

from __future__ import annotations

from kvmesh.kvstore.block import StoredBlock, crc32
from kvmesh.services.contracts.errors import InvalidRequestError


class PendingPut:
    __slots__ = ("_chunks", "_crc", "_received", "key", "reserved", "size")

    def __init__(self, key: bytes, size: int, reserved: int) -> None:
        self.key = key
        self.size = size
        # Memory bytes held for this put until it ends: ``size``, or 0 when an
        # equal key was already stored at begin (the copy is then only
        # checked, and kept only if that block is gone by commit).
        self.reserved = reserved
        self._chunks: list[bytes] = []
        self._received = 0
        self._crc = 0

    @property
    def received(self) -> int:
        return self._received

    def write(self, chunk: bytes) -> None:
        if self._received + len(chunk) > self.size:
            raise InvalidRequestError(
                f"block {self.key.hex()} declared {self.size} bytes; "
                f"{self._received + len(chunk)} sent"
            )
        self._chunks.append(chunk)
        self._received += len(chunk)
        self._crc = crc32(chunk, self._crc)

    def assemble(self, expected_crc32: int) -> StoredBlock | None:
        """The block, or None if it is short or its CRC-32 is not ``expected_crc32``."""
        if self._received != self.size or self._crc != expected_crc32:
            return None
        data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks = []
        return StoredBlock(data, self._crc)
