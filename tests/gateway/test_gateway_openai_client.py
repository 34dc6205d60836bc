"""The official openai client, pointed at the ASGI app, parses every response we send."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import openai
import pytest
from fastapi import FastAPI

from kvmesh.gateway.tokenizer import Tokenizer
from tests.gateway.fakes import FakeEngineClient
from tests.gateway.helpers import MODEL_NAME

PROMPT = "Rivers flow into the sea because"


@pytest.fixture
async def openai_client(app: FastAPI) -> AsyncIterator[openai.AsyncOpenAI]:
    http_client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
    client = openai.AsyncOpenAI(
        base_url="http://gateway/v1", api_key="unused", http_client=http_client, max_retries=0
    )
    yield client
    await client.close()


def expected(tokenizer: Tokenizer, prompt_ids: list[int], count: int) -> str:
    return tokenizer.decode([prompt_ids[i % len(prompt_ids)] for i in range(count)])


async def test_completion(openai_client: openai.AsyncOpenAI, tokenizer: Tokenizer) -> None:
    completion = await openai_client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=5, logprobs=2
    )
    assert completion.object == "text_completion"
    assert completion.choices[0].text == expected(tokenizer, tokenizer.encode(PROMPT), 5)
    assert completion.choices[0].finish_reason == "length"
    assert completion.choices[0].logprobs is not None
    assert len(completion.choices[0].logprobs.tokens or []) == 5
    assert completion.usage is not None and completion.usage.completion_tokens == 5


async def test_completion_stream(openai_client: openai.AsyncOpenAI, tokenizer: Tokenizer) -> None:
    stream = await openai_client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage, finish = "", None, None
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.text
            finish = choice.finish_reason or finish
        usage = chunk.usage or usage
    assert text == expected(tokenizer, tokenizer.encode(PROMPT), 6)
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 6


async def test_chat(openai_client: openai.AsyncOpenAI, engine: FakeEngineClient) -> None:
    chat = await openai_client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Say something"}],
        max_completion_tokens=4,
        logprobs=True,
        top_logprobs=1,
        n=2,
    )
    assert chat.object == "chat.completion"
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content is not None
    assert chat.choices[0].logprobs is not None
    assert len(chat.choices[0].logprobs.content or []) == 4
    assert chat.usage is not None and chat.usage.completion_tokens == 8
    assert len(engine.requests) == 2


async def test_chat_stream(openai_client: openai.AsyncOpenAI, tokenizer: Tokenizer) -> None:
    stream = await openai_client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Say something"}],
        max_tokens=5,
        stream=True,
    )
    roles, content, finish = [], "", None
    async for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        delta = chunk.choices[0].delta
        if delta.role:
            roles.append(delta.role)
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    assert roles == ["assistant"]
    assert finish == "length"
    non_stream = await openai_client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Say something"}], max_tokens=5
    )
    assert content == non_stream.choices[0].message.content


async def test_errors_surface_as_openai_exceptions(openai_client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        await openai_client.completions.create(model=MODEL_NAME, prompt=PROMPT, temperature=5)
    assert bad.value.status_code == 400
    assert bad.value.param == "temperature"  # type: ignore[attr-defined]
    with pytest.raises(openai.NotFoundError):
        await openai_client.completions.create(model="missing", prompt=PROMPT)
    models = await openai_client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
