"""The rest of the OpenAI parameters and endpoints through the official openai client."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from tests.e2e import hf_oracle

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", timeout=120)


def _greedy_text(client: openai.OpenAI, prompt: str, n: int) -> str:
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0)
    return out.choices[0].text


def test_models_lists_the_served_model_with_its_length(client) -> None:
    (model,) = client.models.list().data
    assert model.id == MODEL
    assert model.model_extra["max_model_len"] == 2048


def test_truncation_parameters_reduce_to_greedy(client) -> None:
    """top_p near 0, min_p = 1 and a tiny top_n_sigma keep only the most likely token:
    the output is greedy."""
    prompt = "The largest planet in the solar system is"
    greedy = _greedy_text(client, prompt, 8)
    for extra in ({"top_p": 1e-6}, {"min_p": 1.0}, {"top_n_sigma": 1e-6}):
        top_p = extra.pop("top_p", None)
        out = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=8,
            temperature=1.5,
            seed=3,
            **({"top_p": top_p} if top_p is not None else {}),
            extra_body=extra,
        )
        assert out.choices[0].text == greedy


def test_repetition_penalty_matches_transformers(client) -> None:
    prompt = "one two one two one two one two"
    ids = hf_oracle.tokenizer()(prompt, return_tensors="pt")["input_ids"]
    model, tok = hf_oracle._model_and_tokenizer()
    with torch.inference_mode():
        hf = model.generate(
            ids, max_new_tokens=12, do_sample=False, repetition_penalty=1.5, min_new_tokens=12
        )
    expected = tok.decode(hf[0, ids.shape[1] :], skip_special_tokens=True)
    out = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        extra_body={"repetition_penalty": 1.5, "ignore_eos": True},
    )
    assert out.choices[0].text == expected


def test_presence_and_frequency_penalties_break_repetition(client) -> None:
    prompt = "one two one two one two one two"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    penalized = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=16,
        temperature=0,
        presence_penalty=2.0,
        frequency_penalty=2.0,
    )
    plain_words = plain.choices[0].text.split()
    penalized_words = penalized.choices[0].text.split()
    # Unpenalized, the model keeps repeating; penalized, it uses more distinct words.
    assert len(set(penalized_words)) > len(set(plain_words))


def test_stop_string_kept_on_request(client) -> None:
    prompt = "Count: one, two, three, four, five,"
    text = _greedy_text(client, prompt, 16)
    stop = text.strip().split()[1]
    out = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=16,
        temperature=0,
        stop=[stop],
        extra_body={"include_stop_str_in_output": True},
    )
    assert out.choices[0].text == text[: text.index(stop) + len(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_chat_max_completion_tokens_and_special_tokens(client) -> None:
    messages = [{"role": "user", "content": "Say hello."}]
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=5, temperature=0
    )
    assert out.usage.completion_tokens == 5
    assert out.choices[0].finish_reason == "length"
    # A prompt of special tokens: kept in the text only when asked.
    im_start = hf_oracle.tokenizer().convert_tokens_to_ids("<|im_start|>")
    kept = client.completions.create(
        model=MODEL,
        prompt=[1, 2, 3],
        max_tokens=4,
        temperature=0,
        logit_bias={str(im_start): 100},
        extra_body={"skip_special_tokens": False},
    )
    skipped = client.completions.create(
        model=MODEL,
        prompt=[1, 2, 3],
        max_tokens=4,
        temperature=0,
        logit_bias={str(im_start): 100},
    )
    assert kept.choices[0].text == "<|im_start|>" * 4
    assert skipped.choices[0].text == ""


def test_tokenize_detokenize_and_version(stack) -> None:
    text = "Hello, kvmesh!"
    tokens = httpx.post(stack.http_url + "/tokenize", json={"prompt": text}, timeout=30).json()
    assert tokens["tokens"] == hf_oracle.tokenizer()(text)["input_ids"]
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 2048
    back = httpx.post(
        stack.http_url + "/detokenize", json={"tokens": tokens["tokens"]}, timeout=30
    ).json()
    assert back["prompt"] == text
    version = httpx.get(stack.http_url + "/version", timeout=30).json()
    assert version["version"]
