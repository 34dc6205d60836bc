"""Recorded-style generations of each family's tool-call format, and what a client must get.

Written the way the families' models answer (special tokens spelled out as
text, as the detokenizer leaves them when the parser needs them): each holds
two parallel calls, and some open with a sentence the format allows before
its calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
    },
}
TOOLS = [WEATHER, CLOCK]
TWO_CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"tz": "CET"})]


@dataclass(frozen=True)
class Sample:
    parser: str
    text: str
    content: str | None
    calls: list[tuple[str, dict[str, Any]]]

    @property
    def id(self) -> str:
        return f"{self.parser}:{self.text[:24]}"


SAMPLES = [
    Sample(
        "hermes",
        "I'll check both.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
        "</tool_call>\n<tool_call>\n"
        '{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>',
        "I'll check both.\n",
        TWO_CALLS,
    ),
    Sample(
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
        '{"name": "get_time", "parameters": {"tz": "CET"}}',
        None,
        TWO_CALLS,
    ),
    Sample(
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
        None,
        TWO_CALLS[:1],
    ),
    Sample(
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
        '{"name": "get_time", "arguments": {"tz": "CET"}}]',
        None,
        TWO_CALLS,
    ),
    Sample(
        "mistral",
        'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}'
        '[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}',
        "Sure. ",
        TWO_CALLS,
    ),
    Sample(
        "pythonic",
        "[get_weather(city='Paris', days=3), get_time(tz=\"CET\")]",
        None,
        TWO_CALLS,
    ),
    Sample(
        "pythonic",
        '<|python_start|>[get_weather(city="Paris", days=3), get_time(tz="CET")]<|python_end|>',
        None,
        TWO_CALLS,
    ),
    Sample(
        "qwen3_coder",
        "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
        "<function=get_time>\n<parameter=tz>\nCET\n</parameter>\n</function>\n</tool_call>",
        "Checking.\n",
        TWO_CALLS,
    ),
]

# Output each format cannot read: all of it must come back as content, never an error.
MALFORMED = [
    ("hermes", '<tool_call>{"name": get_weather, "arguments": {}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Par'),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call> and prose'),
    ("llama3_json", '{"answer": 42}'),
    ("llama3_json", '{"name": "Bob", "parameters": {"age": 3}}'),
    ("llama3_json", '{"name": "get_time", "parameters": {}} is what I would call'),
    ("mistral", "[TOOL_CALLS]get the weather[ARGS]{}"),
    ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {}} oops'),
    ("pythonic", "[get_weather(city=Paris)]"),
    ("pythonic", "[get_weather('Paris')]"),
    ("pythonic", "[1, 2, 3] are the numbers"),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"),
    ("qwen3_coder", "<tool_call>\n<func=get_weather>\n</tool_call>"),
]
