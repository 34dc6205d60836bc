"""POST /v1/completions against the fake engine: response shape, fan-out, echo, stops, logprobs."""

from __future__ import annotations

import httpx

from kvmesh.gateway.tokenizer import Tokenizer
from tests.gateway.fakes import FakeEngineClient
from tests.gateway.helpers import MODEL_NAME, parse_sse

PROMPT = "The quick brown fox jumps over the lazy dog"


def expected_text(tokenizer: Tokenizer, prompt_ids: list[int], count: int, offset: int = 0) -> str:
    ids = [prompt_ids[(i + offset) % len(prompt_ids)] for i in range(count)]
    return tokenizer.decode(ids)


async def test_completion_response_fields_and_usage(
    client: httpx.AsyncClient, engine: FakeEngineClient, tokenizer: Tokenizer
) -> None:
    engine.num_cached_tokens = 3
    response = await client.post(
        "/v1/completions",
        json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 5, "temperature": 0},
    )
    assert response.status_code == 200
    body = response.json()
    prompt_ids = tokenizer.encode(PROMPT)
    assert body["id"].startswith("cmpl-")
    assert body["object"] == "text_completion"
    assert isinstance(body["created"], int)
    assert body["model"] == MODEL_NAME
    assert len(body["choices"]) == 1
    choice = body["choices"][0]
    assert choice["index"] == 0
    assert choice["text"] == expected_text(tokenizer, prompt_ids, 5)
    assert choice["finish_reason"] == "length"
    assert choice["logprobs"] is None
    assert body["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": 5,
        "total_tokens": len(prompt_ids) + 5,
        "prompt_tokens_details": {"cached_tokens": 3},
    }
    (sent,) = engine.requests
    assert sent.prompt_token_ids == prompt_ids
    assert sent.sampling_params.max_tokens == 5
    assert sent.sampling_params.is_greedy


async def test_sampling_parameters_reach_the_engine(
    client: httpx.AsyncClient, engine: FakeEngineClient
) -> None:
    response = await client.post(
        "/v1/completions",
        json={
            "prompt": PROMPT,
            "max_tokens": 7,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 40,
            "min_p": 0.05,
            "top_n_sigma": 1.5,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "repetition_penalty": 1.1,
            "seed": 1234,
            "stop": ["\n\n", "END"],
            "stop_token_ids": [7, 9],
            "ignore_eos": True,
            "min_tokens": 2,
            "logit_bias": {"42": -100, "7": 2.5},
            "include_stop_str_in_output": True,
            "skip_special_tokens": False,
            "priority": -3,
            "cache_salt": "tenant-a",
            "user": "someone",
            "an_unknown_field": {"is": "ignored"},
        },
    )
    assert response.status_code == 200, response.text
    (sent,) = engine.requests
    params = sent.sampling_params
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (7, 0.7, 0.9, 40)
    assert (params.min_p, params.presence_penalty, params.frequency_penalty) == (0.05, 0.5, -0.5)
    assert params.top_n_sigma == 1.5
    assert (params.repetition_penalty, params.seed, params.min_tokens) == (1.1, 1234, 2)
    assert params.ignore_eos
    assert params.stop_token_ids == (7, 9)
    assert dict(params.logit_bias) == {42: -100.0, 7: 2.5}
    assert params.logprobs is None
    assert sent.detokenize_params.stop == ("\n\n", "END")
    assert sent.detokenize_params.include_stop_str_in_output
    assert not sent.detokenize_params.skip_special_tokens
    assert (sent.priority, sent.cache_salt) == (-3, "tenant-a")


async def test_n_fans_out_into_sibling_requests(
    client: httpx.AsyncClient, engine: FakeEngineClient, tokenizer: Tokenizer
) -> None:
    response = await client.post(
        "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "n": 3}
    )
    body = response.json()
    prompt_ids = tokenizer.encode(PROMPT)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for i, choice in enumerate(body["choices"]):
        assert choice["text"] == expected_text(tokenizer, prompt_ids, 4, offset=i)
    assert [r.request_id for r in engine.requests] == [f"{body['id']}-{i}" for i in range(3)]
    assert all(r.prompt_token_ids == prompt_ids for r in engine.requests)
    # The shared prompt is billed once; every choice's tokens are billed.
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    assert body["usage"]["completion_tokens"] == 12


