from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVBlock(_message.Message):
    __slots__ = ("key", "data")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    data: bytes
    def __init__(self, key: _Optional[bytes] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutBlocksRequest(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[KVBlock]
    def __init__(self, blocks: _Optional[_Iterable[_Union[KVBlock, _Mapping]]] = ...) -> None: ...

class PutBlocksResponse(_message.Message):
    __slots__ = ("stored",)
    STORED_FIELD_NUMBER: _ClassVar[int]
    stored: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, stored: _Optional[_Iterable[bool]] = ...) -> None: ...

class GetBlocksRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class GetBlocksResponse(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[KVBlock]
    def __init__(self, blocks: _Optional[_Iterable[_Union[KVBlock, _Mapping]]] = ...) -> None: ...

class ContainsBlocksRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ContainsBlocksResponse(_message.Message):
    __slots__ = ("present",)
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    present: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, present: _Optional[_Iterable[bool]] = ...) -> None: ...

class DeleteBlocksRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DeleteBlocksResponse(_message.Message):
    __slots__ = ("num_deleted",)
    NUM_DELETED_FIELD_NUMBER: _ClassVar[int]
    num_deleted: int
    def __init__(self, num_deleted: _Optional[int] = ...) -> None: ...

class LeaseBlocksRequest(_message.Message):
    __slots__ = ("keys", "ttl_seconds")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    ttl_seconds: float
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., ttl_seconds: _Optional[float] = ...) -> None: ...

class LeaseBlocksResponse(_message.Message):
    __slots__ = ("lease_id", "leased")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASED_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    leased: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, lease_id: _Optional[str] = ..., leased: _Optional[_Iterable[bool]] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseLeaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVStoreStats(_message.Message):
    __slots__ = ("num_blocks", "bytes_used", "capacity_bytes", "hits", "misses", "evictions")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    bytes_used: int
    capacity_bytes: int
    hits: int
    misses: int
    evictions: int
    def __init__(self, num_blocks: _Optional[int] = ..., bytes_used: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ...) -> None: ...
