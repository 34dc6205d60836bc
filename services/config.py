"""Typed configuration for every service: frozen dataclasses, flags and ``KVMESH_*`` env vars.

Every option has one globally unique name (``scheduler_port``, not ``port``),
so one environment file configures the whole stack and the launcher can hand
the same environment to every process. An option ``foo_bar`` is the flag
``--foo-bar`` and the variable ``KVMESH_FOO_BAR``; the flag wins over the
variable, the variable over the default. Environment variables are read here
and nowhere else.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

ENV_PREFIX = "KVMESH_"

T = TypeVar("T")


def opt(default: Any, help: str) -> Any:
    """A config field with its help text."""
    return field(default=default, metadata={"help": help})


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _converter(tp: Any) -> typing.Callable[[str], Any]:
    origin = typing.get_origin(tp)
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return _converter(inner[0])
    if tp is bool:
        return _parse_bool
    return tp


def add_config_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one flag per field of the config dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{f.metadata.get('help', '')} [env {env_name(f.name)}; default {f.default!r}]"
        if hints[f.name] is bool:
            parser.add_argument(
                flag,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_text,
            )
        else:
            parser.add_argument(
                flag, dest=f.name, type=_converter(hints[f.name]), default=None, help=help_text
            )


def config_from_namespace(
    cls: type[T], namespace: argparse.Namespace, environ: typing.Mapping[str, str] | None = None
) -> T:
    """Build ``cls`` from parsed flags, then env vars, then field defaults."""
    environ = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        flag_value = getattr(namespace, f.name, None)
        if flag_value is not None:
            values[f.name] = flag_value
            continue
        raw = environ.get(env_name(f.name))
        if raw is not None and raw != "":
            try:
                values[f.name] = _converter(hints[f.name])(raw)
            except ValueError as e:
                raise ValueError(f"{env_name(f.name)}={raw!r}: {e}") from e
    return cls(**values)


def parse_config(cls: type[T], argv: Sequence[str] | None = None, prog: str | None = None) -> T:
    parser = argparse.ArgumentParser(prog=prog, description=(cls.__doc__ or "").strip())
    add_config_arguments(parser, cls)
    return config_from_namespace(cls, parser.parse_args(argv))


def config_to_env(config: Any) -> dict[str, str]:
    """The ``KVMESH_*`` variables that reproduce ``config`` in a child process."""
    env: dict[str, str] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if value is None:
            continue
        env[env_name(f.name)] = str(value).lower() if isinstance(value, bool) else str(value)
    return env


# --------------------------------------------------------------------------
# Per-service configs. Ports and addresses are named per service on purpose.
# --------------------------------------------------------------------------

DEFAULT_HOST = "127.0.0.1"


@dataclass(frozen=True)
class CommonConfig:
    """Options every service understands."""

    bind_host: str = opt(DEFAULT_HOST, "interface the service listens on (0.0.0.0 in containers)")
    log_level: str = opt("INFO", "logging level")


@dataclass(frozen=True)
class KVStoreConfig(CommonConfig):
    """The KV block store service."""

    kvstore_port: int = opt(50055, "gRPC port of the kvstore")
    kvstore_metrics_port: int = opt(9104, "Prometheus port of the kvstore")
    kvstore_capacity_bytes: int = opt(1 << 30, "bytes of KV blocks the store keeps before evicting")

    def __post_init__(self) -> None:
        if self.kvstore_capacity_bytes <= 0:
            raise ValueError("kvstore_capacity_bytes must be positive")


@dataclass(frozen=True)
class WorkerConfig(CommonConfig):
    """The model worker service."""

    model: str = opt("", "Hugging Face checkpoint folder (default: the prepared SmolLM2)")
    served_model_name: str = opt("", "model name reported by the API (default: folder name)")
    worker_port: int = opt(50053, "gRPC port of the worker")
    worker_metrics_port: int = opt(9102, "Prometheus port of the worker")
    device: str = opt("cpu", "torch device for the model")
    dtype: str = opt("float32", "compute dtype (float32 on CPU: no fast bf16 here)")
    block_size: int = opt(16, "tokens per KV block")
    kv_cache_memory: int = opt(1 << 30, "bytes for the KV cache (ignored if num_kv_blocks is set)")
    num_kv_blocks: int = opt(0, "explicit number of KV blocks (0: derive from kv_cache_memory)")
    max_model_len: int = opt(0, "longest prompt + output in tokens (0: min(model, 8192))")
    num_threads: int = opt(0, "torch intra-op threads for the worker (0: all cores)")
    attention_backend: str = opt("", "force an attention backend (cpu, triton, torch_reference)")
    kv_offload: bool = opt(False, "save and load KV blocks through the kvstore (--kv-offload)")
    kvstore_addr: str = opt("127.0.0.1:50055", "host:port of the kvstore (with kv_offload)")

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a positive power of two")
        if self.kv_cache_memory <= 0 and self.num_kv_blocks <= 0:
            raise ValueError("set kv_cache_memory or num_kv_blocks")


@dataclass(frozen=True)
class SchedulerServiceConfig(CommonConfig):
    """The scheduler service."""

    scheduler_port: int = opt(50052, "gRPC port of the scheduler")
    scheduler_metrics_port: int = opt(9101, "Prometheus port of the scheduler")
    worker_addr: str = opt("127.0.0.1:50053", "host:port of the worker")
    max_num_batched_tokens: int = opt(2048, "token budget per engine step")
    max_num_seqs: int = opt(128, "most requests per engine step")
    long_prefill_token_threshold: int = opt(0, "cap on one request's tokens per step (0: off)")
    scheduling_policy: str = opt("fcfs", "fcfs or priority")
    prefix_caching: bool = opt(
        True, "reuse KV blocks of shared prefixes (--no-prefix-caching: off)"
    )
    max_waiting_requests: int = opt(4096, "queue bound; beyond it new requests get 429")
    # On by default: with the C++ kernels a decode step is ~22 ms and the
    # synchronous round trip left the worker idle 5-7% of the time; alternating
    # A/B runs of the 64x128/128 workload: +2.4% on average (3 pairs).
    async_scheduling: bool = opt(
        True, "schedule step n+1 while the worker runs step n (--no-async-scheduling: off)"
    )

    def __post_init__(self) -> None:
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError("scheduling_policy must be 'fcfs' or 'priority'")
        if self.max_num_batched_tokens <= 0 or self.max_num_seqs <= 0:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")


@dataclass(frozen=True)
class DetokenizerConfig(CommonConfig):
    """The detokenizer service."""

    model: str = opt("", "Hugging Face checkpoint folder whose tokenizer is used")
    detokenizer_port: int = opt(50054, "gRPC port of the detokenizer")
    detokenizer_metrics_port: int = opt(9103, "Prometheus port of the detokenizer")
    scheduler_addr: str = opt("127.0.0.1:50052", "host:port of the scheduler")


@dataclass(frozen=True)
class GatewayConfig(CommonConfig):
    """The gateway service (OpenAI HTTP API + public gRPC API)."""

    model: str = opt("", "Hugging Face checkpoint folder whose tokenizer and template are used")
    served_model_name: str = opt("", "model name reported by the API (default: folder name)")
    http_port: int = opt(8000, "OpenAI-compatible HTTP port (also /metrics)")
    grpc_port: int = opt(50051, "public gRPC port (kvmesh.v1.Generation)")
    scheduler_addr: str = opt("127.0.0.1:50052", "host:port of the scheduler")
    detokenizer_addr: str = opt("127.0.0.1:50054", "host:port of the detokenizer")
    api_key: str = opt("", "if set, require 'Authorization: Bearer <key>' on /v1 routes")


SERVICE_CONFIGS: dict[str, type] = {
    "gateway": GatewayConfig,
    "scheduler": SchedulerServiceConfig,
    "worker": WorkerConfig,
    "detokenizer": DetokenizerConfig,
    "kvstore": KVStoreConfig,
}
