"""No input can make the gateway answer 5xx: random bodies get a 2xx or a 4xx OpenAI error."""

from __future__ import annotations

import asyncio
import json

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.gateway.openai.app import build_app

_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_PARAMS = [
    "n",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "echo",
    "stream",
    "stream_options",
    "priority",
    "cache_salt",
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "structured_outputs",
    "tools",
    "tool_choice",
    "user",
    "model",
    "skip_special_tokens",
    "include_stop_str_in_output",
]
_MESSAGES = st.one_of(
    _VALUES,
    st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant", "tool", "x"])},
            optional={"content": _VALUES, "tool_calls": _VALUES, "name": _VALUES},
        ),
        max_size=3,
    ),
)


def _body(prompt_key: str):
    prompt = (
        _MESSAGES
        if prompt_key == "messages"
        else st.one_of(_VALUES, st.lists(st.integers(min_value=-5, max_value=60_000), max_size=8))
    )
    return st.fixed_dictionaries(
        {prompt_key: prompt, "max_tokens": st.integers(min_value=-2, max_value=8)},
        optional={name: _VALUES for name in _PARAMS if name != "max_tokens"},
    )


def _check(app, path: str, body: dict) -> None:
    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            return await client.post(
                path,
                content=json.dumps(body, allow_nan=True),
                headers={"content-type": "application/json"},
            )

    response = asyncio.run(post())
    assert response.status_code < 500, (body, response.text)
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"]


_SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@_SETTINGS
@given(body=_body("prompt"))
def test_random_completion_bodies_never_5xx(engine, tokenizer, registry, body) -> None:
    _check(build_app(engine, tokenizer, "m", metrics_registry=registry), "/v1/completions", body)


@_SETTINGS
@given(body=_body("messages"))
def test_random_chat_bodies_never_5xx(engine, tokenizer, registry, body) -> None:
    _check(
        build_app(engine, tokenizer, "m", metrics_registry=registry), "/v1/chat/completions", body
    )
