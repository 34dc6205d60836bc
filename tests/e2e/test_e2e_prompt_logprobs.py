"""Prompt logprobs and vLLM's token masks through the whole stack, against transformers."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e import hf_oracle

pytestmark = pytest.mark.e2e

# ~70 tokens: more than one KV block, so a repeat is a prefix-cache hit.
PROMPT = (
    "The lighthouse keeper climbed the spiral stairs every evening, counting the steps "
    "as his father had taught him, and when he reached the lamp room he wiped the glass, "
    "trimmed the wick and watched the ships pass far out on the grey water."
)
NUM_TOP = 2


def _prompt_logprobs(client: httpx.Client, prompt_ids: list[int]) -> list:
    body = {"prompt": prompt_ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": NUM_TOP}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["prompt_logprobs"]


def test_prompt_logprobs_match_hf_also_when_the_prompt_is_cached(stack) -> None:
    prompt_ids = hf_oracle.tokenizer()(PROMPT)["input_ids"]
    expected = hf_oracle.prompt_logprobs(prompt_ids)
    with httpx.Client(base_url=stack.http_url, timeout=120) as client:
        # Put the prompt's blocks in the prefix cache first.
        warm = {"prompt": prompt_ids, "max_tokens": 1, "temperature": 0}
        assert client.post("/v1/completions", json=warm).status_code == 200
        first = _prompt_logprobs(client, prompt_ids)
        second = _prompt_logprobs(client, prompt_ids)
    assert len(first) == len(prompt_ids) and first[0] is None
    for position, entry in enumerate(first[1:], start=1):
        row = expected[position - 1]
        token = prompt_ids[position]
        assert entry[str(token)]["logprob"] == pytest.approx(float(row[token]), abs=1e-4)
        assert entry[str(token)]["rank"] == int((row > row[token]).sum()) + 1
        top = row.topk(NUM_TOP)
        for rank, (top_id, value) in enumerate(zip(top.indices, top.values, strict=True), 1):
            if str(int(top_id)) != str(token):
                assert entry[str(int(top_id))]["rank"] == rank
                assert entry[str(int(top_id))]["logprob"] == pytest.approx(float(value), abs=1e-4)
    for a, b in zip(first[1:], second[1:], strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key]["logprob"] == pytest.approx(b[key]["logprob"], abs=1e-5)


def test_allowed_token_ids_restrict_greedy_decoding_to_their_argmax(stack) -> None:
    tok = hf_oracle.tokenizer()
    prompt_ids = tok("The colour of the sky is")["input_ids"]
    allowed = [int(t) for t in tok(" red green blue yellow", add_special_tokens=False)["input_ids"]]
    # The last row scores the token after the prompt, whatever that token is.
    next_row = hf_oracle.prompt_logprobs([*prompt_ids, allowed[0]])[-1]
    expected = max(allowed, key=lambda t: float(next_row[t]))
    assert expected != int(next_row.argmax())  # the mask changes the answer
    body = {
        "prompt": prompt_ids,
        "max_tokens": 1,
        "temperature": 0,
        "allowed_token_ids": allowed,
        "logprobs": 0,
    }
    with httpx.Client(base_url=stack.http_url, timeout=120) as client:
        response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["text"] == tok.decode([expected])
    # Reported logprobs stay raw (before the mask), as vLLM's.
    assert choice["logprobs"]["token_logprobs"][0] == pytest.approx(
        float(next_row[expected]), abs=1e-4
    )
