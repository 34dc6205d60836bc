"""POST /v1/chat/completions: template rendering, response shape, streaming deltas, logprobs."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from kvmesh.gateway.tokenizer import Tokenizer
from kvmesh.services.runtime.model_prep import default_model_path
from tests.gateway.fakes import FakeEngineClient
from tests.gateway.helpers import MAX_MODEL_LEN, MODEL_NAME, parse_sse

CONVERSATION = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another one?"},
]


@pytest.fixture(scope="module")
def hf_tokenizer(tokenizer: Tokenizer) -> Any:
    return AutoTokenizer.from_pretrained(str(default_model_path()))


def hf_prompt_ids(hf_tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    text = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return hf_tokenizer.encode(text, add_special_tokens=False)


def output_ids(prompt_ids: list[int], count: int, offset: int = 0) -> list[int]:
    return [prompt_ids[(i + offset) % len(prompt_ids)] for i in range(count)]


@pytest.mark.parametrize(
    "messages",
    [
        CONVERSATION,
        [{"role": "user", "content": "hi"}],  # the template adds its default system prompt
    ],
)
async def test_prompt_is_the_models_own_chat_template(
    client: httpx.AsyncClient,
    engine: FakeEngineClient,
    hf_tokenizer: Any,
    messages: list[dict[str, Any]],
) -> None:
    response = await client.post(
        "/v1/chat/completions", json={"messages": messages, "max_tokens": 2}
    )
    assert response.status_code == 200, response.text
    (sent,) = engine.requests
    assert sent.prompt_token_ids == hf_prompt_ids(hf_tokenizer, messages)


async def test_text_parts_are_joined_like_plain_content(
    client: httpx.AsyncClient, engine: FakeEngineClient, hf_tokenizer: Any
) -> None:
    parts = [{"type": "text", "text": "Name a"}, {"type": "text", "text": "colour."}]
    await client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": parts}], "max_tokens": 1},
    )
    plain = [{"role": "user", "content": "Name a\ncolour."}]
    assert engine.requests[0].prompt_token_ids == hf_prompt_ids(hf_tokenizer, plain)


async def test_developer_role_is_rendered_as_system(
    client: httpx.AsyncClient, engine: FakeEngineClient, hf_tokenizer: Any
) -> None:
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    as_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert engine.requests[0].prompt_token_ids == hf_prompt_ids(hf_tokenizer, as_system)


async def test_chat_response_fields(
    client: httpx.AsyncClient, tokenizer: Tokenizer, hf_tokenizer: Any
) -> None:
    response = await client.post(
        "/v1/chat/completions",
        json={"model": MODEL_NAME, "messages": CONVERSATION, "max_tokens": 6, "n": 2},
    )
    body = response.json()
    prompt_ids = hf_prompt_ids(hf_tokenizer, CONVERSATION)
    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    assert body["model"] == MODEL_NAME
    for index, choice in enumerate(body["choices"]):
        assert choice["index"] == index
        assert choice["message"]["role"] == "assistant"
        assert choice["message"]["content"] == tokenizer.decode(output_ids(prompt_ids, 6, index))
        assert choice["finish_reason"] == "length"
        assert choice["logprobs"] is None
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    assert body["usage"]["completion_tokens"] == 12
    assert body["usage"]["total_tokens"] == len(prompt_ids) + 12


async def test_chat_cached_tokens_count_every_sample_of_n(
    client: httpx.AsyncClient, engine: FakeEngineClient
) -> None:
    engine.num_cached_tokens = 2
    engine.num_sibling_cached_tokens = 16
    request = {"messages": CONVERSATION, "max_tokens": 2, "n": 3}
    response = await client.post("/v1/chat/completions", json=request)
    assert response.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 34}
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    streamed = await client.post("/v1/chat/completions", json={**request, **stream})
    usage = parse_sse(streamed.text)[-2]["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 34}


async def test_max_tokens_defaults_to_the_room_left(
    client: httpx.AsyncClient, engine: FakeEngineClient, hf_tokenizer: Any
) -> None:
    await client.post("/v1/chat/completions", json={"messages": CONVERSATION, "ignore_eos": True})
    prompt_len = len(hf_prompt_ids(hf_tokenizer, CONVERSATION))
    assert engine.requests[0].sampling_params.max_tokens == MAX_MODEL_LEN - prompt_len


async def test_max_completion_tokens_wins_over_max_tokens(
    client: httpx.AsyncClient, engine: FakeEngineClient
) -> None:
    await client.post(
        "/v1/chat/completions",
        json={"messages": CONVERSATION, "max_tokens": 9, "max_completion_tokens": 3},
    )
    assert engine.requests[0].sampling_params.max_tokens == 3


async def test_eos_in_output_finishes_with_stop(
    client: httpx.AsyncClient, hf_tokenizer: Any, tokenizer: Tokenizer
) -> None:
    # The fake echoes the prompt, whose first turn ends with <|im_end|> (EOS).
    prompt_ids = hf_prompt_ids(hf_tokenizer, CONVERSATION)
    eos_position = prompt_ids.index(tokenizer.eos_token_id)
    response = await client.post("/v1/chat/completions", json={"messages": CONVERSATION})
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == tokenizer.eos_token_id
    assert response.json()["usage"]["completion_tokens"] == eos_position + 1


async def test_chat_logprobs_format(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v1/chat/completions",
        json={"messages": CONVERSATION, "max_tokens": 5, "logprobs": True, "top_logprobs": 2},
    )
    choice = response.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == 5
    assert "".join(entry["token"] for entry in content) == choice["message"]["content"]
    for entry in content:
        assert entry["bytes"] == list(entry["token"].encode("utf-8"))
        assert isinstance(entry["logprob"], float)
        assert len(entry["top_logprobs"]) == 2
        for alt in entry["top_logprobs"]:
            assert set(alt) == {"token", "logprob", "bytes"}
            assert alt["bytes"] == list(alt["token"].encode("utf-8"))


async def test_chat_stream_deltas(
    client: httpx.AsyncClient, tokenizer: Tokenizer, hf_tokenizer: Any
) -> None:
    response = await client.post(
        "/v1/chat/completions",
        json={
            "messages": CONVERSATION,
            "max_tokens": 4,
            "n": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert response.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(response.text)
    assert events[-1] == "[DONE]"
    *chunks, usage_chunk = events[:-1]
    assert len({c["id"] for c in events[:-1]}) == 1
    prompt_ids = hf_prompt_ids(hf_tokenizer, CONVERSATION)
    for chunk in chunks:
        assert chunk["object"] == "chat.completion.chunk"
        assert chunk["model"] == MODEL_NAME
        assert chunk["usage"] is None
        assert len(chunk["choices"]) == 1
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert all("role" not in c["delta"] for c in mine[1:])
        assert [c["finish_reason"] for c in mine] == [None] * (len(mine) - 1) + ["length"]
        text = "".join(c["delta"].get("content", "") for c in mine)
        assert text == tokenizer.decode(output_ids(prompt_ids, 4, index))
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 8
    assert usage_chunk["usage"]["prompt_tokens"] == len(prompt_ids)


async def test_chat_stream_logprobs_per_chunk(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v1/chat/completions",
        json={"messages": CONVERSATION, "max_tokens": 3, "stream": True, "logprobs": True},
    )
    chunks = parse_sse(response.text)[:-1]
    entries = [
        entry
        for chunk in chunks
        if chunk["choices"][0]["logprobs"] is not None
        for entry in chunk["choices"][0]["logprobs"]["content"]
    ]
    assert [entry["logprob"] for entry in entries] == [-0.5, -1.0, -1.5]
    assert all(entry["top_logprobs"] == [] for entry in entries)


async def test_chat_prompt_logprobs_cover_the_rendered_prompt(
    client: httpx.AsyncClient, hf_tokenizer: Any
) -> None:
    response = await client.post(
        "/v1/chat/completions",
        json={"messages": CONVERSATION, "max_tokens": 2, "prompt_logprobs": 0},
    )
    body = response.json()
    prompt_ids = hf_prompt_ids(hf_tokenizer, CONVERSATION)
    prompt_logprobs = body["prompt_logprobs"]
    assert len(prompt_logprobs) == len(prompt_ids) and prompt_logprobs[0] is None
    for position, entry in enumerate(prompt_logprobs[1:], start=1):
        assert list(entry) == [str(prompt_ids[position])]
        assert entry[str(prompt_ids[position])]["logprob"] == -0.5 * (position + 1)
    streamed = await client.post(
        "/v1/chat/completions",
        json={"messages": CONVERSATION, "stream": True, "prompt_logprobs": 1},
    )
    assert streamed.status_code == 400
    assert streamed.json()["error"]["param"] == "prompt_logprobs"


async def test_chat_logprobs_as_token_ids_stream_and_whole(
    client: httpx.AsyncClient, hf_tokenizer: Any
) -> None:
    prompt_ids = hf_prompt_ids(hf_tokenizer, CONVERSATION)
    request = {
        "messages": CONVERSATION,
        "max_tokens": 2,
        "logprobs": True,
        "top_logprobs": 1,
        "return_tokens_as_token_ids": True,
    }
    whole = (await client.post("/v1/chat/completions", json=request)).json()
    content = whole["choices"][0]["logprobs"]["content"]
    assert [entry["token"] for entry in content] == [f"token_id:{t}" for t in prompt_ids[:2]]
    assert content[0]["bytes"] == list(f"token_id:{prompt_ids[0]}".encode())
    assert content[0]["top_logprobs"][0]["token"] == f"token_id:{prompt_ids[0]}"
    streamed = await client.post("/v1/chat/completions", json={**request, "stream": True})
    chunks = parse_sse(streamed.text)[:-1]
    tokens = [
        entry["token"]
        for chunk in chunks
        if chunk["choices"][0]["logprobs"] is not None
        for entry in chunk["choices"][0]["logprobs"]["content"]
    ]
    assert tokens == [entry["token"] for entry in content]
