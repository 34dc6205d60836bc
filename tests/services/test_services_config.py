"""Config: flags beat env vars beat defaults; every option has a KVMESH_* variable."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path

import pytest

from kvmesh.services.cli.main import main
from kvmesh.services.runtime.config import (
    DEFAULT_MAX_MODEL_LEN,
    SERVICE_CONFIGS,
    GatewayConfig,
    LauncherConfig,
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


def test_invalid_values_are_refused_with_a_clear_message(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        _parse(SchedulerServiceConfig, ["--scheduling-policy", "random"], {})
    assert "invalid choice: 'random' (choose from 'fcfs', 'priority')" in capsys.readouterr().err
    env = {"KVMESH_SCHEDULING_POLICY": "random"}
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority"):
        _parse(SchedulerServiceConfig, [], env)
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


def test_limits_hold_for_variables_as_for_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match=re.escape("worker_port must be 1..65535; got 0")):
        _parse(WorkerConfig, [], {"KVMESH_WORKER_PORT": "0"})
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1; got 0"):
        _parse(SchedulerServiceConfig, ["--max-num-seqs", "0"], {})
    assert _parse(WorkerConfig, [], {}).attention_backend == ""  # the default: by device
    assert _parse(WorkerConfig, ["--attention-backend", "cpu"], {}).attention_backend == "cpu"
    with pytest.raises(ValueError, match="attention_backend must be one of cpu_native, cpu"):
        _parse(WorkerConfig, [], {"KVMESH_ATTENTION_BACKEND": "flash"})
    with pytest.raises(SystemExit):
        _parse(WorkerConfig, ["--dtype", "float8"], {})
    assert "invalid choice: 'float8'" in capsys.readouterr().err


def _help_entries(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, str]:
    """``--flag`` -> its help entry (invocation and text on one line), from ``kvmesh ARGV``."""
    with pytest.raises(SystemExit):
        main(argv)
    entries: dict[str, str] = {}
    flag = ""
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("  -"):  # an option; its text may continue on indented lines
            flag = line.split()[0].rstrip(",")
            entries[flag] = line.strip()
        elif line.startswith("   ") and flag:
            entries[flag] += " " + line.strip()
        else:
            flag = ""
    return entries


@pytest.mark.parametrize("argv", [["up", "--help"], ["serve", "worker", "--help"]])
def test_help_lists_each_option_with_its_variable_default_and_limits(
    argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "1000")  # no wrapping inside the facts checked
    entries = _help_entries(argv, capsys)
    up = argv[0] == "up"
    classes = [LauncherConfig, *SERVICE_CONFIGS.values()] if up else [WorkerConfig]
    # Under `up` the addresses follow the ports: no flags that would be ignored.
    addresses = {"worker_addr", "scheduler_addr", "detokenizer_addr", "kvstore_addr"}
    ignored = addresses | {"prefill_scheduler_addr"} if up else set()
    fields = {f.name: f for cls in classes for f in dataclasses.fields(cls)}
    expected = {"--" + name.replace("_", "-") for name in fields.keys() - ignored}
    assert entries.keys() - {"-h"} == expected
    for name, f in fields.items():
        if name in ignored:
            continue
        entry = entries["--" + name.replace("_", "-")]
        assert f"[env {env_name(name)}; default {f.default!r}" in entry
        choices, low, high = (f.metadata[k] for k in ("choices", "minimum", "maximum"))
        if choices is not None:
            assert "one of " + ", ".join(choices) in entry
        for limit in (low, high):
            assert limit is None or str(limit) in entry.split("[env")[1], name


def test_max_model_len_help_names_the_cap_the_worker_applies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvmesh.worker.config import ModelConfig

    monkeypatch.setenv("COLUMNS", "1000")
    entry = _help_entries(["serve", "worker", "--help"], capsys)["--max-model-len"]
    assert f"at most {DEFAULT_MAX_MODEL_LEN};" in entry
    hf_config = {
        "architectures": ["LlamaForCausalLM"],
        "num_attention_heads": 4,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "vocab_size": 100,
        "max_position_embeddings": 4 * DEFAULT_MAX_MODEL_LEN,
    }
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    assert ModelConfig.from_pretrained(tmp_path).max_model_len == DEFAULT_MAX_MODEL_LEN


@pytest.mark.parametrize(
    ("cls", "values"),
    [
        # Half of mutual TLS: a plaintext port, or one that trusts any CA.
        (WorkerConfig, {"internal_tls_certfile": "c.pem", "internal_tls_keyfile": "k.pem"}),
        (GatewayConfig, {"ssl_certfile": "c.pem"}),
        (GatewayConfig, {"ssl_certfile": "c.pem", "ssl_keyfile": "k.pem", "ssl_cert_reqs": 2}),
    ],
)
def test_incomplete_tls_settings_are_refused(cls: type, values: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        cls(**values)
