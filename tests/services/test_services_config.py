"""Config: flags beat env vars beat defaults; every option has a KVMESH_* variable."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from services.config import (
    SERVICE_CONFIGS,
    SchedulerServiceConfig,
    WorkerConfig,
    add_config_arguments,
    config_from_namespace,
    config_to_env,
    env_name,
)


def _parse(cls: type, argv: list[str], environ: dict[str, str]):
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, cls)
    return config_from_namespace(cls, parser.parse_args(argv), environ)


def test_flag_beats_env_beats_default() -> None:
    cfg = _parse(WorkerConfig, [], {})
    assert cfg.worker_port == 50053
    cfg = _parse(WorkerConfig, [], {"KVMESH_WORKER_PORT": "6000"})
    assert cfg.worker_port == 6000
    cfg = _parse(WorkerConfig, ["--worker-port", "7000"], {"KVMESH_WORKER_PORT": "6000"})
    assert cfg.worker_port == 7000


def test_booleans_from_flags_and_env() -> None:
    assert _parse(SchedulerServiceConfig, [], {}).prefix_caching is True
    assert _parse(SchedulerServiceConfig, ["--no-prefix-caching"], {}).prefix_caching is False
    env = {"KVMESH_PREFIX_CACHING": "false"}
    assert _parse(SchedulerServiceConfig, [], env).prefix_caching is False
    with pytest.raises(ValueError, match="KVMESH_PREFIX_CACHING"):
        _parse(SchedulerServiceConfig, [], {"KVMESH_PREFIX_CACHING": "maybe"})


def test_invalid_values_are_refused_with_a_clear_message() -> None:
    with pytest.raises(ValueError, match="scheduling_policy"):
        _parse(SchedulerServiceConfig, ["--scheduling-policy", "random"], {})
    with pytest.raises(ValueError, match="block_size"):
        _parse(WorkerConfig, ["--block-size", "12"], {})


def test_round_trip_through_env() -> None:
    cfg = _parse(WorkerConfig, ["--num-kv-blocks", "64", "--max-model-len", "512"], {})
    again = _parse(WorkerConfig, [], config_to_env(cfg))
    assert again == cfg


def test_ports_and_env_names_are_unique_across_services() -> None:
    ports: dict[str, int] = {}
    owners: dict[str, str] = {}
    for service, cls in SERVICE_CONFIGS.items():
        for f in dataclasses.fields(cls):
            if f.name.endswith("_port"):
                assert f.default not in ports.values(), f"{f.name} reuses port {f.default}"
                ports[f.name] = f.default
            owners.setdefault(env_name(f.name), service)
    # The documented defaults of the design.
    assert ports["http_port"] == 8000 and ports["grpc_port"] == 50051
    assert ports["scheduler_metrics_port"] == 9101
    assert ports["worker_metrics_port"] == 9102
    assert ports["detokenizer_metrics_port"] == 9103
    assert ports["kvstore_metrics_port"] == 9104
