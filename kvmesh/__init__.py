"""kvmesh's Python API.

- ``kvmesh.LLM``: offline batched generation with the engine in this process
  (``llm.generate(prompts, kvmesh.SamplingParams(...))``, ``llm.chat(messages)``).
- ``kvmesh.Client`` / ``kvmesh.AsyncClient``: a running stack's public gRPC
  ``Generate`` stream, without protobuf in the caller's code.

``LLM`` loads torch and the model code; it is imported only when first used,
so ``import kvmesh`` for the clients stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvmesh import _layout  # noqa: F401  (first: kvmesh.<package> resolves)
from kvmesh.client import AsyncClient, ChatOptions, Client, ClientError, ModelInfo, StreamChunk
from kvmesh.outputs import CompletionOutput, RequestOutput
from kvmesh.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvmesh.llm import LLM

__all__ = [
    "LLM",
    "AsyncClient",
    "ChatOptions",
    "Client",
    "ClientError",
    "CompletionOutput",
    "ModelInfo",
    "RequestOutput",
    "SamplingParams",
    "StreamChunk",
]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from kvmesh.llm import LLM

        return LLM
    raise AttributeError(f"module 'kvmesh' has no attribute {name!r}")
