from kvmesh.protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AddRequestRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "detokenize_params", "priority", "cache_salt", "client_id", "parallel_group", "kv_transfer", "lora_request", "resumed_output_token_ids", "num_migrations")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    DETOKENIZE_PARAMS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_GROUP_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    LORA_REQUEST_FIELD_NUMBER: _ClassVar[int]
    RESUMED_OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _common_pb2.SamplingParams
    detokenize_params: _common_pb2.DetokenizeParams
    priority: int
    cache_salt: str
    client_id: str
    parallel_group: str
    kv_transfer: KVTransferParams
    lora_request: _common_pb2.LoRARequest
    resumed_output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_migrations: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., detokenize_params: _Optional[_Union[_common_pb2.DetokenizeParams, _Mapping]] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., client_id: _Optional[str] = ..., parallel_group: _Optional[str] = ..., kv_transfer: _Optional[_Union[KVTransferParams, _Mapping]] = ..., lora_request: _Optional[_Union[_common_pb2.LoRARequest, _Mapping]] = ..., resumed_output_token_ids: _Optional[_Iterable[int]] = ..., num_migrations: _Optional[int] = ...) -> None: ...

class AddRequestResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AbortRequestsRequest(_message.Message):
    __slots__ = ("request_ids", "client_id")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    client_id: str
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., client_id: _Optional[str] = ...) -> None: ...

class AbortRequestsResponse(_message.Message):
    __slots__ = ("aborted_ids",)
    ABORTED_IDS_FIELD_NUMBER: _ClassVar[int]
    aborted_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, aborted_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class FinishRequestsRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class FinishRequestsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResyncRequestsRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ResyncRequestsResponse(_message.Message):
    __slots__ = ("unknown_ids",)
    UNKNOWN_IDS_FIELD_NUMBER: _ClassVar[int]
    unknown_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, unknown_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class StreamOutputsRequest(_message.Message):
    __slots__ = ("subscriber",)
    SUBSCRIBER_FIELD_NUMBER: _ClassVar[int]
    subscriber: str
    def __init__(self, subscriber: _Optional[str] = ...) -> None: ...

class RequestHeader(_message.Message):
    __slots__ = ("prompt_token_ids", "detokenize_params", "client_id", "arrival_time", "trace_context", "output_token_ids")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DETOKENIZE_PARAMS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_TIME_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    detokenize_params: _common_pb2.DetokenizeParams
    client_id: str
    arrival_time: float
    trace_context: _containers.ScalarMap[str, str]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., detokenize_params: _Optional[_Union[_common_pb2.DetokenizeParams, _Mapping]] = ..., client_id: _Optional[str] = ..., arrival_time: _Optional[float] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., output_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class RequestOutput(_message.Message):
    __slots__ = ("request_id", "new_token_ids", "finish_reason", "stop_token_id", "logprobs", "num_prompt_tokens", "num_cached_tokens", "header", "error", "prompt_logprobs", "pooled_data")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POOLED_DATA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _common_pb2.FinishReason
    stop_token_id: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    num_prompt_tokens: int
    num_cached_tokens: int
    header: RequestHeader
    error: str
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    pooled_data: bytes
    def __init__(self, request_id: _Optional[str] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., header: _Optional[_Union[RequestHeader, _Mapping]] = ..., error: _Optional[str] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., pooled_data: _Optional[bytes] = ...) -> None: ...

class StepOutputs(_message.Message):
    __slots__ = ("step_id", "outputs")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    outputs: _containers.RepeatedCompositeFieldContainer[RequestOutput]
    def __init__(self, step_id: _Optional[int] = ..., outputs: _Optional[_Iterable[_Union[RequestOutput, _Mapping]]] = ...) -> None: ...

class CheckReadyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckReadyResponse(_message.Message):
    __slots__ = ("detail",)
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    detail: str
    def __init__(self, detail: _Optional[str] = ...) -> None: ...

class GetSchedulerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SchedulerInfo(_message.Message):
    __slots__ = ("model_name", "max_model_len", "vocab_size", "eos_token_ids", "num_kv_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_waiting_requests", "dtype", "dtype_reason", "quantization", "runner", "pooling_tasks", "embedding_dim", "matryoshka_dimensions", "labels", "weight_bytes", "batch_invariant")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_REASON_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    RUNNER_FIELD_NUMBER: _ClassVar[int]
    POOLING_TASKS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_DIM_FIELD_NUMBER: _ClassVar[int]
    MATRYOSHKA_DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    BATCH_INVARIANT_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_kv_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_waiting_requests: int
    dtype: str
    dtype_reason: str
    quantization: str
    runner: str
    pooling_tasks: _containers.RepeatedScalarFieldContainer[str]
    embedding_dim: int
    matryoshka_dimensions: _containers.RepeatedScalarFieldContainer[int]
    labels: _containers.RepeatedScalarFieldContainer[str]
    weight_bytes: int
    batch_invariant: bool
    def __init__(self, model_name: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., num_kv_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., max_waiting_requests: _Optional[int] = ..., dtype: _Optional[str] = ..., dtype_reason: _Optional[str] = ..., quantization: _Optional[str] = ..., runner: _Optional[str] = ..., pooling_tasks: _Optional[_Iterable[str]] = ..., embedding_dim: _Optional[int] = ..., matryoshka_dimensions: _Optional[_Iterable[int]] = ..., labels: _Optional[_Iterable[str]] = ..., weight_bytes: _Optional[int] = ..., batch_invariant: _Optional[bool] = ...) -> None: ...

class StreamKVEventsRequest(_message.Message):
    __slots__ = ("from_sequence", "instance_id", "subscriber")
    FROM_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIBER_FIELD_NUMBER: _ClassVar[int]
    from_sequence: int
    instance_id: int
    subscriber: str
    def __init__(self, from_sequence: _Optional[int] = ..., instance_id: _Optional[int] = ..., subscriber: _Optional[str] = ...) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("instance_id", "sequence", "resync", "events", "load", "timestamp")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    instance_id: int
    sequence: int
    resync: bool
    events: _containers.RepeatedCompositeFieldContainer[KVCacheEvent]
    load: ReplicaLoad
    timestamp: float
    def __init__(self, instance_id: _Optional[int] = ..., sequence: _Optional[int] = ..., resync: _Optional[bool] = ..., events: _Optional[_Iterable[_Union[KVCacheEvent, _Mapping]]] = ..., load: _Optional[_Union[ReplicaLoad, _Mapping]] = ..., timestamp: _Optional[float] = ...) -> None: ...

class KVCacheEvent(_message.Message):
    __slots__ = ("stored", "removed", "all_cleared")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    ALL_CLEARED_FIELD_NUMBER: _ClassVar[int]
    stored: BlockStored
    removed: BlockRemoved
    all_cleared: AllBlocksCleared
    def __init__(self, stored: _Optional[_Union[BlockStored, _Mapping]] = ..., removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., all_cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("block_hashes", "parent_block_hash", "block_size")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_block_hash: bytes
    block_size: int
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., parent_block_hash: _Optional[bytes] = ..., block_size: _Optional[int] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaLoad(_message.Message):
    __slots__ = ("num_running", "num_waiting", "num_active_blocks", "num_kv_blocks", "num_waiting_blocks")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_ACTIVE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    num_active_blocks: int
    num_kv_blocks: int
    num_waiting_blocks: int
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_active_blocks: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., num_waiting_blocks: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "cache_salt", "priority", "parallel_group")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_GROUP_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    priority: int
    parallel_group: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ..., priority: _Optional[int] = ..., parallel_group: _Optional[str] = ...) -> None: ...

class KVTransferParams(_message.Message):
    __slots__ = ("lease_ids", "num_stored_tokens")
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_STORED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    lease_ids: _containers.RepeatedScalarFieldContainer[int]
    num_stored_tokens: int
    def __init__(self, lease_ids: _Optional[_Iterable[int]] = ..., num_stored_tokens: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("kv_transfer",)
    KV_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    kv_transfer: KVTransferParams
    def __init__(self, kv_transfer: _Optional[_Union[KVTransferParams, _Mapping]] = ...) -> None: ...
