"""The request's structured-output constraint, from whichever API field carries it.

OpenAI's ``response_format`` (``json_object``, ``json_schema``), vLLM's older
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``
and its newer ``structured_outputs: {json|regex|choice|grammar}`` all become
one ``StructuredOutputSpec``. Only cheap checks happen here (a schema is a JSON
object, a choice list is non-empty strings, at most one source is used), each
refusal naming its parameter; the worker compiles the grammar and refuses what
does not compile, which comes back as a 400 too.
"""

from __future__ import annotations

import json
from typing import Any

from kvmesh.gateway.openai.protocol import ChatCompletionRequest, CompletionRequest
from kvmesh.services.contracts.errors import InvalidRequestError
from kvmesh.services.contracts.sampling_params import StructuredOutputSpec

_STRUCTURED_OUTPUTS_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def _schema_text(schema: Any, param: str) -> str:
    """A JSON schema, given as an object or as its JSON text, serialized."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"{param} is not valid JSON: {exc}", param=param) from None
    if isinstance(schema, bool):
        schema = {} if schema else None
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{param} must be a JSON schema object", param=param)
    return json.dumps(schema)


def _non_empty_string(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{param} must be a non-empty string", param=param)
    return value


def _choice_text(choices: Any, param: str) -> str:
    if not isinstance(choices, list) or not choices:
        raise InvalidRequestError(f"{param} must be a non-empty list of strings", param=param)
    if not all(isinstance(choice, str) and choice for choice in choices):
        raise InvalidRequestError(f"every entry of {param} must be a non-empty string", param=param)
    return json.dumps(choices)


def _from_response_format(response_format: dict[str, Any]) -> StructuredOutputSpec | None:
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return StructuredOutputSpec("json_object")
    if kind == "json_schema":
        json_schema = response_format.get("json_schema")
        if not isinstance(json_schema, dict) or "schema" not in json_schema:
            raise InvalidRequestError(
                "response_format of type json_schema needs json_schema.schema",
                param="response_format",
            )
        return StructuredOutputSpec("json", _schema_text(json_schema["schema"], "response_format"))
    raise InvalidRequestError(
        f"response_format type must be text, json_object or json_schema, got {kind!r}",
        param="response_format",
    )


def _from_structured_outputs(fields: dict[str, Any]) -> StructuredOutputSpec | None:
    param = "structured_outputs"
    given = [key for key in _STRUCTURED_OUTPUTS_KEYS if fields.get(key) not in (None, False)]
    if not given:
        return None
    if len(given) > 1:
        raise InvalidRequestError(f"{param} takes one of {given}, not several", param=param)
    (key,) = given
    value = fields[key]
    if key == "json":
        return StructuredOutputSpec("json", _schema_text(value, f"{param}.json"))
    if key == "json_object":
        return StructuredOutputSpec("json_object")
    if key == "choice":
        return StructuredOutputSpec("choice", _choice_text(value, f"{param}.choice"))
    return StructuredOutputSpec(key, _non_empty_string(value, f"{param}.{key}"))  # type: ignore[arg-type]


def structured_output_spec(
    request: CompletionRequest | ChatCompletionRequest,
) -> StructuredOutputSpec | None:
    """The one constraint the request asks for, or None; InvalidRequestError names the field."""
    found: dict[str, StructuredOutputSpec] = {}
    if request.response_format is not None:
        spec = _from_response_format(request.response_format.model_dump(by_alias=True))
        if spec is not None:
            found["response_format"] = spec
    if request.guided_json is not None:
        found["guided_json"] = StructuredOutputSpec(
            "json", _schema_text(request.guided_json, "guided_json")
        )
    if request.guided_regex is not None:
        found["guided_regex"] = StructuredOutputSpec(
            "regex", _non_empty_string(request.guided_regex, "guided_regex")
        )
    if request.guided_choice is not None:
        found["guided_choice"] = StructuredOutputSpec(
            "choice", _choice_text(request.guided_choice, "guided_choice")
        )
    if request.guided_grammar is not None:
        found["guided_grammar"] = StructuredOutputSpec(
            "grammar", _non_empty_string(request.guided_grammar, "guided_grammar")
        )
    if request.structured_outputs is not None:
        fields = request.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        spec = _from_structured_outputs(fields)
        if spec is not None:
            found["structured_outputs"] = spec
    if len(found) > 1:
        names = sorted(found)
        raise InvalidRequestError(f"use only one of {names} per request", param=names[-1])
    if not found:
        return None
    (param, spec) = next(iter(found.items()))
    if request.ignore_eos:
        # A complete text ends on the EOS the grammar forces; ignoring it would
        # leave nothing the grammar allows.
        raise InvalidRequestError(f"ignore_eos cannot be combined with {param}", param="ignore_eos")
    return spec
