"""Start the whole stack once per test session, as `kvmesh up` does, on free ports."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvmesh.services.cli.local_stack import LocalStack
from kvmesh.services.runtime.model_prep import default_model_path, is_prepared

STARTUP_TIMEOUT_S = 300

Stack = LocalStack


def start_stack(extra_args: list[str]) -> LocalStack:
    """A stack in float32 unless ``extra_args`` name a dtype: the oracle these
    tests compare with is transformers in float32, and --dtype auto would pick
    bfloat16 on a CPU with AMX or AVX512-BF16."""
    if not is_prepared(default_model_path()):
        pytest.skip("default model not prepared (run `make install`)")
    if "--dtype" not in extra_args:
        extra_args = ["--dtype", "float32", *extra_args]
    stack = LocalStack(extra_args)
    stack.wait_ready(STARTUP_TIMEOUT_S)
    return stack


def stop_stack(stack: LocalStack) -> int:
    return stack.stop()


@pytest.fixture(scope="session")
def stack() -> Iterator[LocalStack]:
    # A small KV pool keeps memory low; 8 192 tokens still fit 16 concurrent
    # requests of ~200 tokens.
    s = start_stack(
        ["--num-kv-blocks", "512", "--max-model-len", "2048", "--enable-auto-tool-choice"]
    )
    yield s
    code = stop_stack(s)
    assert code == 0, "stack did not stop cleanly:\n" + "".join(s.log[-50:])
