"""A stored block (bytes + checksum), its record format on disk and in Redis, put outcomes.

Checksum: CRC-32 (zlib) over the block's bytes, plus its exact length. The
threat is accidental damage (a torn or truncated file, a bit flip, a bug that
sends the wrong bytes), not an adversary: the store is an internal service
and its keys are not content hashes of the KV bytes anyway. CRC-32 catches
every burst error up to 32 bits and all but 2**-32 of the rest, and runs at
about 2.9 GB/s here against 1.7 GB/s for SHA-256 (AMD EPYC dev box, 2 MiB
buffers), which matters on a path that checks every byte on both ends.
"""

from __future__ import annotations

import enum
import struct
import zlib
from dataclasses import dataclass

# Largest data payload of one gRPC message in either direction: far below
# gRPC's default 4 MiB limit, large enough that per-message overhead is noise.
CHUNK_BYTES = 1 << 20

# Record = header + data. Magic and version first so a foreign or older file
# is rejected rather than misread.
_RECORD_MAGIC = b"KVB1"
_RECORD_HEADER = struct.Struct(">4sIQ")  # magic, crc32, size
RECORD_HEADER_BYTES = _RECORD_HEADER.size


def crc32(data: bytes | memoryview, running: int = 0) -> int:
    """CRC-32 of ``data``, continuing ``running`` (for chunked input)."""
    return zlib.crc32(data, running)


class CorruptBlockError(Exception):
    """Bytes read back do not match their recorded size or checksum."""


@dataclass(frozen=True, slots=True)
class StoredBlock:
    """A committed block's bytes and their CRC-32 (checked before it became visible)."""

    data: bytes
    crc32: int

    @property
    def size(self) -> int:
        return len(self.data)

    def record_header(self) -> bytes:
        """The header that precedes ``data`` in a disk file or Redis value."""
        return _RECORD_HEADER.pack(_RECORD_MAGIC, self.crc32, len(self.data))

    @classmethod
    def from_record(cls, record: bytes) -> StoredBlock:
        """Parse and verify a header + data record; CorruptBlockError if it does not check out."""
        return cls.from_parts(record[:RECORD_HEADER_BYTES], record[RECORD_HEADER_BYTES:])

    @classmethod
    def from_parts(cls, header: bytes, data: bytes) -> StoredBlock:
        """Verify ``data`` against a record header read separately (no copy of ``data``)."""
        if len(header) != RECORD_HEADER_BYTES:
            raise CorruptBlockError(f"record header of {len(header)} bytes (truncated)")
        magic, checksum, size = _RECORD_HEADER.unpack(header)
        if magic != _RECORD_MAGIC:
            raise CorruptBlockError(f"bad record magic {magic!r}")
        if len(data) != size:
            raise CorruptBlockError(f"record holds {len(data)} bytes, header says {size}")
        if crc32(data) != checksum:
            raise CorruptBlockError("CRC-32 mismatch")
        return cls(data, checksum)


class PutOutcome(enum.IntEnum):
    """What a put did with one block (values are the proto's PutOutcome numbers)."""

    STORED = 1
    ALREADY_STORED = 2
    NO_ROOM = 3
    CORRUPT = 4
