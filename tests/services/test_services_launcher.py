"""``kvmesh up``: one machine's configs built from the flags."""

from __future__ import annotations

import argparse

import pytest

from kvmesh.services.cli.launcher import (
    add_up_arguments,
    child_order,
    flags_differing,
    replica_addresses,
    replica_of,
    service_of,
    stack_configs,
)
from kvmesh.services.contracts.replica_set import ReplicaAddress


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_up_arguments(parser)
    return parser.parse_args(argv)


def test_addresses_follow_ports_and_one_model_serves_all(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMESH_WORKER_ADDR", "elsewhere:1")  # a variable cannot move it either
    argv = ["--model", "/m", "--worker-port", "6001", "--scheduler-port", "6002"]
    configs = stack_configs(_args([*argv, "--detokenizer-port", "6003"]))
    assert configs["scheduler"].worker_addr == "127.0.0.1:6001"
    assert configs["detokenizer"].scheduler_addr == "127.0.0.1:6002"
    assert configs["gateway"].scheduler_addr == "127.0.0.1:6002"
    assert configs["gateway"].detokenizer_addr == "127.0.0.1:6003"
    assert {configs[s].model for s in ("worker", "detokenizer", "gateway")} == {"/m"}


def test_up_has_no_address_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _args(["--worker-addr", "h:1"])
    assert "unrecognized arguments: --worker-addr" in capsys.readouterr().err


def test_disaggregated_adds_a_prefill_replica_on_its_own_ports() -> None:
    argv = ["--model", "/m", "--worker-port", "6001", "--scheduler-port", "6002"]
    prefill = ["--prefill-worker-port", "6011", "--prefill-scheduler-port", "6012"]
    configs = stack_configs(_args([*argv, *prefill, "--disaggregated"]))
    assert child_order(configs) == [
        "kvstore",
        "worker",
        "prefill_worker",
        "scheduler",
        "prefill_scheduler",
        "detokenizer",
        "gateway",
    ]
    assert configs["prefill_scheduler"].worker_addr == "127.0.0.1:6011"
    assert configs["gateway"].prefill_scheduler_addr == "127.0.0.1:6012"
    assert configs["gateway"].scheduler_addr == "127.0.0.1:6002"  # decode: the one streamed
    assert configs["detokenizer"].scheduler_addr == "127.0.0.1:6002"
    for name in ("worker", "prefill_worker", "scheduler", "prefill_scheduler"):
        assert configs[name].kv_offload  # the KV travels through the store
    # Each prefill process is its twin plus the flags that move it.
    assert flags_differing(configs["worker"], configs["prefill_worker"]) == [
        "--worker-port",
        "6011",
        "--worker-metrics-port",
        "9105",
    ]
    assert "--worker-addr" in flags_differing(configs["scheduler"], configs["prefill_scheduler"])


def test_without_disaggregated_there_is_no_prefill_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMESH_PREFILL_SCHEDULER_ADDR", "elsewhere:1")
    configs = stack_configs(_args(["--model", "/m"]))
    assert child_order(configs) == ["kvstore", "worker", "scheduler", "detokenizer", "gateway"]
    assert configs["gateway"].prefill_scheduler_addr == ""
    assert not configs["scheduler"].kv_offload


def test_the_two_workers_of_one_machine_split_its_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    configs = stack_configs(_args(["--model", "/m", "--disaggregated"]))
    assert configs["worker"].num_threads == configs["prefill_worker"].num_threads == 4
    chosen = stack_configs(_args(["--model", "/m", "--disaggregated", "--num-threads", "3"]))
    assert chosen["worker"].num_threads == chosen["prefill_worker"].num_threads == 3
    assert stack_configs(_args(["--model", "/m"]))["worker"].num_threads == 0  # all of them


def test_a_parallel_worker_starts_every_rank_before_its_driver(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    argv = ["--model", "/m", "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"]
    configs = stack_configs(_args(argv))
    ranks = ["worker_rank1", "worker_rank2", "worker_rank3"]
    # Shutdown runs in reverse: the driver stops first and tells its ranks to.
    rest = ["scheduler", "detokenizer", "gateway"]
    assert child_order(configs) == ["kvstore", *ranks, "worker", *rest]
    assert [configs[n].rank for n in ["worker", *ranks]] == [0, 1, 2, 3]
    assert flags_differing(configs["worker"], configs["worker_rank3"]) == ["--rank", "3"]
    assert {configs[n].num_threads for n in ["worker", *ranks]} == {2}  # 8 cores / 4 ranks
    assert {replica_of(n) for n in ["worker", *ranks]} == {"worker"}
    assert {service_of(n) for n in ["worker", *ranks]} == {"worker"}


def test_parallel_sizes_are_checked_against_rank_and_world_size() -> None:
    with pytest.raises(ValueError, match="world_size"):
        stack_configs(_args(["--model", "/m", "--tensor-parallel-size", "2", "--world-size", "3"]))
    with pytest.raises(ValueError, match="rank 2 outside"):
        stack_configs(_args(["--model", "/m", "--tensor-parallel-size", "2", "--rank", "2"]))


def test_disaggregated_replicas_of_parallel_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """--disaggregated with TP=2: the prefill replica's ranks follow its driver (its
    ports, a rendezvous port of their own, its restart group), started before it."""
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    argv = ["--model", "/m", "--tensor-parallel-size", "2", "--disaggregated"]
    configs = stack_configs(_args([*argv, "--replica-port-offset", "50"]))
    workers = ["worker_rank1", "worker", "prefill_worker_rank1", "prefill_worker"]
    assert child_order(configs)[1:5] == workers
    assert [configs[n].rank for n in workers] == [1, 0, 1, 0]
    assert configs["prefill_worker_rank1"].worker_port == configs["prefill_worker"].worker_port
    host, port = configs["worker"].dist_init_addr.rsplit(":", 1)
    prefill_addresses = {configs[n].dist_init_addr for n in workers[2:]}
    assert prefill_addresses == {f"{host}:{int(port) + 50}"}
    assert [replica_of(n) for n in workers] == ["worker", "worker", *["prefill_worker"] * 2]
    assert {service_of(n) for n in workers} == {"worker"}
    assert {configs[n].num_threads for n in workers} == {2}  # 8 cores / 4 ranks
    assert flags_differing(configs["prefill_worker"], configs["prefill_worker_rank1"]) == [
        "--rank",
        "1",
    ]


def test_data_parallel_replicas_get_their_own_ports_and_dial_each_other() -> None:
    argv = ["--model", "/m", "--data-parallel-size", "2", "--replica-port-offset", "50"]
    ports = ["--worker-port", "6001", "--scheduler-port", "6002", "--detokenizer-port", "6003"]
    configs = stack_configs(_args([*argv, *ports]), replica_set_file="/run/replicas.json")
    assert child_order(configs) == [
        "kvstore",
        "worker",
        "worker-1",
        "scheduler",
        "scheduler-1",
        "detokenizer",
        "detokenizer-1",
        "gateway",
    ]
    assert configs["scheduler-1"].worker_addr == "127.0.0.1:6051"
    assert configs["detokenizer-1"].scheduler_addr == "127.0.0.1:6052"
    assert (
        configs["scheduler-1"].scheduler_metrics_port
        == configs["scheduler"].scheduler_metrics_port + 50
    )
    assert replica_addresses(configs) == [
        ReplicaAddress("replica-0", "127.0.0.1:6002", "127.0.0.1:6003"),
        ReplicaAddress("replica-1", "127.0.0.1:6052", "127.0.0.1:6053"),
    ]
    # The gateway reads the replicas from the launcher's file, not from addresses.
    assert configs["gateway"].replica_discovery == "file"
    assert configs["gateway"].replica_set_file == "/run/replicas.json"
    assert flags_differing(configs["detokenizer"], configs["detokenizer-1"]) == [
        "--detokenizer-port",
        "6053",
        "--detokenizer-metrics-port",
        str(configs["detokenizer"].detokenizer_metrics_port + 50),
        "--scheduler-addr",
        "127.0.0.1:6052",
    ]
    assert [service_of(n) for n in ("worker-1", "prefill_scheduler", "gateway")] == [
        "worker",
        "scheduler",
        "gateway",
    ]


def test_data_parallel_workers_split_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    configs = stack_configs(_args(["--model", "/m", "--data-parallel-size", "4"]))
    assert {configs[n].num_threads for n in ("worker", "worker-1", "worker-3")} == {2}


def test_data_parallel_and_disaggregated_do_not_mix() -> None:
    with pytest.raises(ValueError, match="data-parallel-size 1"):
        stack_configs(_args(["--model", "/m", "--data-parallel-size", "2", "--disaggregated"]))


def test_data_parallel_replicas_of_parallel_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each replica's ranks follow its own driver: its ports, its rendezvous port,
    its restart group, started before it."""
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    argv = ["--model", "/m", "--data-parallel-size", "2", "--replica-port-offset", "50"]
    configs = stack_configs(_args([*argv, "--tensor-parallel-size", "2"]))
    workers = ["worker_rank1", "worker", "worker_rank1-1", "worker-1"]
    assert child_order(configs)[1:5] == workers
    assert [configs[n].rank for n in workers] == [1, 0, 1, 0]
    assert configs["worker_rank1-1"].worker_port == configs["worker-1"].worker_port
    assert configs["worker-1"].worker_port == configs["worker"].worker_port + 50
    host, port = configs["worker"].dist_init_addr.rsplit(":", 1)
    assert configs["worker-1"].dist_init_addr == f"{host}:{int(port) + 50}"
    assert configs["worker_rank1-1"].dist_init_addr == configs["worker-1"].dist_init_addr
    assert [replica_of(n) for n in workers] == ["worker", "worker", "worker-1", "worker-1"]
    assert {configs[n].num_threads for n in workers} == {2}  # 8 cores / 4 ranks
    assert flags_differing(configs["worker-1"], configs["worker_rank1-1"]) == ["--rank", "1"]
    assert [r.name for r in replica_addresses(configs)] == ["replica-0", "replica-1"]
