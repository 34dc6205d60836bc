"""/openapi.json as this server enforces it: the served model's limits filled in, 400 not 422.

The request models mark the bounds that depend on the served model or on the
server's limits with ``x-kvmesh-limit`` (gateway/openai/protocol.py); here they become
plain JSON Schema for this server: the model name as an enum, token ids below
the vocabulary size, output lengths below the context length and
``--max-tokens-limit``, ``n`` up to ``--max-n``, prompt and input lists up to
``--max-prompts-per-request``. The one bound no JSON Schema
keyword can state, ``--max-tokens-per-request`` (a sum over the call's choices),
is published as ``x-max-tokens-per-request`` on the request object. FastAPI documents a 422 for
every route with a body, which this server never answers (a refused body is a
400 with the OpenAI error body, documented per route), so those go.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from kvmesh.gateway.admission import GENERATION_PATHS, POOLING_PATHS
from kvmesh.gateway.engine.client import ModelInfo
from kvmesh.gateway.engine_params.limits import GatewayLimits

LIMIT_KEY = "x-kvmesh-limit"
REQUEST_TOKENS_KEY = "x-max-tokens-per-request"
_FASTAPI_VALIDATION_SCHEMAS = ("HTTPValidationError", "ValidationError")
GENERATION_ONLY_PATHS = GENERATION_PATHS - POOLING_PATHS


def decimal_below(limit: int) -> str:
    """A regex matching the decimal integers in [0, limit), without leading zeros."""
    top = str(limit - 1)
    alternatives = ["0"]
    for length in range(1, len(top)):
        alternatives.append("[1-9]" + "[0-9]" * (length - 1))
    for position, digit in enumerate(top):
        lowest = 1 if position == 0 and len(top) > 1 else 0
        if int(digit) > lowest:
            rest = "[0-9]" * (len(top) - position - 1)
            alternatives.append(f"{top[:position]}[{lowest}-{int(digit) - 1}]{rest}")
    alternatives.append(top)
    return "^(?:" + "|".join(alternatives) + ")$"


@dataclass(frozen=True)
class _ServerLimits:
    served_model_name: str
    vocab_size: int
    max_model_len: int
    limits: GatewayLimits


def _apply_limits(node: Any, server: _ServerLimits) -> None:
    if isinstance(node, list):
        for item in node:
            _apply_limits(item, server)
        return
    if not isinstance(node, dict):
        return
    kind = node.pop(LIMIT_KEY, None)
    if kind == "model":
        node["enum"] = [server.served_model_name]
    elif kind == "token_id":
        node["maximum"] = server.vocab_size - 1
    elif kind == "token_id_keys":
        node["propertyNames"] = {"pattern": decimal_below(server.vocab_size)}
    elif kind == "output_len":
        node["maximum"] = server.limits.max_output_len(server.max_model_len)
    elif kind == "context":
        node["maximum"] = server.max_model_len
    elif kind == "n":
        node["maximum"] = server.limits.max_n
    elif kind == "prompts":
        node["maxItems"] = server.limits.max_prompts_per_request
    elif kind == "request_tokens":
        node[REQUEST_TOKENS_KEY] = server.limits.max_tokens_per_request
    elif kind is not None:
        raise ValueError(f"unknown {LIMIT_KEY} {kind!r}")
    for value in node.values():
        _apply_limits(value, server)


def build_openapi(
    app: FastAPI,
    served_model_name: str,
    model: ModelInfo,
    tokenizer_vocab_size: int,
    limits: GatewayLimits | None = None,
) -> dict[str, Any]:
    """The app's schema with this server's limits (token ids must fit model and tokenizer)."""
    # Only the APIs the served model answers: a generation model has no
    # pooling routes, a pooling model no completions (their calls are 400s).
    unserved = POOLING_PATHS if model.pooling is None else GENERATION_ONLY_PATHS
    routes = [route for route in app.routes if getattr(route, "path", None) not in unserved]
    schema = get_openapi(title=app.title, version=app.version, routes=routes)
    vocab_size = min(model.vocab_size, tokenizer_vocab_size)
    server = _ServerLimits(
        served_model_name, vocab_size, model.max_model_len, limits or GatewayLimits()
    )
    _apply_limits(schema, server)
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            operation.get("responses", {}).pop("422", None)
    components = schema.get("components", {}).get("schemas", {})
    for name in _FASTAPI_VALIDATION_SCHEMAS:
        components.pop(name, None)
    return schema
