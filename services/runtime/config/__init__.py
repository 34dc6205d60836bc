"""The configuration registry: every flag and every environment variable kvmesh reads.

- ``service_configs``: one frozen dataclass per service (and the launcher);
  each field is a flag ``--foo-bar`` and a variable ``KVMESH_FOO_BAR``.
- ``options``: how a field declares its default, help and limits, and how
  flags and variables become a config.
- ``choices``: enumerations a flag accepts (scheduling policies, attention
  backends, dtypes, routing policies), imported by the code that acts on them.
- ``speculative``: ``--speculative-config`` (vLLM's JSON) as a frozen dataclass.
- ``process``: variables that are not per-service flags (cache folders, kernel
  switches, tool defaults), each read through one typed accessor.

Environment variables are read in this package and nowhere else;
``tests/services/test_services_config_registry.py`` fails on any other read.
"""

from __future__ import annotations

import dataclasses

from kvmesh.services.runtime.config.choices import (
    ATTENTION_BACKENDS,
    AUTO_DTYPE,
    DTYPE_CHOICES,
    DTYPES,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    REPLICA_DISCOVERIES,
    ROUTING_POLICIES,
    SCHEDULING_POLICIES,
    ReplicaDiscoveryName,
    RoutingPolicyName,
    SchedulingPolicyName,
)
from kvmesh.services.runtime.config.options import (
    ENV_PREFIX,
    Options,
    add_config_arguments,
    as_env_text,
    check_choice,
    config_from_namespace,
    config_to_env,
    env_name,
    opt,
)
from kvmesh.services.runtime.config.process import (
    ENV_SETTINGS,
    PROCESS_SETTINGS,
    TOOL_SETTINGS,
    EnvSetting,
    environment_without_options,
)
from kvmesh.services.runtime.config.service_configs import (
    DEFAULT_HOST,
    DEFAULT_MAX_MODEL_LEN,
    INTERNAL_TLS_SERVER_NAME,
    SERVICE_CONFIGS,
    CommonConfig,
    DetokenizerConfig,
    GatewayConfig,
    KVStoreConfig,
    LauncherConfig,
    LoRAOptions,
    SchedulerServiceConfig,
    StepDeadlineOptions,
    WorkerConfig,
)
from kvmesh.services.runtime.config.speculative import (
    SPECULATIVE_METHODS,
    SpeculativeConfig,
    parse_speculative_config,
)


def declared_env_names() -> set[str]:
    """Every environment variable the registry declares: options and process settings."""
    options = {
        env_name(f.name)
        for cls in (*SERVICE_CONFIGS.values(), LauncherConfig)
        for f in dataclasses.fields(cls)
    }
    return options | set(ENV_SETTINGS)


__all__ = [
    "ATTENTION_BACKENDS",
    "AUTO_DTYPE",
    "DEFAULT_HOST",
    "DEFAULT_MAX_MODEL_LEN",
    "DTYPES",
    "DTYPE_CHOICES",
    "ENV_PREFIX",
    "ENV_SETTINGS",
    "INTERNAL_TLS_SERVER_NAME",
    "KV_CACHE_DTYPES",
    "PROCESS_SETTINGS",
    "QUANTIZATIONS",
    "REPLICA_DISCOVERIES",
    "ROUTING_POLICIES",
    "SCHEDULING_POLICIES",
    "SERVICE_CONFIGS",
    "SPECULATIVE_METHODS",
    "TOOL_SETTINGS",
    "CommonConfig",
    "DetokenizerConfig",
    "EnvSetting",
    "GatewayConfig",
    "KVStoreConfig",
    "LauncherConfig",
    "LoRAOptions",
    "Options",
    "ReplicaDiscoveryName",
    "RoutingPolicyName",
    "SchedulerServiceConfig",
    "SchedulingPolicyName",
    "SpeculativeConfig",
    "StepDeadlineOptions",
    "WorkerConfig",
    "add_config_arguments",
    "as_env_text",
    "check_choice",
    "config_from_namespace",
    "config_to_env",
    "declared_env_names",
    "env_name",
    "environment_without_options",
    "opt",
    "parse_speculative_config",
]
