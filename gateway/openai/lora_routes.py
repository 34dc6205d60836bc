"""vLLM's routes that change the served LoRA adapters while serving (behind the API key,
like every /v1 route), with its answers: a plain-text success, 400 for a
duplicate or unreadable adapter, 404 for unloading an unknown one."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from kvmesh.gateway.engine_params.served_models import ServedModels, read_lora_request
from kvmesh.gateway.openai.protocol import (
    ErrorResponse,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)
from kvmesh.services.contracts.errors import InvalidRequestError

_PLAIN_SUCCESS = {200: {"content": {"text/plain": {}}, "description": "Success message"}}
_UNKNOWN_ADAPTER = {404: {"model": ErrorResponse, "description": "No adapter of that name"}}


def add_lora_routes(
    app: FastAPI, models: ServedModels, errors: dict[int | str, dict[str, Any]]
) -> None:
    @app.post(
        "/v1/load_lora_adapter",
        response_class=PlainTextResponse,
        responses={**_PLAIN_SUCCESS, **errors},
    )
    async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> PlainTextResponse:
        if not request.lora_name or not request.lora_path:
            raise InvalidRequestError("Both 'lora_name' and 'lora_path' must be provided.")
        models.check_new_name(request.lora_name)
        # Hashing the weights reads the whole adapter: off the event loop.
        lora = await asyncio.to_thread(read_lora_request, request.lora_name, request.lora_path)
        models.add(lora)  # checks the name again: a concurrent load may have taken it
        return PlainTextResponse(f"Success: LoRA adapter '{lora.lora_name}' added successfully.")

    @app.post(
        "/v1/unload_lora_adapter",
        response_class=PlainTextResponse,
        responses={**_PLAIN_SUCCESS, **errors, **_UNKNOWN_ADAPTER},
    )
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        models.remove(request.lora_name)
        return PlainTextResponse(
            f"Success: LoRA adapter '{request.lora_name}' removed successfully."
        )
