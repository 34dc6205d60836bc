"""Tool calling on chat completions: validate tools, render them, constrain or parse calls.

- ``tool_choice`` "none": tools are neither rendered nor parsed.
- "auto" (the default with tools): tools are rendered and the output is parsed
  for Hermes-style ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks (gateway/tool_parser_hermes.py).
- "required": the output is constrained (JSON schema) to a non-empty array of
  ``{"name", "arguments"}`` objects, one of the tools' names each, with
  arguments valid against that tool's parameters.
- a named function: the output is constrained to that function's arguments.

Tools are rendered through the model's chat template (``tools=``) when the
template uses them. Templates that ignore tools (SmolLM2's among them) get
the Hermes convention instead: the tool schemas in the system prompt, earlier
assistant calls as ``<tool_call>`` text and tool results as ``<tool_response>``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.protocol import ChatCompletionRequest
from gateway.protocol import FunctionCall as FunctionCallModel
from gateway.protocol import ToolCall as ToolCallModel
from gateway.tool_call_modes import StreamingToolParser
from gateway.tool_call_stream import ParsedOutput, ToolCall, collect
from gateway.tool_parser_hermes import TOOL_CALL_END, TOOL_CALL_START
from services.errors import InvalidRequestError
from services.sampling_params import StructuredOutputSpec

ToolMode = Literal["none", "auto", "required", "named"]


def _function_of(tool: Any, index: int) -> dict[str, Any]:
    param = f"tools.{index}"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise InvalidRequestError("only tools of type function are supported", param=param)
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidRequestError("a tool needs function.name", param=f"{param}.function")
    if not function["name"]:
        raise InvalidRequestError("function.name must not be empty", param=f"{param}.function.name")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise InvalidRequestError(
            "function.parameters must be a JSON schema object",
            param=f"{param}.function.parameters",
        )
    return function


def _arguments_schema(function: dict[str, Any]) -> dict[str, Any]:
    parameters = function.get("parameters")
    return parameters if parameters else {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses its tools."""

    mode: ToolMode
    functions: list[dict[str, Any]] = field(default_factory=list)
    function_name: str | None = None  # the forced function (mode "named")
    parallel_tool_calls: bool = True

    @property
    def renders_tools(self) -> bool:
        return self.mode != "none" and bool(self.functions)

    @property
    def tools(self) -> list[dict[str, Any]]:
        """OpenAI's tool objects, as chat templates expect them."""
        return [{"type": "function", "function": function} for function in self.functions]

    def constraint(self) -> StructuredOutputSpec | None:
        """The JSON-schema constraint that forces valid calls ("required" / named)."""
        if self.mode == "named":
            function = next(f for f in self.functions if f["name"] == self.function_name)
            return StructuredOutputSpec("json", json.dumps(_arguments_schema(function)))
        if self.mode == "required":
            call_schemas = [
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [function["name"]]},
                        "arguments": _arguments_schema(function),
                    },
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for function in self.functions
            ]
            schema: dict[str, Any] = {
                "type": "array",
                "minItems": 1,
                "items": call_schemas[0] if len(call_schemas) == 1 else {"anyOf": call_schemas},
            }
            if not self.parallel_tool_calls:
                schema["maxItems"] = 1
            return StructuredOutputSpec("json", json.dumps(schema))
        return None

    def parse(self, text: str) -> ParsedOutput:
        """The generated text as content and tool calls; unparsable output stays content.

        The same parser as a stream's, run over the whole text, so a streamed
        response adds up to this one.
        """
        if self.mode == "none":
            return ParsedOutput(content=text)
        parser = StreamingToolParser(self.mode, self.function_name)
        events = parser.feed(text) + parser.finish()
        return collect(events) if parser.ok else ParsedOutput(content=text)


def plan_tools(request: ChatCompletionRequest) -> ToolPlan:
    """Validate ``tools`` / ``tool_choice``; InvalidRequestError names the offending field."""
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools or []]
    functions = [_function_of(tool, index) for index, tool in enumerate(tools)]
    names = [function["name"] for function in functions]
    choice = request.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = choice.model_dump()
    parallel = request.parallel_tool_calls is not False
    if choice is None:
        return ToolPlan("auto" if functions else "none", functions, None, parallel)
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise InvalidRequestError(
                f"tool_choice must be none, auto, required or a function, got {choice!r}",
                param="tool_choice",
            )
        if choice != "none" and not functions:
            raise InvalidRequestError(f"tool_choice {choice!r} needs tools", param="tool_choice")
        return ToolPlan(choice, functions, None, parallel)  # type: ignore[arg-type]
    function = choice.get("function") if choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise InvalidRequestError(
            'tool_choice must look like {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if name not in names:
        raise InvalidRequestError(
            f"tool_choice names {name!r}, which is not in tools", "tool_choice"
        )
    return ToolPlan("named", functions, name, parallel)


def tool_calls_for_template(tool_calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant calls from the history with arguments as objects, as templates expect.

    Arguments that are not valid JSON stay the string the client sent: the
    request must not fail because an earlier turn was malformed.
    """
    normalized = []
    for call in tool_calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                arguments = json.loads(function["arguments"])
            except json.JSONDecodeError:
                arguments = function["arguments"]
            call = {**call, "function": {**function, "arguments": arguments}}
        normalized.append(call)
    return normalized


def _system_prompt(tools: list[dict[str, Any]]) -> str:
    schemas = "\n".join(json.dumps(tool["function"], ensure_ascii=False) for tool in tools)
    return (
        "You may call one or more functions to assist with the user query. The functions "
        f"are described in JSON below.\n<tools>\n{schemas}\n</tools>\nFor each function "
        f"call, answer with a JSON object inside {TOOL_CALL_START}{TOOL_CALL_END} tags:\n"
        f'{TOOL_CALL_START}{{"name": <function-name>, "arguments": <args-json-object>}}'
        f"{TOOL_CALL_END}"
    )


def _call_text(call: dict[str, Any]) -> str:
    function = call.get("function") or {}
    payload = {"name": function.get("name"), "arguments": function.get("arguments")}
    return f"{TOOL_CALL_START}{json.dumps(payload, ensure_ascii=False)}{TOOL_CALL_END}"


def messages_with_tools_in_text(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The conversation for a template that ignores tools: everything as plain text."""
    rendered: list[dict[str, Any]] = []
    for message in messages:
        entry = {k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")}
        if message.get("tool_calls"):
            calls = "\n".join(_call_text(call) for call in message["tool_calls"])
            entry["content"] = "\n".join(part for part in (message["content"], calls) if part)
        if message["role"] == "tool":
            entry["content"] = f"<tool_response>\n{message['content']}\n</tool_response>"
        rendered.append(entry)
    prompt = _system_prompt(tools)
    if rendered and rendered[0]["role"] == "system":
        rendered[0] = {**rendered[0], "content": f"{rendered[0]['content']}\n\n{prompt}"}
    else:
        rendered.insert(0, {"role": "system", "content": prompt})
    return rendered


def tool_call_models(calls: list[ToolCall]) -> list[ToolCallModel]:
    return [
        ToolCallModel(
            id=call.id, function=FunctionCallModel(name=call.name, arguments=call.arguments)
        )
        for call in calls
    ]
