from kvmesh.protos import common_pb2 as _common_pb2
from kvmesh.protos import kvstore_pb2 as _kvstore_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrepareStructuredOutputRequest(_message.Message):
    __slots__ = ("request_id", "structured_output")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    structured_output: _common_pb2.StructuredOutput
    def __init__(self, request_id: _Optional[str] = ..., structured_output: _Optional[_Union[_common_pb2.StructuredOutput, _Mapping]] = ...) -> None: ...

class PrepareStructuredOutputResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("req_id", "prompt_token_ids", "output_token_ids", "sampling_params", "block_ids", "num_computed_tokens", "lora_request", "trace_context", "group_block_ids")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LORA_REQUEST_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    GROUP_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _common_pb2.SamplingParams
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    lora_request: _common_pb2.LoRARequest
    trace_context: _containers.ScalarMap[str, str]
    group_block_ids: _containers.RepeatedCompositeFieldContainer[BlockIds]
    def __init__(self, req_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., lora_request: _Optional[_Union[_common_pb2.LoRARequest, _Mapping]] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., group_block_ids: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ...) -> None: ...

class CachedRequests(_message.Message):
    __slots__ = ("req_ids", "new_block_ids", "num_computed_tokens", "new_group_block_ids")
    REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_GROUP_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    req_ids: _containers.RepeatedScalarFieldContainer[str]
    new_block_ids: _containers.RepeatedCompositeFieldContainer[BlockIds]
    num_computed_tokens: _containers.RepeatedScalarFieldContainer[int]
    new_group_block_ids: _containers.RepeatedCompositeFieldContainer[GroupBlockIds]
    def __init__(self, req_ids: _Optional[_Iterable[str]] = ..., new_block_ids: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ..., num_computed_tokens: _Optional[_Iterable[int]] = ..., new_group_block_ids: _Optional[_Iterable[_Union[GroupBlockIds, _Mapping]]] = ...) -> None: ...

class GroupBlockIds(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[BlockIds]
    def __init__(self, groups: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ...) -> None: ...

class BlockIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("step_id", "new_requests", "cached_requests", "scheduled_req_ids", "num_scheduled_tokens", "finished_req_ids", "kv_connector_metadata", "spec_token_ids")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CACHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_CONNECTOR_METADATA_FIELD_NUMBER: _ClassVar[int]
    SPEC_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequest]
    cached_requests: CachedRequests
    scheduled_req_ids: _containers.RepeatedScalarFieldContainer[str]
    num_scheduled_tokens: _containers.RepeatedScalarFieldContainer[int]
    finished_req_ids: _containers.RepeatedScalarFieldContainer[str]
    kv_connector_metadata: KVConnectorMetadata
    spec_token_ids: _containers.RepeatedCompositeFieldContainer[BlockIds]
    def __init__(self, step_id: _Optional[int] = ..., new_requests: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ..., cached_requests: _Optional[_Union[CachedRequests, _Mapping]] = ..., scheduled_req_ids: _Optional[_Iterable[str]] = ..., num_scheduled_tokens: _Optional[_Iterable[int]] = ..., finished_req_ids: _Optional[_Iterable[str]] = ..., kv_connector_metadata: _Optional[_Union[KVConnectorMetadata, _Mapping]] = ..., spec_token_ids: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ...) -> None: ...

class KVTransfer(_message.Message):
    __slots__ = ("req_id", "block_ids", "block_hashes")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, req_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class KVConnectorMetadata(_message.Message):
    __slots__ = ("loads", "saves")
    LOADS_FIELD_NUMBER: _ClassVar[int]
    SAVES_FIELD_NUMBER: _ClassVar[int]
    loads: _containers.RepeatedCompositeFieldContainer[KVTransfer]
    saves: _containers.RepeatedCompositeFieldContainer[KVTransfer]
    def __init__(self, loads: _Optional[_Iterable[_Union[KVTransfer, _Mapping]]] = ..., saves: _Optional[_Iterable[_Union[KVTransfer, _Mapping]]] = ...) -> None: ...

class KVLoadResult(_message.Message):
    __slots__ = ("req_id", "num_loaded_blocks")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_LOADED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    num_loaded_blocks: int
    def __init__(self, req_id: _Optional[str] = ..., num_loaded_blocks: _Optional[int] = ...) -> None: ...

