from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PutOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PUT_OUTCOME_UNSPECIFIED: _ClassVar[PutOutcome]
    PUT_OUTCOME_STORED: _ClassVar[PutOutcome]
    PUT_OUTCOME_ALREADY_STORED: _ClassVar[PutOutcome]
    PUT_OUTCOME_NO_ROOM: _ClassVar[PutOutcome]
    PUT_OUTCOME_CORRUPT: _ClassVar[PutOutcome]
PUT_OUTCOME_UNSPECIFIED: PutOutcome
PUT_OUTCOME_STORED: PutOutcome
PUT_OUTCOME_ALREADY_STORED: PutOutcome
PUT_OUTCOME_NO_ROOM: PutOutcome
PUT_OUTCOME_CORRUPT: PutOutcome

class KVLayout(_message.Message):
    __slots__ = ("model", "dtype", "block_size", "layout_version", "tp_rank", "tp_size")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    block_size: int
    layout_version: int
    tp_rank: int
    tp_size: int
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., layout_version: _Optional[int] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ...) -> None: ...

class LookupPrefixRequest(_message.Message):
    __slots__ = ("layouts", "block_hashes")
    LAYOUTS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    layouts: _containers.RepeatedCompositeFieldContainer[KVLayout]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, layouts: _Optional[_Iterable[_Union[KVLayout, _Mapping]]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupPrefixResponse(_message.Message):
    __slots__ = ("num_prefix_blocks",)
    NUM_PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_prefix_blocks: int
    def __init__(self, num_prefix_blocks: _Optional[int] = ...) -> None: ...

class PutChunk(_message.Message):
    __slots__ = ("layout", "begin", "data", "commit")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    layout: KVLayout
    begin: PutBegin
    data: bytes
    commit: PutCommit
    def __init__(self, layout: _Optional[_Union[KVLayout, _Mapping]] = ..., begin: _Optional[_Union[PutBegin, _Mapping]] = ..., data: _Optional[bytes] = ..., commit: _Optional[_Union[PutCommit, _Mapping]] = ...) -> None: ...

class PutBegin(_message.Message):
    __slots__ = ("block_hash", "size")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    block_hash: bytes
    size: int
    def __init__(self, block_hash: _Optional[bytes] = ..., size: _Optional[int] = ...) -> None: ...

class PutCommit(_message.Message):
    __slots__ = ("crc32",)
    CRC32_FIELD_NUMBER: _ClassVar[int]
    crc32: int
    def __init__(self, crc32: _Optional[int] = ...) -> None: ...

class PutBlocksResponse(_message.Message):
    __slots__ = ("outcomes",)
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedScalarFieldContainer[PutOutcome]
    def __init__(self, outcomes: _Optional[_Iterable[_Union[PutOutcome, str]]] = ...) -> None: ...

class GetBlocksRequest(_message.Message):
    __slots__ = ("layout", "block_hashes", "lease_ttl_seconds")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    layout: KVLayout
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    lease_ttl_seconds: float
    def __init__(self, layout: _Optional[_Union[KVLayout, _Mapping]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., lease_ttl_seconds: _Optional[float] = ...) -> None: ...

class GetBlocksHeader(_message.Message):
    __slots__ = ("found", "lease_id", "leased")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASED_FIELD_NUMBER: _ClassVar[int]
    found: _containers.RepeatedScalarFieldContainer[bool]
    lease_id: int
    leased: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, found: _Optional[_Iterable[bool]] = ..., lease_id: _Optional[int] = ..., leased: _Optional[_Iterable[bool]] = ...) -> None: ...

class BlockBegin(_message.Message):
    __slots__ = ("block_hash", "size", "crc32")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    block_hash: bytes
    size: int
    crc32: int
    def __init__(self, block_hash: _Optional[bytes] = ..., size: _Optional[int] = ..., crc32: _Optional[int] = ...) -> None: ...

class GetBlocksChunk(_message.Message):
    __slots__ = ("header", "begin", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: GetBlocksHeader
    begin: BlockBegin
    data: bytes
    def __init__(self, header: _Optional[_Union[GetBlocksHeader, _Mapping]] = ..., begin: _Optional[_Union[BlockBegin, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class LeaseBlocksRequest(_message.Message):
    __slots__ = ("layout", "block_hashes", "ttl_seconds")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    layout: KVLayout
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    ttl_seconds: float
    def __init__(self, layout: _Optional[_Union[KVLayout, _Mapping]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., ttl_seconds: _Optional[float] = ...) -> None: ...

class LeaseBlocksResponse(_message.Message):
    __slots__ = ("lease_id", "leased")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASED_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    leased: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, lease_id: _Optional[int] = ..., leased: _Optional[_Iterable[bool]] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    def __init__(self, lease_id: _Optional[int] = ...) -> None: ...

class ReleaseLeaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class DeleteBlocksRequest(_message.Message):
    __slots__ = ("layout", "block_hashes")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    layout: KVLayout
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, layout: _Optional[_Union[KVLayout, _Mapping]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DeleteBlocksResponse(_message.Message):
    __slots__ = ("num_deleted",)
    NUM_DELETED_FIELD_NUMBER: _ClassVar[int]
    num_deleted: int
    def __init__(self, num_deleted: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "num_blocks", "bytes_used", "capacity_bytes", "hits", "evictions", "corrupt_blocks")
    TIER_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    tier: str
    num_blocks: int
    bytes_used: int
    capacity_bytes: int
    hits: int
    evictions: int
    corrupt_blocks: int
    def __init__(self, tier: _Optional[str] = ..., num_blocks: _Optional[int] = ..., bytes_used: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., hits: _Optional[int] = ..., evictions: _Optional[int] = ..., corrupt_blocks: _Optional[int] = ...) -> None: ...

class KVStoreStats(_message.Message):
    __slots__ = ("tiers", "misses", "num_leases", "inflight_puts", "failed_puts")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASES_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_PUTS_FIELD_NUMBER: _ClassVar[int]
    FAILED_PUTS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    misses: int
    num_leases: int
    inflight_puts: int
    failed_puts: int
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., misses: _Optional[int] = ..., num_leases: _Optional[int] = ..., inflight_puts: _Optional[int] = ..., failed_puts: _Optional[int] = ...) -> None: ...
