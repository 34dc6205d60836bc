"""Speculative decoding end to end (`kvmesh up --speculative-config ...`): greedy
outputs equal transformers' on every e2e prompt, one at a time and all at once;
logprobs, stop strings and n > 1 keep working; the drafts are really accepted."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from kvmesh.services.cli.local_stack import LocalStack
from tests.e2e import hf_oracle
from tests.e2e.conftest import start_stack, stop_stack
from tests.e2e.test_e2e_greedy_matches_hf import MAX_TOKENS, PROMPTS, _grpc_generate
from tests.e2e.test_e2e_kv_offload import _metric

pytestmark = pytest.mark.e2e

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}
# Asked to copy a text, the model drafts itself most of its answer.
REPEAT_PROMPT = (
    "<|im_start|>user\nRepeat the following text word for word.\nText: The committee met on "
    "Tuesday to discuss the budget for the new library. After a long debate, they agreed to "
    "fund the project in two phases.<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def spec_stack() -> LocalStack:
    stack = start_stack(
        [
            "--speculative-config",
            json.dumps(NGRAM),
            "--num-kv-blocks",
            "512",
            "--max-model-len",
            "2048",
        ]
    )
    yield stack
    assert stop_stack(stack) == 0, "".join(stack.log[-50:])


@pytest.fixture(scope="module")
def cases() -> list[tuple[list[int], list[int]]]:
    tok = hf_oracle.tokenizer()
    prompts = [tok(p)["input_ids"] for p in [*PROMPTS, REPEAT_PROMPT]]
    return [(ids, hf_oracle.greedy(ids, MAX_TOKENS)) for ids in prompts]


def test_greedy_equals_transformers_one_at_a_time_and_together(spec_stack, cases) -> None:
    for prompt_ids, hf_tokens in cases:
        assert asyncio.run(_grpc_generate(spec_stack.grpc_addr, prompt_ids)) == hf_tokens

    async def together() -> list[list[int]]:
        return await asyncio.gather(
            *(_grpc_generate(spec_stack.grpc_addr, ids) for ids, _ in cases)
        )

    assert asyncio.run(together()) == [hf for _, hf in cases]
    accepted = _metric(spec_stack, "scheduler", "vllm:spec_decode_num_accepted_tokens_total")
    drafts = _metric(spec_stack, "scheduler", "vllm:spec_decode_num_drafts_total")
    assert drafts > 0 and accepted > 0
    assert (
        _metric(spec_stack, "scheduler", "vllm:spec_decode_num_accepted_tokens_per_pos_total")
        == accepted
    )


def _complete(stack: LocalStack, **body: object) -> dict:
    r = httpx.post(stack.http_url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_logprobs_cover_every_token_of_a_drafted_answer(spec_stack, cases) -> None:
    prompt_ids, hf_tokens = cases[-1]
    body = _complete(
        spec_stack,
        prompt=prompt_ids,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=2,
        ignore_eos=True,
    )
    choice = body["choices"][0]
    assert choice["text"] == hf_oracle.tokenizer().decode(hf_tokens, skip_special_tokens=True)
    logprobs = choice["logprobs"]
    assert len(logprobs["token_logprobs"]) == MAX_TOKENS == len(logprobs["tokens"])
    assert all(lp <= 0 for lp in logprobs["token_logprobs"])
    assert all(len(top) == 2 for top in logprobs["top_logprobs"])


def test_stop_string_inside_a_drafted_run(spec_stack, cases) -> None:
    prompt_ids, hf_tokens = cases[-1]
    free_text = hf_oracle.tokenizer().decode(hf_tokens, skip_special_tokens=True)
    stop = "library"  # in the copied text, reached through accepted drafts
    assert stop in free_text
    body = _complete(
        spec_stack, prompt=prompt_ids, max_tokens=MAX_TOKENS, temperature=0, stop=[stop]
    )
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == free_text[: free_text.index(stop)]


def test_n_greater_than_one_greedy_and_sampled(spec_stack, cases) -> None:
    prompt_ids, hf_tokens = cases[-1]
    text = hf_oracle.tokenizer().decode(hf_tokens, skip_special_tokens=True)
    body = _complete(
        spec_stack, prompt=prompt_ids, max_tokens=MAX_TOKENS, temperature=0, n=2, ignore_eos=True
    )
    assert [c["text"] for c in body["choices"]] == [text, text]
    body = _complete(
        spec_stack, prompt=prompt_ids, max_tokens=MAX_TOKENS, temperature=0.8, n=2, ignore_eos=True
    )
    assert len(body["choices"]) == 2
    assert body["usage"]["completion_tokens"] == 2 * MAX_TOKENS
