"""``kvmesh up``: internal calls authenticated by default, credentials kept off command lines."""

from __future__ import annotations

import argparse
import contextlib
import shutil
from pathlib import Path

import pytest

from kvmesh.services.cli.launcher import Stack, add_up_arguments, secure_stack, stack_configs
from kvmesh.services.runtime.config import LauncherConfig, config_from_namespace


def _secured(argv: list[str], scratch: contextlib.ExitStack) -> Stack:
    parser = argparse.ArgumentParser()
    add_up_arguments(parser)
    args = parser.parse_args(["--model", "/m", *argv])
    launcher = config_from_namespace(LauncherConfig, args)
    return Stack(launcher, secure_stack(stack_configs(args), launcher, scratch))


def test_each_stack_gets_its_own_token_in_every_child_environment_only() -> None:
    with contextlib.ExitStack() as scratch:
        first = _secured(["--disaggregated"], scratch)
        second = _secured([], scratch)
    tokens = {c.internal_auth_token for c in first.configs.values()}
    assert len(tokens) == 1 and len(token := tokens.pop()) >= 40
    assert second.configs["worker"].internal_auth_token != token
    for child in first.children.values():  # the prefill replica's twins too
        assert child.env["KVMESH_INTERNAL_AUTH_TOKEN"] == token, child.name
        assert not any(token in flag for flag in child.flags), child.name  # `ps` shows flags
    assert first.security.token == token  # the launcher's own probes dial with it


def test_a_given_token_is_kept_and_no_internal_auth_leaves_ports_open(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with contextlib.ExitStack() as scratch:
        open_stack = _secured(["--no-internal-auth"], scratch)
        assert open_stack.configs["scheduler"].internal_auth_token == ""
        monkeypatch.setenv("KVMESH_INTERNAL_AUTH_TOKEN", "chosen")
        stack = _secured([], scratch)
    assert {c.internal_auth_token for c in stack.configs.values()} == {"chosen"}


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_internal_tls_makes_certificates_that_last_as_long_as_the_stack() -> None:
    with contextlib.ExitStack() as scratch:
        stack = _secured(["--internal-tls"], scratch)
        files = [Path(stack.configs["worker"].internal_tls_certfile)]
        files += [Path(stack.configs["gateway"].internal_tls_keyfile)]
        files += [Path(stack.configs["kvstore"].internal_tls_ca_certs)]
        assert all(f.is_file() for f in files)
        assert stack.security.mutual_tls
        assert files[1].stat().st_mode & 0o077 == 0  # the key is private
    assert not any(f.exists() for f in files)
