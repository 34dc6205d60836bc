"""The request rules JSON Schema cannot state, for `schemathesis run` (SCHEMATHESIS_HOOKS).

/openapi.json states every rule about one field (gateway/openai/protocol.py). These
tie fields together or need the tokenizer; the schema describes each on its
fields, and this hook keeps schemathesis from generating "valid" requests that
break one, so that its positive_data_acceptance check holds the server to the
rest. Each rule is written here independently of the server's code, except the
chat prompt's token count, which uses the gateway's own rendering of a chat,
and which constraint a body asks for (the gateway's own reading), whose grammar,
regex or JSON schema must then parse with xgrammar, as the worker's does.
The server's limits (context length, --max-tokens-per-request) are read from
the schema it serves, so one hook file serves the fake engine and a real stack.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pydantic
import schemathesis
import xgrammar as xgr

from kvmesh.gateway.engine_params.structured_outputs import structured_output_spec
from kvmesh.gateway.engine_params.validation import DEFAULT_COMPLETION_MAX_TOKENS, chat_prompt
from kvmesh.gateway.openai.protocol import ChatCompletionRequest, CompletionRequest
from kvmesh.gateway.responses.conversation import chat_request
from kvmesh.gateway.responses.protocol import ResponsesRequest
from kvmesh.gateway.tokenizer import Tokenizer
from kvmesh.gateway.tool_calling.plan import plan_tools
from kvmesh.services.contracts.errors import KvmeshError
from kvmesh.services.runtime.model_prep import default_model_path

_TOKENIZER = Tokenizer.from_pretrained(default_model_path())
_GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _is_json_object_text(value: Any) -> bool:
    if not isinstance(value, str):
        return True  # an object given as such
    try:
        return isinstance(json.loads(value), dict | bool)
    except json.JSONDecodeError:
        return False


def _structured_sources(body: dict[str, Any]) -> list[Any]:
    """The structured-output constraints the body asks for (at most one is allowed)."""
    sources: list[Any] = [body[field] for field in _GUIDED_FIELDS if body.get(field) is not None]
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") not in (None, "text"):
        sources.append(response_format)
    structured = body.get("structured_outputs")
    if isinstance(structured, dict):
        sources += [value for value in structured.values() if value not in (None, False)]
    return sources


def _json_texts_valid(body: dict[str, Any]) -> bool:
    structured = body.get("structured_outputs")
    nested = structured.get("json") if isinstance(structured, dict) else None
    return _is_json_object_text(body.get("guided_json")) and _is_json_object_text(nested)


def _tool_rules_hold(body: dict[str, Any]) -> bool:
    """tool_choice other than none needs tools, names one of them, and forces no second
    structured output."""
    choice = body.get("tool_choice")
    if choice in (None, "none"):
        return True
    names = [tool["function"]["name"] for tool in body.get("tools") or []]
    if not names:
        return False
    if isinstance(choice, dict) and choice["function"]["name"] not in names:
        return False
    return choice == "auto" or not _structured_sources(body)


def _cross_field_rules_hold(body: dict[str, Any], chat: bool) -> bool:
    sources = _structured_sources(body)
    forced_tool = chat and body.get("tool_choice") not in (None, "none", "auto")
    return not (
        (body.get("stream_options") is not None and not body.get("stream"))
        or (body.get("prompt_logprobs") and body.get("stream"))
        or (chat and body.get("top_logprobs") and not body.get("logprobs"))
        or len(sources) > 1
        or (body.get("allowed_token_ids") and (sources or forced_tool))
        or (body.get("ignore_eos") and (sources or forced_tool))
        or not _json_texts_valid(body)
        or (not chat and body.get("best_of") is not None and body["best_of"] != body.get("n", 1))
        or (chat and body.get("continue_final_message") and body.get("add_generation_prompt", True))
        or (chat and not _tool_rules_hold(body))
    )


_PARSERS = {
    "grammar": xgr.Grammar.from_ebnf,
    "regex": xgr.Grammar.from_regex,
    "json": xgr.Grammar.from_json_schema,
}


def _constraint_parses(body: dict[str, Any], chat: bool) -> bool:
    """A grammar, regex or JSON schema the body constrains the output with parses (no
    JSON Schema keyword can say "valid EBNF"; the fake engine never compiles one)."""
    model = ChatCompletionRequest if chat else CompletionRequest
    try:
        spec = structured_output_spec(model.model_validate(body))
    except (pydantic.ValidationError, KvmeshError):
        return True  # refused for a reason of its own, which the run must see
    parse = _PARSERS.get(spec.kind) if spec is not None else None
    if parse is None:
        return True
    try:
        parse(spec.value)
    except (RuntimeError, ValueError, TypeError):
        return False
    return True


@dataclass(frozen=True)
class _Served:
    """What the served schema says of this server's bounds."""

    max_model_len: int
    # The most max_tokens may be: --max-tokens-limit, which also caps the defaults.
    max_output_len: int
    max_tokens_per_request: int