async def test_cached_tokens_count_every_sample_of_n(
    client: httpx.AsyncClient, engine: FakeEngineClient
) -> None:
    # The first sample computes the prompt; its two siblings hit the cache.
    engine.num_sibling_cached_tokens = 8
    request = {"prompt": PROMPT, "max_tokens": 2, "n": 3}
    response = await client.post("/v1/completions", json=request)
    assert response.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}
    stream_options = {"include_usage": True}
    streamed = await client.post(
        "/v1/completions", json={**request, "stream": True, "stream_options": stream_options}
    )
    usage = parse_sse(streamed.text)[-2]["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 16}


async def test_batched_prompts_strings_and_token_ids(
    client: httpx.AsyncClient, engine: FakeEngineClient, tokenizer: Tokenizer
) -> None:
    second_ids = tokenizer.encode("Hello there, general")
    response = await client.post(
        "/v1/completions",
        json={"prompt": [PROMPT, "Hello there, general"], "max_tokens": 3, "n": 2},
    )
    assert response.status_code == 200
    texts = [c["text"] for c in response.json()["choices"]]
    first_ids = tokenizer.encode(PROMPT)
    assert texts == [
        expected_text(tokenizer, first_ids, 3, 0),
        expected_text(tokenizer, first_ids, 3, 1),
        expected_text(tokenizer, second_ids, 3, 2),
        expected_text(tokenizer, second_ids, 3, 3),
    ]
    assert response.json()["usage"]["prompt_tokens"] == len(first_ids) + len(second_ids)

    by_ids = await client.post(
        "/v1/completions", json={"prompt": [first_ids, second_ids], "max_tokens": 3}
    )
    assert [r.prompt_token_ids for r in engine.requests[-2:]] == [first_ids, second_ids]
    assert by_ids.json()["choices"][1]["text"] == expected_text(tokenizer, second_ids, 3, 1)

    single = await client.post("/v1/completions", json={"prompt": second_ids, "max_tokens": 2})
    assert single.json()["choices"][0]["text"] == expected_text(tokenizer, second_ids, 2)


async def test_echo_prepends_the_prompt(client: httpx.AsyncClient, tokenizer: Tokenizer) -> None:
    response = await client.post(
        "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "echo": True}
    )
    text = response.json()["choices"][0]["text"]
    assert text == PROMPT + expected_text(tokenizer, tokenizer.encode(PROMPT), 3)


async def test_stop_string_truncates_and_is_reported(
    client: httpx.AsyncClient, tokenizer: Tokenizer
) -> None:
    full = expected_text(tokenizer, tokenizer.encode(PROMPT), 8)
    stop = " fox"
    assert stop in full
    response = await client.post(
        "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "stop": stop}
    )
    choice = response.json()["choices"][0]
    assert choice["text"] == full[: full.index(stop)]
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == stop


async def test_logprobs_in_completions_format(
    client: httpx.AsyncClient, tokenizer: Tokenizer
) -> None:
    response = await client.post(
        "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "logprobs": 3}
    )
    choice = response.json()["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == 4
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert logprobs["token_logprobs"] == [-0.5, -1.0, -1.5, -2.0]
    offsets = [0]
    for token in logprobs["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs["text_offset"] == offsets
    for token, top in zip(logprobs["tokens"], logprobs["top_logprobs"], strict=True):
        assert token in top  # the sampled token is always reported
        assert 1 <= len(top) <= 4
        assert all(isinstance(value, float) for value in top.values())


async def test_stream_chunk_format(client: httpx.AsyncClient, tokenizer: Tokenizer) -> None:
    response = await client.post(
        "/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "stream": True}
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(response.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks, "at least one chunk before [DONE]"
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
    assert len({c["created"] for c in chunks}) == 1
    for chunk in chunks:
        assert chunk["object"] == "text_completion"
        assert chunk["model"] == MODEL_NAME
        assert "usage" not in chunk  # only present when stream_options.include_usage
        (choice,) = chunk["choices"]
        assert choice["index"] == 0
        assert choice["logprobs"] is None
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [
        "length"
    ]
    streamed = "".join(c["choices"][0]["text"] for c in chunks)
    assert streamed == expected_text(tokenizer, tokenizer.encode(PROMPT), 5)


async def test_stream_include_usage_and_fan_out(
    client: httpx.AsyncClient, tokenizer: Tokenizer
) -> None:
    response = await client.post(
        "/v1/completions",
        json={
            "prompt": PROMPT,
            "max_tokens": 3,
            "n": 2,
            "echo": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    chunks = parse_sse(response.text)[:-1]
    *content_chunks, usage_chunk = chunks
    assert all(c["usage"] is None for c in content_chunks)
    assert usage_chunk["choices"] == []
    prompt_ids = tokenizer.encode(PROMPT)
    assert usage_chunk["usage"]["prompt_tokens"] == len(prompt_ids)
    assert usage_chunk["usage"]["completion_tokens"] == 6
    assert usage_chunk["usage"]["total_tokens"] == len(prompt_ids) + 6
    for index in (0, 1):
        mine = [c["choices"][0] for c in content_chunks if c["choices"][0]["index"] == index]
        assert mine[0]["text"].startswith(PROMPT)
        text = "".join(c["text"] for c in mine)
        assert text == PROMPT + expected_text(tokenizer, prompt_ids, 3, offset=index)
        assert [c["finish_reason"] for c in mine].count("length") == 1


async def test_stream_logprobs_offsets_continue_across_chunks(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 4, "logprobs": 0, "stream": True},
    )
    chunks = parse_sse(response.text)[:-1]
    tokens, offsets = [], []
    for chunk in chunks:
        logprobs = chunk["choices"][0]["logprobs"]
        tokens += logprobs["tokens"]
        offsets += logprobs["text_offset"]
    assert len(tokens) == 4
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(4)]


async def test_echo_with_logprobs_scores_the_prompt_in_openai_layout(
    client: httpx.AsyncClient, engine: FakeEngineClient, tokenizer: Tokenizer
) -> None:
    prompt_ids = tokenizer.encode(PROMPT)
    request = {"prompt": PROMPT, "max_tokens": 2, "echo": True, "logprobs": 1}
    response = await client.post("/v1/completions", json=request)
    choice = response.json()["choices"][0]
    logprobs = choice["logprobs"]
    num_prompt = len(prompt_ids)
    assert engine.requests[0].sampling_params.prompt_logprobs == 1
    assert logprobs["tokens"][:num_prompt] == [tokenizer.token_to_text(t) for t in prompt_ids]
    # The first prompt token has nothing before it; prompt token p scores -0.5 * (p + 1).
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    scored = logprobs["token_logprobs"][1:num_prompt]
    assert scored == [-0.5 * (p + 1) for p in range(1, num_prompt)]
    assert logprobs["token_logprobs"][num_prompt:] == [-0.5, -1.0]
    assert len(logprobs["tokens"]) == num_prompt + 2
    assert all(len(top) == 1 for top in logprobs["top_logprobs"][1:])
    assert logprobs["text_offset"][0] == 0
    assert logprobs["text_offset"][num_prompt] == len(PROMPT)
    # As lm-evaluation-harness reads a loglikelihood: the continuation's logprobs.
    continuation = logprobs["token_logprobs"][3:-1]
    assert continuation == [-0.5 * (p + 1) for p in range(3, num_prompt)] + [-0.5]
    streamed = await client.post("/v1/completions", json={**request, "stream": True})
    chunks = parse_sse(streamed.text)[:-1]
    streamed_logprobs = [c["choices"][0]["logprobs"] for c in chunks]
    for key in ("tokens", "token_logprobs", "text_offset", "top_logprobs"):
        assert [item for lp in streamed_logprobs for item in lp[key]] == logprobs[key]


async def test_prompt_logprobs_in_vllm_layout(
    client: httpx.AsyncClient, tokenizer: Tokenizer
) -> None:
    prompt_ids = tokenizer.encode(PROMPT)
    response = await client.post(
        "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 2}
    )
    choice = response.json()["choices"][0]
    assert choice["logprobs"] is None
    prompt_logprobs = choice["prompt_logprobs"]
    assert len(prompt_logprobs) == len(prompt_ids) and prompt_logprobs[0] is None
    for position, entry in enumerate(prompt_logprobs[1:], start=1):
        token = prompt_ids[position]
        # The prompt token first, then the top 2 (the fake's: the token itself, token + 1).
        assert list(entry) == [str(token), str(token + 1)]
        assert entry[str(token)] == {
            "logprob": -0.5 * (position + 1),
            "rank": 1,
            "decoded_token": tokenizer.decode([token]),
        }
        assert entry[str(token + 1)]["rank"] == 2


async def test_return_tokens_as_token_ids_names_tokens_by_id(
    client: httpx.AsyncClient, tokenizer: Tokenizer
) -> None:
    prompt_ids = tokenizer.encode(PROMPT)
    response = await client.post(
        "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 2, "logprobs": 1, "return_tokens_as_token_ids": True},
    )
    logprobs = response.json()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [f"token_id:{prompt_ids[0]}", f"token_id:{prompt_ids[1]}"]
    assert list(logprobs["top_logprobs"][0]) == [f"token_id:{prompt_ids[0]}"]
