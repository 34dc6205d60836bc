"""How one request uses its tools: validate them, pick the mode, build the constraint.

- ``tool_choice`` "none": tools are neither rendered nor parsed.
- "auto" (the default with tools): tools are rendered and the output is parsed
  by the server's ``--tool-call-parser`` (gateway/tool_calling/registry.py).
  As in vLLM, it needs ``--enable-auto-tool-choice``: without it, "auto" is a
  400 that says so.
- "required": the output is constrained (JSON schema) to a non-empty array of
  ``{"name", "arguments"}`` objects, one of the tools' names each, with
  arguments valid against that tool's parameters.
- a named function: the output is constrained to that function's arguments.

Tools are rendered through the model's chat template (gateway/tool_calling/prompt.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from kvmesh.gateway.openai.protocol import ChatCompletionRequest
from kvmesh.services.contracts.errors import InvalidRequestError
from kvmesh.services.contracts.sampling_params import StructuredOutputSpec

ToolMode = Literal["none", "auto", "required", "named"]
# vLLM's words, which clients (and agent frameworks) recognize.
AUTO_NEEDS_FLAGS = (
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
)


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


def plan_tools(request: ChatCompletionRequest, auto_tool_choice: bool) -> ToolPlan:
    """Validate a chat request's ``tools`` / ``tool_choice`` (see ``plan_tool_choice``)."""
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools or []]
    choice = request.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = choice.model_dump()
    return plan_tool_choice(tools, choice, request.parallel_tool_calls, auto_tool_choice)


def plan_tool_choice(
    tools: list[Any],
    choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool | None,
    auto_tool_choice: bool,
) -> ToolPlan:
    """Validate OpenAI's tools and tool_choice; InvalidRequestError names the offending field.

    ``auto_tool_choice``: the server parses calls out of free text
    (``--enable-auto-tool-choice`` with a parser); without it "auto", asked
    for or implied by tools without a tool_choice, is refused as vLLM does.
    """
    functions = [_function_of(tool, index) for index, tool in enumerate(tools)]
    names = [function["name"] for function in functions]
    parallel = parallel_tool_calls is not False
    if choice is None:
        choice = "auto" if functions else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise InvalidRequestError(
                f"tool_choice must be none, auto, required or a function, got {choice!r}",
                param="tool_choice",
            )
        if choice != "none" and not functions:
            raise InvalidRequestError(f"tool_choice {choice!r} needs tools", param="tool_choice")
        if choice == "auto" and not auto_tool_choice:
            raise InvalidRequestError(AUTO_NEEDS_FLAGS, param="tool_choice")
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