def _served(case: schemathesis.Case) -> _Served:
    request = case.operation.schema.raw_schema["components"]["schemas"]["CompletionRequest"]
    truncate = request["properties"]["truncate_prompt_tokens"]["anyOf"]
    max_tokens = request["properties"]["max_tokens"]["anyOf"]
    (max_model_len,) = [item["maximum"] for item in truncate if "maximum" in item]
    (max_output_len,) = [item["maximum"] for item in max_tokens if "maximum" in item]
    return _Served(max_model_len, max_output_len, request["x-max-tokens-per-request"])


def _responses_rules_hold(body: dict[str, Any], served: _Served) -> bool:
    """/v1/responses: tool_choice other than none needs tools and a named one is one of them
    (a forced call overrides text.format, so the two do not clash); the input holds more
    than reasoning items; and the prompt fits. ``store`` false is left out: such a
    response is not kept, which the OpenAPI link from POST to GET / DELETE cannot say.
    ``stream`` true is left out for the same link: it reads the id from a JSON body,
    and a streamed response's id travels in its first event (the streamed events have
    their own tests, tests/gateway/test_gateway_responses_events.py)."""
    if body.get("store") is False or body.get("stream"):
        return False
    choice = body.get("tool_choice")
    if choice not in (None, "none"):
        names = [tool["name"] for tool in body.get("tools") or []]
        if not names or (isinstance(choice, dict) and choice["name"] not in names):
            return False
    items = body.get("input")
    if isinstance(items, list) and all(
        isinstance(item, dict) and item.get("type") == "reasoning" for item in items
    ):
        return False
    try:
        request = chat_request(ResponsesRequest.model_validate(body), [])
    except pydantic.ValidationError:
        return True  # refused for a reason of its own, which the run must see
    lengths = _prompt_lengths(
        request.model_dump(by_alias=True, exclude_none=True), True, served.max_model_len
    )
    if not lengths:
        return lengths is None
    room = min(served.max_model_len - lengths[0], served.max_output_len)
    return lengths[0] < served.max_model_len and (body.get("max_output_tokens") or room) <= room


def _prompt_lengths(body: dict[str, Any], chat: bool, max_model_len: int) -> list[int] | None:
    """Tokens of each prompt as the gateway counts them (None: not a valid body)."""
    if chat:
        try:
            request = ChatCompletionRequest.model_validate(body)
            plan = plan_tools(request, auto_tool_choice=True)
            prompt = chat_prompt(request, _TOKENIZER, plan.tools if plan.renders_tools else None)
        except (pydantic.ValidationError, KvmeshError):
            return None  # refused for a reason of its own, which the run must see
        lengths = [len(prompt.token_ids)]
    else:
        try:
            raw = CompletionRequest.model_validate(body).prompt
        except pydantic.ValidationError:
            return None
        items = [raw] if isinstance(raw, str) or isinstance(raw[0], int) else raw
        lengths = [
            len(_TOKENIZER.encode(item)) if isinstance(item, str) else len(item)
            for item in items or []
        ]
    truncate = body.get("truncate_prompt_tokens")
    if truncate is not None:
        keep = max_model_len if truncate == -1 else truncate
        lengths = [min(length, keep) for length in lengths]
    return lengths


def _fits_the_context(body: dict[str, Any], chat: bool, served: _Served) -> bool:
    """Each prompt has a token, prompt + max_tokens <= max_model_len, min_tokens <= max_tokens,
    and over all choices prompt + max_tokens <= --max-tokens-per-request."""
    lengths = _prompt_lengths(body, chat, served.max_model_len)
    if not lengths:
        return lengths is None
    if min(lengths) == 0 or max(lengths) >= served.max_model_len:
        return False
    room = served.max_model_len - max(lengths)
    if chat:
        # The default is the room left (each prompt's own; chat has one).
        default = min(room, served.max_output_len)
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or default
    else:
        default = min(DEFAULT_COMPLETION_MAX_TOKENS, served.max_output_len)
        max_tokens = body.get("max_tokens") or default
    n = body.get("n") or 1
    held = n * sum(length + max_tokens for length in lengths)
    return (
        max_tokens <= room
        and (body.get("min_tokens") or 0) <= max_tokens
        and held <= served.max_tokens_per_request
    )


@schemathesis.hook
def filter_case(context: schemathesis.HookContext, case: schemathesis.Case) -> bool:
    """Applied to every phase's cases (filter_body would miss the coverage phase)."""
    body = case.body
    path = case.operation.path
    if isinstance(body, dict) and path == "/v1/responses":
        return _seed_in_range(body) and _responses_rules_hold(body, _served(case))
    if not isinstance(body, dict) or path not in ("/v1/completions", "/v1/chat/completions"):
        return True
    chat = path == "/v1/chat/completions"
    return (
        _seed_in_range(body)
        and _cross_field_rules_hold(body, chat)
        and _constraint_parses(body, chat)
        and _fits_the_context(body, chat, _served(case))
    )


# The seed's bounds (gateway/openai/protocol.py's SEED_MIN/SEED_MAX, restated). JSON Schema
# validators compare numbers as doubles, and near 2**63 doubles are 1,024 apart: a
# seed up to 1,023 above the maximum passes the schema check, not the server's.
_SEED_MIN, _SEED_MAX = -(2**63), 2**63 - 1024


def _seed_in_range(body: dict[str, Any]) -> bool:
    seed = body.get("seed")
    return not isinstance(seed, int) or _SEED_MIN <= seed <= _SEED_MAX
