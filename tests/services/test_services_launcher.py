"""``kvmesh up``: one machine's configs built from the flags."""

from __future__ import annotations

import argparse

import pytest

from services.launcher import add_up_arguments, stack_configs


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
