"""The LoRA flags: several name=path values by flag or variable, checked at start."""

from __future__ import annotations

import argparse

import pytest

from kvmesh.services.runtime.config import (
    GatewayConfig,
    WorkerConfig,
    add_config_arguments,
    config_from_namespace,
    config_to_env,
)


def _parse(cls: type, argv: list[str], environ: dict[str, str] | None = None):
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, cls)
    return config_from_namespace(cls, parser.parse_args(argv), environ or {})


def test_lora_modules_take_several_values_like_vllm() -> None:
    config = _parse(
        GatewayConfig, ["--enable-lora", "--lora-modules", "sql=/a/sql", "chat=/b/my chat"]
    )
    assert config.lora_module_paths == {"sql": "/a/sql", "chat": "/b/my chat"}
    # The launcher hands options to children as variables: the same values come back.
    again = _parse(GatewayConfig, [], config_to_env(config))
    assert again.lora_modules == config.lora_modules


def test_worker_slots_from_flags() -> None:
    config = _parse(WorkerConfig, ["--enable-lora", "--max-loras", "4", "--max-lora-rank", "64"])
    assert (config.enable_lora, config.max_loras, config.max_lora_rank) == (True, 4, 64)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--enable-lora", "--lora-modules", "nopath"], "name=path"),
        (["--lora-modules", "a=/x"], "needs enable_lora"),
        (["--enable-lora", "--max-loras", "0"], "max_loras"),
    ],
)
def test_bad_lora_flags_are_refused(argv: list[str], message: str) -> None:
    cls = WorkerConfig if "--max-loras" in argv else GatewayConfig
    with pytest.raises(ValueError, match=message):
        _parse(cls, argv)
