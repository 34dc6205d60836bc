"""Per-service configs (and the launcher's): every flag of ``kvmesh serve`` and ``kvmesh up``.

Every option has one globally unique name (``scheduler_port``, not ``port``),
so one environment file configures the whole stack and the launcher can hand
the same environment to every process. Ports and addresses are named per
service on purpose.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvmesh.services.runtime.config.choices import (
    ATTENTION_BACKENDS,
    AUTO_DTYPE,
    CONVERTS,
    DTYPE_CHOICES,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    REASONING_PARSERS,
    REPLICA_DISCOVERIES,
    ROUTING_POLICIES,
    RUNNERS,
    SCHEDULING_POLICIES,
    TOOL_CALL_PARSERS,
)
from kvmesh.services.runtime.config.options import Options, opt
from kvmesh.services.runtime.config.speculative import SpeculativeConfig, parse_speculative_config

DEFAULT_HOST = "127.0.0.1"
# The longest context served when --max-model-len is 0: the model may allow
# more, but every extra position costs KV cache and the persistent batch's
# token array. kvmesh.worker.config applies it.
DEFAULT_MAX_MODEL_LEN = 2048
# The name internal certificates are issued for and clients check (the stack's
# certificates: services/runtime/stack_credentials.py).
INTERNAL_TLS_SERVER_NAME = "kvmesh-internal"


def port(default: int, help: str) -> int:
    return opt(default, help, minimum=1, maximum=65535)


@dataclass(frozen=True)
class CommonConfig(Options):
    """Options every service understands."""

    bind_host: str = opt(DEFAULT_HOST, "interface the service listens on (0.0.0.0 in containers)")
    log_level: str = opt("INFO", "logging level")
    otlp_traces_endpoint: str = opt(
        "",
        "OTLP/gRPC collector (e.g. http://jaeger:4317) that receives one OpenTelemetry trace "
        "per request across the services (empty: tracing off, the SDK never loaded)",
    )
    # Internal traffic (services/runtime/grpc_security.py): a shared token, mutual TLS, or both.
    internal_auth_token: str = opt(
        "",
        "shared secret every internal gRPC call carries; servers refuse calls without it "
        "(UNAUTHENTICATED) except grpc.health.v1 (empty: internal ports accept any caller; "
        "`kvmesh up` makes one per stack). Prefer the variable: a flag shows in `ps`",
    )
    internal_tls_certfile: str = opt(
        "", "PEM certificate this service presents on internal calls, as server and as client"
    )
    internal_tls_keyfile: str = opt("", "PEM private key of --internal-tls-certfile")
    internal_tls_ca_certs: str = opt(
        "",
        "PEM CA bundle internal peers' certificates must chain to; with the cert and key set, "
        "internal ports take only mutual TLS",
    )
    internal_tls_server_name: str = opt(
        INTERNAL_TLS_SERVER_NAME,
        "name a client checks in the server's certificate instead of the dialed host, so one "
        "stack certificate serves every address ('': check the dialed host)",
    )
    metrics_bind_host: str = opt(
        "", "interface of the Prometheus /metrics server ('': --bind-host)"
    )
    expose_metrics: bool = opt(
        True, "serve Prometheus /metrics (--no-expose-metrics: no metrics endpoint at all)"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        tls_files = (
            self.internal_tls_certfile,
            self.internal_tls_keyfile,
            self.internal_tls_ca_certs,
        )
        if any(tls_files) and not all(tls_files):
            # Half of mutual TLS would be a plaintext port, or one that trusts any CA.
            raise ValueError(
                "internal TLS needs all of internal_tls_certfile, internal_tls_keyfile and "
                "internal_tls_ca_certs"
            )


@dataclass(frozen=True)
class KVStoreConfig(CommonConfig):
    """The KV block store service."""

    kvstore_port: int = port(50055, "gRPC port of the kvstore")
    kvstore_metrics_port: int = port(9104, "Prometheus port of the kvstore")
    kvstore_capacity_bytes: int = opt(
        1 << 30, "bytes of KV blocks the store keeps in memory", minimum=1
    )
    kvstore_high_watermark: float = opt(
        0.95, "memory use (fraction of capacity) past which eviction starts", minimum=0, maximum=1
    )
    kvstore_low_watermark: float = opt(
        0.90, "memory use (fraction) eviction brings it down to", minimum=0, maximum=1
    )
    kvstore_disk_path: str = opt("", "directory of the disk tier, owned by the store (empty: off)")
    kvstore_disk_bytes: int = opt(8 << 30, "capacity of the disk tier in bytes", minimum=1)
    kvstore_shared_fs_path: str = opt(
        "",
        "directory on a volume several kvstores mount (NFS, a ReadWriteMany claim, a path "
        "shared on one host): every committed block is written there and read back by any "
        "of them (empty: off; must exist and be writable)",
    )
    kvstore_shared_fs_bytes: int = opt(
        64 << 30,
        "bound on the shared-filesystem tier's bytes, the same for every kvstore sharing it "
        "(the least recently used blocks are evicted past it)",
        minimum=1,
    )
    kvstore_redis_url: str = opt("", "redis://host:port/db of the shared Redis tier (empty: off)")
    kvstore_max_lease_ttl_s: float = opt(
        300.0, "longest lease a caller may ask for, in seconds", minimum=0
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.kvstore_low_watermark <= self.kvstore_high_watermark <= 1:
            raise ValueError("need 0 < kvstore_low_watermark <= kvstore_high_watermark <= 1")
        if self.kvstore_max_lease_ttl_s <= 0:
            raise ValueError("kvstore_max_lease_ttl_s must be positive")
        if self.kvstore_disk_path and self.kvstore_shared_fs_path:
            disk = Path(self.kvstore_disk_path).resolve()
            shared = Path(self.kvstore_shared_fs_path).resolve()
            # The disk tier clears its directory at start; the shared one is other
            # kvstores' too.
            if disk == shared or disk in shared.parents or shared in disk.parents:
                raise ValueError(
                    "kvstore_disk_path (this kvstore's own, cleared at start) and "
                    "kvstore_shared_fs_path (shared with other kvstores) must not overlap"
                )


@dataclass(frozen=True)
class KVConnectorOptions(CommonConfig):
    """The KV connector's options, shared by the scheduler and the worker (one flag each)."""

    kv_offload: bool = opt(
        False,
        "use the kvstore as a second KV tier: save every full block there and load a "
        "prefix-cache miss from it (scheduler and worker; needs prefix caching)",
    )
    kvstore_addr: str = opt("127.0.0.1:50055", "host:port of the kvstore")


