"""Sampling parameters through the official openai client, checked against the model itself."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
import torch

from tests.e2e import hf_oracle

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
BLOCK_SIZE = 16  # the stack's default


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", timeout=120)


def _tokenize(stack, text: str) -> list[int]:
    response = httpx.post(stack.http_url + "/tokenize", json={"prompt": text}, timeout=30)
    return response.json()["tokens"]


def test_logprobs_match_transformers_log_softmax(stack, client) -> None:
    prompt = "The three primary colours are"
    out = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=5
    )
    choice = out.choices[0]
    prompt_ids = _tokenize(stack, prompt)
    model, tokenizer = hf_oracle._model_and_tokenizer()
    generated = hf_oracle.greedy(prompt_ids, 8)
    assert choice.text == tokenizer.decode(generated)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids + generated])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)[len(prompt_ids) - 1 : -1]
    logprobs = choice.logprobs
    assert len(logprobs.token_logprobs) == 8
    for step, (logprob, top) in enumerate(
        zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True)
    ):
        assert abs(logprob - expected[step, generated[step]].item()) < 1e-3
        values, ids = expected[step].topk(5)
        assert len(top) == 5
        for token_id, value in zip(ids.tolist(), values.tolist(), strict=True):
            token = tokenizer.decode([token_id])
            assert abs(top[token] - value) < 1e-3, (step, token)


def test_seeded_sampling_is_the_same_alone_and_in_a_crowd(stack) -> None:
    async def run() -> tuple[str, str]:
        async with openai.AsyncOpenAI(
            base_url=stack.http_url + "/v1", api_key="unused", timeout=120
        ) as aclient:

            def seeded():
                return aclient.completions.create(
                    model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=1.0, seed=42
                )

            alone = (await seeded()).choices[0].text
            crowd = [
                aclient.completions.create(
                    model=MODEL, prompt=f"Story {i}:", max_tokens=16, temperature=1.0
                )
                for i in range(3)
            ]
            results = await asyncio.gather(*crowd, seeded())
            return alone, results[-1].choices[0].text

    alone, in_crowd = asyncio.run(run())
    assert alone == in_crowd and alone


def _metric(stack, name: str) -> float:
    text = httpx.get(stack.metrics_url("scheduler"), timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def test_n_samples_share_the_prompt_kv(stack, client) -> None:
    # A prompt no earlier test sent, so only the siblings can hit the cache.
    prompt = "Write a short poem about an orange cat named Biscuit who sleeps " * 3
    num_prompt = len(_tokenize(stack, prompt))
    assert num_prompt > 2 * BLOCK_SIZE
    before = _metric(stack, "vllm:prefix_cache_hits_total")
    out = client.completions.create(model=MODEL, prompt=prompt, n=3, max_tokens=4, seed=1)
    assert len(out.choices) == 3
    expected = 2 * ((num_prompt - 1) // BLOCK_SIZE) * BLOCK_SIZE
    deadline = time.monotonic() + 5
    while _metric(stack, "vllm:prefix_cache_hits_total") - before < expected:
        assert time.monotonic() < deadline, "siblings did not reuse the prompt blocks"
        time.sleep(0.1)
    assert _metric(stack, "vllm:prefix_cache_hits_total") - before == expected


def test_token_level_parameters_do_what_they_say(stack, client) -> None:
    the = _tokenize(stack, " the")[0]
    biased = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logit_bias={str(the): 100}
    )
    assert biased.choices[0].text == " the" * 4
    # min_tokens masks the stop token for 3 tokens; then it is sampled and stops.
    stopped = client.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=8,
        temperature=0,
        logit_bias={str(the): 100},
        extra_body={"stop_token_ids": [the], "min_tokens": 3},
    )
    assert stopped.usage.completion_tokens == 4
    assert not stopped.choices[0].text.startswith(" the")
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].model_extra["stop_reason"] == the
    greedy = client.completions.create(model=MODEL, prompt="Paris is", max_tokens=6, temperature=0)
    top_k_1 = client.completions.create(
        model=MODEL, prompt="Paris is", max_tokens=6, temperature=1.5, extra_body={"top_k": 1}
    )
    assert top_k_1.choices[0].text == greedy.choices[0].text
    stream = client.completions.create(
        model=MODEL,
        prompt="Paris is",
        max_tokens=6,
        temperature=0,
        echo=True,
        stream=True,
        stream_options={"include_usage": True},
        user="e2e",
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == "Paris is" + greedy.choices[0].text
    assert chunks[-1].usage.completion_tokens == greedy.usage.completion_tokens
