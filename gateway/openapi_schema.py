"""/openapi.json as this server enforces it: the served model's limits filled in, 400 not 422.

The request models mark the bounds that depend on the served model with
``x-kvmesh-limit`` (gateway/protocol.py); here they become plain JSON Schema
for this server: the model name as an enum, token ids below the vocabulary
size, output lengths below the context length. FastAPI documents a 422 for
every route with a body, which this server never answers (a refused body is a
400 with the OpenAI error body, documented per route), so those go.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from gateway.admission import GENERATION_PATHS, POOLING_PATHS
from gateway.engine_client import ModelInfo

LIMIT_KEY = "x-kvmesh-limit"
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


def _apply_limits(node: Any, served_model_name: str, vocab_size: int, max_model_len: int) -> None:
    if isinstance(node, list):
        for item in node:
            _apply_limits(item, served_model_name, vocab_size, max_model_len)
        return
    if not isinstance(node, dict):
        return
    kind = node.pop(LIMIT_KEY, None)
    if kind == "model":
        node["enum"] = [served_model_name]
    elif kind == "token_id":
        node["maximum"] = vocab_size - 1
    elif kind == "token_id_keys":
        node["propertyNames"] = {"pattern": decimal_below(vocab_size)}
    elif kind == "output_len":
        node["maximum"] = max_model_len - 1
    elif kind == "context":
        node["maximum"] = max_model_len
    elif kind is not None:
        raise ValueError(f"unknown {LIMIT_KEY} {kind!r}")
    for value in node.values():
        _apply_limits(value, served_model_name, vocab_size, max_model_len)


def build_openapi(
    app: FastAPI, served_model_name: str, model: ModelInfo, tokenizer_vocab_size: int
) -> dict[str, Any]:
    """The app's schema with this server's limits (token ids must fit model and tokenizer)."""
    # Only the APIs the served model answers: a generation model has no
    # pooling routes, a pooling model no completions (their calls are 400s).
    unserved = POOLING_PATHS if model.pooling is None else GENERATION_ONLY_PATHS
    routes = [route for route in app.routes if getattr(route, "path", None) not in unserved]
    schema = get_openapi(title=app.title, version=app.version, routes=routes)
    vocab_size = min(model.vocab_size, tokenizer_vocab_size)
    _apply_limits(schema, served_model_name, vocab_size, model.max_model_len)
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            operation.get("responses", {}).pop("422", None)
    components = schema.get("components", {}).get("schemas", {})
    for name in _FASTAPI_VALIDATION_SCHEMAS:
        components.pop(name, None)
    return schema
