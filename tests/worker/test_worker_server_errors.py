"""The worker service says which failures are the caller's: a grammar that does not
compile is INVALID_REQUEST, a model still loading UNAVAILABLE, a compiler bug neither."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvmesh.protos import common_pb2, worker_pb2
from kvmesh.services.contracts.errors import InvalidRequestError, UnavailableError
from kvmesh.worker.server import WorkerServicer


def _servicer_whose_compiler_raises(error: Exception) -> WorkerServicer:
    def compile_spec(spec: object) -> None:
        raise error

    servicer = WorkerServicer()
    runner = SimpleNamespace(
        structured_output=SimpleNamespace(compiler=SimpleNamespace(compile=compile_spec))
    )
    servicer.attach(runner, worker_pb2.WorkerInfo())  # type: ignore[arg-type]
    return servicer


def _prepare(
    kind: str = "regex", value: str = "(unclosed"
) -> worker_pb2.PrepareStructuredOutputRequest:
    return worker_pb2.PrepareStructuredOutputRequest(
        request_id="r", structured_output=common_pb2.StructuredOutput(kind=kind, value=value)
    )


async def test_a_spec_that_does_not_compile_is_an_invalid_request() -> None:
    servicer = _servicer_whose_compiler_raises(ValueError("invalid regex: unbalanced"))
    with pytest.raises(InvalidRequestError, match="unbalanced"):
        await servicer.PrepareStructuredOutput(_prepare(), context=None)


async def test_an_unknown_constraint_kind_is_an_invalid_request() -> None:
    servicer = _servicer_whose_compiler_raises(AssertionError("never compiled"))
    with pytest.raises(InvalidRequestError, match="yaml"):
        await servicer.PrepareStructuredOutput(_prepare(kind="yaml"), context=None)


async def test_a_compiler_bug_is_not_blamed_on_the_caller() -> None:
    servicer = _servicer_whose_compiler_raises(TypeError("bug in the compiler"))
    with pytest.raises(TypeError):  # the interceptor reports it as INTERNAL
        await servicer.PrepareStructuredOutput(_prepare(), context=None)


async def test_calls_before_the_model_is_loaded_are_unavailable() -> None:
    servicer = WorkerServicer()
    with pytest.raises(UnavailableError, match="loading"):
        await servicer.PrepareStructuredOutput(_prepare(), context=None)
    with pytest.raises(UnavailableError, match="loading"):
        await servicer.GetInfo(worker_pb2.GetWorkerInfoRequest(), context=None)