class KVConnectorOutput(_message.Message):
    __slots__ = ("finished_loads", "saved_block_hashes", "failed_save_hashes")
    FINISHED_LOADS_FIELD_NUMBER: _ClassVar[int]
    SAVED_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    FAILED_SAVE_HASHES_FIELD_NUMBER: _ClassVar[int]
    finished_loads: _containers.RepeatedCompositeFieldContainer[KVLoadResult]
    saved_block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    failed_save_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, finished_loads: _Optional[_Iterable[_Union[KVLoadResult, _Mapping]]] = ..., saved_block_hashes: _Optional[_Iterable[bytes]] = ..., failed_save_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("req_id", "start_position", "logprobs")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    start_position: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, req_id: _Optional[str] = ..., start_position: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "req_ids", "sampled_token_ids", "errors", "execute_seconds", "kv_connector_output", "prompt_logprobs", "logprobs", "pooled")
    class ErrorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class PooledEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    EXECUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_CONNECTOR_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POOLED_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    req_ids: _containers.RepeatedScalarFieldContainer[str]
    sampled_token_ids: _containers.RepeatedCompositeFieldContainer[BlockIds]
    errors: _containers.ScalarMap[str, str]
    execute_seconds: float
    kv_connector_output: KVConnectorOutput
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobs]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobsList]
    pooled: _containers.ScalarMap[str, bytes]
    def __init__(self, step_id: _Optional[int] = ..., req_ids: _Optional[_Iterable[str]] = ..., sampled_token_ids: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ..., errors: _Optional[_Mapping[str, str]] = ..., execute_seconds: _Optional[float] = ..., kv_connector_output: _Optional[_Union[KVConnectorOutput, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobs, _Mapping]]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobsList, _Mapping]]] = ..., pooled: _Optional[_Mapping[str, bytes]] = ...) -> None: ...

class TokenLogprobsList(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, entries: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class GetWorkerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("model_name", "num_kv_blocks", "block_size", "max_model_len", "vocab_size", "eos_token_ids", "attention_backend", "device", "kv_layout", "max_loras", "max_lora_rank", "tensor_parallel_size", "pipeline_parallel_size", "dtype", "dtype_reason", "pipeline_overlap", "quantization", "step_token_budget", "runner", "pooling_tasks", "embedding_dim", "matryoshka_dimensions", "labels", "weight_bytes", "batch_invariant", "kv_cache_group_windows")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_REASON_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_OVERLAP_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    STEP_TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    RUNNER_FIELD_NUMBER: _ClassVar[int]
    POOLING_TASKS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_DIM_FIELD_NUMBER: _ClassVar[int]
    MATRYOSHKA_DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    BATCH_INVARIANT_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_GROUP_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    attention_backend: str
    device: str
    kv_layout: _kvstore_pb2.KVLayout
    max_loras: int
    max_lora_rank: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    dtype: str
    dtype_reason: str
    pipeline_overlap: bool
    quantization: str
    step_token_budget: int
    runner: str
    pooling_tasks: _containers.RepeatedScalarFieldContainer[str]
    embedding_dim: int
    matryoshka_dimensions: _containers.RepeatedScalarFieldContainer[int]
    labels: _containers.RepeatedScalarFieldContainer[str]
    weight_bytes: int
    batch_invariant: bool
    kv_cache_group_windows: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model_name: _Optional[str] = ..., num_kv_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., attention_backend: _Optional[str] = ..., device: _Optional[str] = ..., kv_layout: _Optional[_Union[_kvstore_pb2.KVLayout, _Mapping]] = ..., max_loras: _Optional[int] = ..., max_lora_rank: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., pipeline_parallel_size: _Optional[int] = ..., dtype: _Optional[str] = ..., dtype_reason: _Optional[str] = ..., pipeline_overlap: _Optional[bool] = ..., quantization: _Optional[str] = ..., step_token_budget: _Optional[int] = ..., runner: _Optional[str] = ..., pooling_tasks: _Optional[_Iterable[str]] = ..., embedding_dim: _Optional[int] = ..., matryoshka_dimensions: _Optional[_Iterable[int]] = ..., labels: _Optional[_Iterable[str]] = ..., weight_bytes: _Optional[int] = ..., batch_invariant: _Optional[bool] = ..., kv_cache_group_windows: _Optional[_Iterable[int]] = ...) -> None: ...
