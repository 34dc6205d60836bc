"""Tools and earlier calls in the prompt, for templates that render them and those that do not.

Tools are rendered through the model's chat template (``tools=``) when the
template uses them. Templates that ignore tools (SmolLM2's among them) get
the Hermes convention instead: the tool schemas in the system prompt, earlier
assistant calls as ``<tool_call>`` text and tool results as ``<tool_response>``
(so ``--tool-call-parser`` defaults to hermes for them).
"""

from __future__ import annotations

import json
from typing import Any

from kvmesh.gateway.tool_calling.hermes import TOOL_CALL_END, TOOL_CALL_START


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
