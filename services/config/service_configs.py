"""Per-service configs (and the launcher's): every flag of ``kvmesh serve`` and ``kvmesh up``.

Every option has one globally unique name (``scheduler_port``, not ``port``),
so one environment file configures the whole stack and the launcher can hand
the same environment to every process. Ports and addresses are named per
service on purpose.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.config.choices import (
    ATTENTION_BACKENDS,
    DTYPES,
    ROUTING_POLICIES,
    SCHEDULING_POLICIES,
)
from services.config.options import Options, opt

DEFAULT_HOST = "127.0.0.1"
# The longest context served when --max-model-len is 0: the model may allow
# more, but every extra position costs KV cache and the persistent batch's
# token array. worker.config applies it.
DEFAULT_MAX_MODEL_LEN = 2048


def port(default: int, help: str) -> int:
    return opt(default, help, minimum=1, maximum=65535)


@dataclass(frozen=True)
class CommonConfig(Options):
    """Options every service understands."""

    bind_host: str = opt(DEFAULT_HOST, "interface the service listens on (0.0.0.0 in containers)")
    log_level: str = opt("INFO", "logging level")


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
    """When a step counts as hung (services/step_deadline.py): the scheduler then
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
class WorkerConfig(KVConnectorOptions, StepDeadlineOptions, LoRAOptions):
    """The model worker service."""

    model: str = opt("", "Hugging Face checkpoint folder (default: the prepared SmolLM2)")
    served_model_name: str = opt("", "model name reported by the API (default: folder name)")
    worker_port: int = port(50053, "gRPC port of the worker")
    worker_metrics_port: int = port(9102, "Prometheus port of the worker")
    device: str = opt("cpu", "torch device for the model")
    dtype: str = opt(
        "float32",
        "compute dtype; float32 is the tuned CPU path (C++ kernels, block codes)",
        choices=DTYPES,
    )
    block_size: int = opt(16, "tokens per KV block (a power of two)", minimum=1)
    kv_cache_memory: int = opt(
        1 << 30, "bytes for the KV cache (ignored if num_kv_blocks is set)", minimum=0
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

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a positive power of two")
        if self.kv_cache_memory <= 0 and self.num_kv_blocks <= 0:
            raise ValueError("set kv_cache_memory or num_kv_blocks")


@dataclass(frozen=True)
class SchedulerServiceConfig(KVConnectorOptions, StepDeadlineOptions):
    """The scheduler service."""

    scheduler_port: int = port(50052, "gRPC port of the scheduler")
    scheduler_metrics_port: int = port(9101, "Prometheus port of the scheduler")
    worker_addr: str = opt("127.0.0.1:50053", "host:port of the worker")
    max_num_batched_tokens: int = opt(2048, "token budget per engine step", minimum=1)
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


@dataclass(frozen=True)
class DetokenizerConfig(CommonConfig):
    """The detokenizer service."""

    model: str = opt("", "Hugging Face checkpoint folder whose tokenizer is used")
    detokenizer_port: int = port(50054, "gRPC port of the detokenizer")
    detokenizer_metrics_port: int = port(9103, "Prometheus port of the detokenizer")
    scheduler_addr: str = opt("127.0.0.1:50052", "host:port of the scheduler")


@dataclass(frozen=True)
class GatewayConfig(LoRAOptions):
    """The gateway service (OpenAI HTTP API + public gRPC API)."""

    model: str = opt("", "Hugging Face checkpoint folder whose tokenizer and template are used")
    served_model_name: str = opt("", "model name reported by the API (default: folder name)")
    http_port: int = port(8000, "OpenAI-compatible HTTP port (also /metrics)")
    grpc_port: int = port(50051, "public gRPC port (kvmesh.v1.Generation)")
    scheduler_addr: str = opt("127.0.0.1:50052", "host:port of the scheduler")
    detokenizer_addr: str = opt("127.0.0.1:50054", "host:port of the detokenizer")
    api_key: str = opt("", "if set, require 'Authorization: Bearer <key>' on /v1 routes")
    routing_policy: str = opt(
        "kv",
        "how a request picks an engine replica: kv (prefix overlap weighed against load), "
        "load (least loaded), round-robin",
        choices=ROUTING_POLICIES,
    )
    max_inflight_requests: int = opt(
        0,
        "generation calls (HTTP and gRPC) this gateway serves at once; past it, 429 before "
        "the body is read (0: what the engine holds, max_num_seqs + max_waiting_requests)",
        minimum=0,
    )
    max_request_body_bytes: int = opt(
        8 << 20,
        "largest HTTP request body (413 past it) and public gRPC message accepted",
        minimum=1024,
    )
    max_prompts_per_request: int = opt(
        128, "most prompts in one /v1/completions or Generate call", minimum=1
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
    prefill_worker_port: int = port(50056, "gRPC port of the prefill replica's worker")
    prefill_worker_metrics_port: int = port(9105, "Prometheus port of the prefill replica's worker")
    prefill_scheduler_port: int = port(50057, "gRPC port of the prefill replica's scheduler")
    prefill_scheduler_metrics_port: int = port(
        9106, "Prometheus port of the prefill replica's scheduler"
    )


SERVICE_CONFIGS: dict[str, type] = {
    "gateway": GatewayConfig,
    "scheduler": SchedulerServiceConfig,
    "worker": WorkerConfig,
    "detokenizer": DetokenizerConfig,
    "kvstore": KVStoreConfig,
}
