"""vLLM's request parameters beyond OpenAI's: how each reaches the engine or shapes the prompt."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from kvmesh.gateway.tokenizer import Tokenizer
from kvmesh.services.contracts.step_codec import (
    sampling_params_from_proto,
    sampling_params_to_proto,
)
from kvmesh.services.runtime.model_prep import default_model_path
from kvmesh.worker.sampling_metadata import validate_sampling_params
from tests.gateway.fakes import FakeEngineClient
from tests.gateway.helpers import MAX_MODEL_LEN

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
PROMPT = "The quick brown fox jumps over the lazy dog"


async def test_allowed_token_ids_and_bad_words_reach_the_engine(
    client: httpx.AsyncClient, engine: FakeEngineClient, tokenizer: Tokenizer
) -> None:
    body = {
        "prompt": PROMPT,
        "max_tokens": 2,
        "allowed_token_ids": [5, 17, 900],
        "bad_words": ["fox", " lazy dog"],
    }
    assert (await client.post(COMPLETIONS, json=body)).status_code == 200
    params = engine.requests[0].sampling_params
    assert params.allowed_token_ids == (5, 17, 900)

    def encode(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special_tokens=False))

    # Each word as it reads at the start of a text and after a space (vLLM's rule:
    # the spaced form only when it is a different token sequence of the same length).
    expected = [encode("fox")]
    if encode(" fox")[0] != encode("fox")[0] and len(encode(" fox")) == len(encode("fox")):
        expected.append(encode(" fox"))
    expected.append(encode("lazy dog"))
    if len(encode(" lazy dog")) == len(encode("lazy dog")):
        expected.append(encode(" lazy dog"))
    assert list(params.bad_words_token_ids) == expected
    assert encode(" fox") in params.bad_words_token_ids


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [10**9]}, "allowed_token_ids"),
        ({"bad_words": ["  "]}, "bad_words.0"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": MAX_MODEL_LEN + 1}, "truncate_prompt_tokens"),
    ],
)
async def test_invalid_vllm_parameters_are_400(
    client: httpx.AsyncClient, fields: dict[str, Any], param: str
) -> None:
    response = await client.post(COMPLETIONS, json={"prompt": PROMPT, **fields})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


async def test_truncate_prompt_tokens_keeps_the_last_tokens(
    client: httpx.AsyncClient, engine: FakeEngineClient, tokenizer: Tokenizer
) -> None:
    prompt_ids = tokenizer.encode(PROMPT)
    body = {"prompt": PROMPT, "max_tokens": 1, "truncate_prompt_tokens": 3, "echo": True}
    response = (await client.post(COMPLETIONS, json=body)).json()
    assert engine.requests[0].prompt_token_ids == prompt_ids[-3:]
    assert response["usage"]["prompt_tokens"] == 3
    assert response["choices"][0]["text"].startswith(tokenizer.decode(prompt_ids[-3:]))
    # -1 means max_model_len: a prompt that fits is untouched.
    await client.post(COMPLETIONS, json={**body, "truncate_prompt_tokens": -1})
    assert engine.requests[1].prompt_token_ids == prompt_ids


async def test_continue_final_message_leaves_the_last_message_open(
    client: httpx.AsyncClient, engine: FakeEngineClient
) -> None:
    messages = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "My favourite colour is"},
    ]
    body = {
        "messages": messages,
        "max_tokens": 2,
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    assert (await client.post(CHAT, json=body)).status_code == 200
    hf = AutoTokenizer.from_pretrained(str(default_model_path()))
    text = hf.apply_chat_template(messages, continue_final_message=True, tokenize=False)
    assert text.endswith("My favourite colour is")
    assert engine.requests[0].prompt_token_ids == hf.encode(text, add_special_tokens=False)
    both = await client.post(CHAT, json={**body, "add_generation_prompt": True})
    assert both.status_code == 400
    assert both.json()["error"]["param"] == "continue_final_message"


async def test_positive_parameters_stay_positive_as_float32(
    client: httpx.AsyncClient, engine: FakeEngineClient
) -> None:
    """5e-324 is a valid top_p ("> 0") but 0.0 as a float32: the worker refused it
    mid-request with a 503 (schemathesis against a real stack, issue 43)."""
    body = {"prompt": PROMPT, "max_tokens": 1, "top_p": 5e-324, "repetition_penalty": 5e-324}
    assert (await client.post(COMPLETIONS, json=body)).status_code == 200
    on_the_wire = sampling_params_from_proto(
        sampling_params_to_proto(engine.requests[0].sampling_params)
    )
    validate_sampling_params(on_the_wire, vocab_size=49152)  # what the worker checks
    assert 0 < on_the_wire.top_p < 1e-37 and 0 < on_the_wire.repetition_penalty < 1e-37