@dataclass(frozen=True)
class StepDeadlineOptions(CommonConfig):
    """When a step counts as hung (services/contracts/step_deadline.py): the scheduler then
    fails its worker over, and the worker marks itself not alive."""

    step_deadline_min_s: float = opt(
        10.0, "seconds any engine step may take before its worker counts as hung", minimum=0.1
    )
    step_deadline_p99_factor: float = opt(
        20.0,
        "a step may take this many times the p99 of recent steps (at least the min)",
        minimum=1,
    )
    step_deadline_cold_s: float = opt(
        300.0,
        "deadline of the first steps of a (re)started worker and of any step past the "
        "measured ones (also the most any step may take)",
        minimum=0.1,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.step_deadline_cold_s < self.step_deadline_min_s:
            raise ValueError("step_deadline_cold_s must be >= step_deadline_min_s")


@dataclass(frozen=True)
class ParallelOptions(CommonConfig):
    """Tensor/pipeline parallelism: one engine replica over several worker ranks
    (worker/parallel/). ``kvmesh up`` starts every rank; ``kvmesh serve worker``
    runs the one ``--rank`` names."""

    tensor_parallel_size: int = opt(
        1, "worker ranks each layer is split across (heads, MLP, vocab)", minimum=1
    )
    pipeline_parallel_size: int = opt(
        1, "pipeline stages the layers are split into (contiguous ranges)", minimum=1
    )
    rank: int = opt(
        0,
        "this worker's rank in its replica (0: the driver, which serves the scheduler)",
        minimum=0,
    )
    world_size: int = opt(
        0, "ranks in the replica (0: tensor x pipeline parallel size, else equal to it)", minimum=0
    )
    dist_init_addr: str = opt(
        "127.0.0.1:29500", "host:port of rank 0's torch.distributed rendezvous (TCP store)"
    )
    pipeline_overlap: bool = opt(
        True,
        "pipeline parallel: the driver begins a step while earlier ones are in later stages, "
        "and the scheduler keeps one micro-batch per stage in flight (--no-pipeline-overlap: "
        "one step at a time)",
    )
    dist_timeout_s: float = opt(
        120.0,
        "seconds a collective may wait for a peer rank before this rank gives up and exits "
        "(the launcher then restarts the replica)",
        minimum=1,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        ranks = self.tensor_parallel_size * self.pipeline_parallel_size
        if self.world_size and self.world_size != ranks:
            raise ValueError(
                f"world_size {self.world_size} != tensor_parallel_size x "
                f"pipeline_parallel_size ({ranks})"
            )
        if self.rank >= ranks:
            raise ValueError(f"rank {self.rank} outside a replica of {ranks} ranks")


@dataclass(frozen=True)
class MigrationOptions(CommonConfig):
    """Request migration (scheduler and gateway, one flag): a request whose stage
    died resumes elsewhere with its tokens so far, at most this often."""

    max_migrations: int = opt(
        3,
        "times one request may be resumed after losing its worker or scheduler; beyond it "
        "the request fails (stops a request that kills its stage from cycling)",
        minimum=0,
    )
    migration_timeout_s: float = opt(
        60.0,
        "seconds a request waits for a lost stage to come back (scheduler: a detokenizer "
        "to subscribe; gateway: a detokenizer or scheduler to answer, and a new request "
        "for an engine replica to route to) before it fails",
        minimum=0.1,
    )


@dataclass(frozen=True)
class LoRAOptions(CommonConfig):
    """Multi-LoRA serving (vLLM's flags), shared by the gateway and the worker (one flag each)."""

    enable_lora: bool = opt(
        False, "serve PEFT LoRA adapters next to the base model (gateway and worker)"
    )
    lora_modules: tuple[str, ...] = opt(
        (),
        "adapters served from the start, as name=path (a folder with adapter_config.json and "
        "adapter_model.safetensors); clients pick one with model=name (gateway)",
    )
    max_loras: int = opt(
        1, "adapter slots: the most distinct adapters one step mixes (worker)", minimum=1
    )
    max_lora_rank: int = opt(16, "the highest adapter rank served (worker)", minimum=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        for module in self.lora_modules:
            name, sep, path = module.partition("=")
            if not (sep and name and path):
                raise ValueError(f"lora_modules entries are name=path, got {module!r}")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora")

    @property
    def lora_module_paths(self) -> dict[str, str]:
        """Adapter name -> folder, in the order given."""
        return dict(module.partition("=")[::2] for module in self.lora_modules)


@dataclass(frozen=True)
class WorkerConfig(KVConnectorOptions, StepDeadlineOptions, ParallelOptions, LoRAOptions):
    """The model worker service."""

    model: str = opt(
        "",
        "Hugging Face checkpoint folder or .gguf file (Q4_0/Q4_1/Q8_0 kept as codes; "
        "default: the prepared SmolLM2)",
    )
    served_model_name: str = opt("", "model name reported by the API (default: folder name)")
    worker_port: int = port(50053, "gRPC port of the worker")
    worker_metrics_port: int = port(9102, "Prometheus port of the worker")
    device: str = opt("cpu", "torch device for the model")
    dtype: str = opt(
        AUTO_DTYPE,
        "compute dtype; auto: bfloat16 on a CPU with AMX or AVX512-BF16 (and on "
        "CUDA with bf16), float32 on other CPUs; the worker logs why",
        choices=DTYPE_CHOICES,
    )
    quantization: str = opt(
        "",
        "int8: quantize the decoder's projections at load, weight-only, symmetric int8 "
        "per 32 input features (GGUF Q8_0's layout; CPU only); w8a8: the same weights "
        "(or a GGUF file's Q4_0/Q4_1/Q8_0 codes) times activations quantized per token to "
        "int8, multiplied with VNNI/AMX-INT8 integer dot products (needs the C++ CPU kernels; "
        "less accurate, docs/serving.md 'Quantized weights')",
        choices=QUANTIZATIONS,
    )
    runner: str = opt(
        "auto",
        "which runner serves the model, as vLLM's flag: auto (by the checkpoint: an encoder "
        "pools, a *ForCausalLM generates), generate, or pooling (a generation model then "
        "serves embeddings: --convert)",
        choices=RUNNERS,
    )
    convert: str = opt(
        "auto",
        "what a generation model becomes under the pooling runner, as vLLM's flag: embed "
        "(last-token hidden state, normalized, as Qwen3-Embedding; the folder's "
        "sentence-transformers pooling config wins where present) or classify (a yes/no "
        "reranker: needs --hf-overrides classifier_from_token); auto: embed under --runner "
        "pooling; embed or classify imply --runner pooling",
        choices=CONVERTS,
    )
    hf_overrides: str = opt(
        "",
        "JSON over the checkpoint config, as vLLM's flag; implemented: a decoder reranker's "
        '{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": '
        '["no", "yes"], "is_original_qwen3_reranker": true} (method from_2_way_softmax or '
        "no_post_processing); other keys are refused by name",
    )
    block_size: int = opt(16, "tokens per KV block (a power of two)", minimum=1)
    kv_cache_memory: int = opt(
        1 << 30, "bytes for the KV cache (ignored if num_kv_blocks is set)", minimum=0
    )
    kv_cache_dtype: str = opt(
        "auto",
        "KV cache element format, vLLM's names: auto (the model dtype), int8 or fp8_e4m3 "
        "(alias fp8) / fp8_e5m2 codes with one float32 scale per token per KV head: ~2x the "
        "blocks of a bfloat16 cache (~4x float32) in the same kv_cache_memory (docs/serving.md "
        "'Quantized KV cache')",
        choices=KV_CACHE_DTYPES,
    )
    num_kv_blocks: int = opt(
        0, "explicit number of KV blocks (0: derive from kv_cache_memory)", minimum=0
    )
    max_model_len: int = opt(
        0,
        "longest prompt + output in tokens (0: the model's max_position_embeddings, "
        f"at most {DEFAULT_MAX_MODEL_LEN}; the scheduler lowers it to what the KV cache holds)",
        minimum=0,
    )
    num_threads: int = opt(0, "torch intra-op threads for the worker (0: all cores)", minimum=0)
    attention_backend: str = opt(
        "", "force an attention backend ('': choose by device)", choices=ATTENTION_BACKENDS
    )
    batch_invariant: bool = opt(
        False,
        "batch-invariant mode (also VLLM_BATCH_INVARIANT=1): a request's logits, and so its "
        "greedy and seeded tokens, do not depend on the batch, chunking, prefix-cache hits or "
        "preemption; CPU with the C++ kernels only; costs throughput (docs/performance.md, "
        "'Batch invariance')",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a positive power of two")
        if self.kv_cache_memory <= 0 and self.num_kv_blocks <= 0:
            raise ValueError("set kv_cache_memory or num_kv_blocks")


@dataclass(frozen=True)
class SchedulerServiceConfig(KVConnectorOptions, StepDeadlineOptions, MigrationOptions):
    """The scheduler service."""

    scheduler_port: int = port(50052, "gRPC port of the scheduler")
    scheduler_metrics_port: int = port(9101, "Prometheus port of the scheduler")
    worker_addr: str = opt("127.0.0.1:50053", "host:port of the worker")
    max_num_batched_tokens: int = opt(
        0,
        "token budget per engine step (0: what the worker's hardware runs best at: 1024 "
        "on CPUs, 2048 for bf16 on AMX and on accelerators)",
        minimum=0,
    )
    max_num_seqs: int = opt(128, "most requests per engine step", minimum=1)
    long_prefill_token_threshold: int = opt(
        0, "cap on one request's tokens per step (0: off)", minimum=0
    )
    scheduling_policy: str = opt(
        "fcfs",
        "order of the waiting queue and choice of preemption victims",
        choices=SCHEDULING_POLICIES,
    )
    prefix_caching: bool = opt(
        True, "reuse KV blocks of shared prefixes (--no-prefix-caching: off)"
    )
    max_waiting_requests: int = opt(4096, "queue bound; beyond it new requests get 429", minimum=1)
    # On by default: with the C++ kernels a decode step is ~22 ms and the
    # synchronous round trip left the worker idle 5-7% of the time; alternating
    # A/B runs of the 64x128/128 workload: +2.4% on average (3 pairs).
    async_scheduling: bool = opt(
        True, "schedule step n+1 while the worker runs step n (--no-async-scheduling: off)"
    )
    kv_transfer_lease_ttl_s: float = opt(
        30.0,
        "disaggregation: seconds a prefilled prompt's blocks stay leased in the kvstore for the "
        "decode replica (which ends the lease sooner, once its request ran)",
        minimum=0.001,
    )
    speculative_config: str = opt(
        "",
        'speculative decoding as vLLM\'s JSON, e.g. {"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5} or '
        '{"method": "suffix"}; turns async scheduling off (empty: off)',
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        parse_speculative_config(self.speculative_config)  # refuse a bad flag at start-up

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return parse_speculative_config(self.speculative_config)


@dataclass(frozen=True)
class DetokenizerConfig(CommonConfig):
    """The detokenizer service."""

    model: str = opt("", "Hugging Face checkpoint folder or .gguf file whose tokenizer is used")
    detokenizer_port: int = port(50054, "gRPC port of the detokenizer")
    detokenizer_metrics_port: int = port(9103, "Prometheus port of the detokenizer")
    scheduler_addr: str = opt("127.0.0.1:50052", "host:port of the scheduler")


@dataclass(frozen=True)
class GatewayConfig(MigrationOptions, LoRAOptions):
    """The gateway service (OpenAI HTTP API + public gRPC API)."""

    model: str = opt("", "checkpoint folder or .gguf file whose tokenizer and template are used")
    served_model_name: str = opt("", "model name reported by the API (default: folder name)")
    http_port: int = port(
        8000, "OpenAI-compatible HTTP port (also /metrics unless --gateway-metrics-port)"
    )
    gateway_metrics_port: int = opt(
        0,
        "serve /metrics on this port, on --metrics-bind-host, and not on the HTTP port "
        "(0: on the HTTP port, as vLLM)",
        minimum=0,
        maximum=65535,
    )
    ssl_certfile: str = opt("", "PEM certificate of the public HTTP and gRPC ports (empty: no TLS)")
    ssl_keyfile: str = opt("", "PEM private key of --ssl-certfile")
    ssl_ca_certs: str = opt("", "PEM CA bundle that client certificates must chain to")
    ssl_cert_reqs: int = opt(
        0,
        "client certificates on the public ports, as Python's ssl.CERT_*: 0 none, 1 optional "
        "(HTTP; the gRPC port then requires none), 2 required",
        minimum=0,
        maximum=2,
    )
    grpc_port: int = port(50051, "public gRPC port (kvmesh.v1.Generation)")
    scheduler_addr: str = opt(
        "127.0.0.1:50052",
        "host:port of the scheduler (static discovery); with dns discovery, the name "
        "whose A records are the replicas (a headless Service) and their scheduler port",
    )
    detokenizer_addr: str = opt(
        "127.0.0.1:50054",
        "host:port of the detokenizer (static discovery); with dns discovery only its port "
        "counts: each replica's detokenizer listens on its scheduler's address",
    )
    replica_discovery: str = opt(
        "static",
        "how the gateway learns its engine replicas: static (the one at --scheduler-addr), "
        "file (the replica set `kvmesh up` writes to --replica-set-file), dns (every A record "
        "of --scheduler-addr's host, e.g. a Kubernetes headless Service)",
        choices=REPLICA_DISCOVERIES,
    )
    replica_set_file: str = opt(
        "", "JSON file listing the replicas (file discovery; `kvmesh up` writes it)"
    )
    replica_poll_period_s: float = opt(
        1.0,
        "seconds between two looks at the replica set (file or DNS) and between readiness "
        "probes of each replica",
        minimum=0.05,
    )
    api_key: str = opt("", "if set, require 'Authorization: Bearer <key>' on /v1 routes")
    routing_policy: str = opt(
        "kv",
        "how a request picks an engine replica: kv (prefix overlap weighed against load), "
        "load (least loaded), round-robin",
        choices=ROUTING_POLICIES,
    )
    routing_overlap_weight: float = opt(
        1.0,
        "kv policy: how many blocks held by a replica's running requests one block of "
        "prompt to prefill is worth (Dynamo's kv-overlap-score-weight); higher favours "
        "cache hits (TTFT), lower spreads decode load (ITL)",
        minimum=0,
    )
    max_inflight_requests: int = opt(
        0,
        "generation calls (HTTP and gRPC) this gateway serves at once; past it, 429 before "
        "the body is read (0: what the engine holds, max_num_seqs + max_waiting_requests)",
        minimum=0,
    )
    http_backlog: int = opt(
        16384,
        "connections the HTTP port's accept queue holds (uvicorn's --backlog, default 2048 "
        "there; the kernel caps it at net.core.somaxconn): past it, new connections wait "
        "for SYN retries, 1 s, 3 s, 7 s... before the gateway can even refuse them",
        minimum=1,
    )
    max_request_body_bytes: int = opt(
        8 << 20,
        "largest HTTP request body (413 past it) and public gRPC message accepted",
        minimum=1024,
    )
    max_prompts_per_request: int = opt(
        128, "most prompts in one /v1/completions or Generate call", minimum=1
    )
    responses_max_stored: int = opt(
        4096,
        "/v1/responses kept (store true) for GET and previous_response_id, in this gateway's "
        "memory; past it the least recently used goes",
        minimum=1,
    )
    responses_ttl_s: float = opt(
        3600.0, "seconds a stored /v1/responses response is kept", minimum=1
    )
    responses_kvstore_addr: str = opt(
        "",
        "host:port of a kvstore that keeps /v1/responses for every gateway replica, so any "
        "of them continues a conversation (empty: this gateway's memory)",
    )
    # What one call may cost the engine (gateway/request_cost.py). The defaults
    # compose: n at most 16 of full 2,048-token contexts fits 32,768 tokens.
    max_n: int = opt(
        16,
        "most choices per prompt one call may ask for (n, best_of); 400 past it (vLLM has no "
        "bound, OpenAI's is 128)",
        minimum=1,
        maximum=128,
    )
    max_tokens_limit: int = opt(
        0,
        "largest max_tokens (max_completion_tokens) a choice may ask for, and the most a chat "
        "choice that names none gets; 400 past it (0: only --max-model-len bounds it)",
        minimum=0,
    )
    max_tokens_per_request: int = opt(
        32768,
        "most tokens one call may occupy in the engine: over its prompts x n choices, prompt "
        "tokens + max_tokens; 400 past it (bounds what one call holds of a batch)",
        minimum=1,
    )
    prefill_scheduler_addr: str = opt(
        "",
        "host:port of a prefill replica's scheduler: each prompt is prefilled there first and "
        "its KV handed to the scheduler above through the kvstore (empty: off)",
    )
    prefill_timeout_s: float = opt(
        60.0,
        "seconds a prefill may take before the decode replica computes the prompt itself",
        minimum=0.001,
    )
    reasoning_parser: str = opt(
        "",
        "split the model's thinking into reasoning_content, by its family's tags (empty: off)",
        choices=REASONING_PARSERS,
    )
    tool_call_parser: str = opt(
        "",
        "the model family's tool-call format, read out of the text for tool_choice auto "
        "(empty: the one the chat template implies, when it implies exactly one)",
        choices=TOOL_CALL_PARSERS,
    )
    enable_auto_tool_choice: bool = opt(
        False,
        'let tool_choice "auto" (the default with tools) parse calls out of the text with '
        "--tool-call-parser; without it such requests are refused, as vLLM does",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if bool(self.ssl_certfile) != bool(self.ssl_keyfile):
            raise ValueError("ssl_certfile and ssl_keyfile go together")
        if self.ssl_cert_reqs and not (self.ssl_certfile and self.ssl_ca_certs):
            raise ValueError("ssl_cert_reqs needs ssl_certfile, ssl_keyfile and ssl_ca_certs")


@dataclass(frozen=True)
class LauncherConfig(Options):
    """Options of ``kvmesh up`` itself (not handed to the services)."""

    startup_timeout: float = opt(
        900.0, "seconds to wait for the whole stack to be ready", minimum=1
    )
    max_restarts: int = opt(
        5,
        "restarts allowed per service within --restart-window-s before the launcher gives up",
        minimum=0,
    )
    restart_window_s: float = opt(
        60.0, "seconds over which --max-restarts counts a service's restarts", minimum=1
    )
    liveness_period_s: float = opt(
        5.0,
        "seconds between liveness probes of each service; 3 misses in a row (after its first "
        "answer) get it killed and restarted (0: off)",
        minimum=0,
    )
    disaggregated: bool = opt(
        False,
        "prefill/decode disaggregation: a second worker and scheduler (the prefill replica) "
        "compute each prompt, whose KV reaches the decode replica through the kvstore "
        "(implies --kv-offload)",
    )
    data_parallel_size: int = opt(
        1,
        "engine replicas (each a scheduler, a worker and a detokenizer with its own KV pool) "
        "behind the gateway, which routes by --routing-policy; the workers split the cores",
        minimum=1,
    )
    replica_port_offset: int = opt(
        100,
        "replica i (from 0) listens on each of its ports plus i times this offset",
        minimum=1,
    )
    prefill_worker_port: int = port(50056, "gRPC port of the prefill replica's worker")
    prefill_worker_metrics_port: int = port(9105, "Prometheus port of the prefill replica's worker")
    prefill_scheduler_port: int = port(50057, "gRPC port of the prefill replica's scheduler")
    prefill_scheduler_metrics_port: int = port(
        9106, "Prometheus port of the prefill replica's scheduler"
    )
    internal_auth: bool = opt(
        True,
        "make a random --internal-auth-token for this stack when none is given "
        "(--no-internal-auth: internal ports accept any local caller)",
    )
    internal_tls: bool = opt(
        False,
        "make a throwaway CA and certificate for this stack (openssl on PATH) and run every "
        "internal call over mutual TLS, unless --internal-tls-* files are given",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.disaggregated and self.data_parallel_size > 1:
            raise ValueError("--disaggregated runs one decode replica: use --data-parallel-size 1")


SERVICE_CONFIGS: dict[str, type] = {
    "gateway": GatewayConfig,
    "scheduler": SchedulerServiceConfig,
    "worker": WorkerConfig,
    "detokenizer": DetokenizerConfig,
    "kvstore": KVStoreConfig,
}
