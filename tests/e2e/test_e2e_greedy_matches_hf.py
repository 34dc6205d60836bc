"""Greedy tokens through the whole stack equal Hugging Face transformers' greedy tokens.

HTTP → gateway → scheduler → worker → detokenizer → gateway → HTTP, for prompts
of different lengths, one at a time and all concurrently in one batch; and the
public gRPC Generate stream, which returns token ids, for an exact id check.
"""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from kvmesh.protos import generation_pb2, generation_pb2_grpc
from tests.e2e import hf_oracle

pytestmark = pytest.mark.e2e

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.\n",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "clockmaker who had not spoken to anyone for many years. Every morning he opened his shop, "
    "wound every clock on the walls, and sat down at his bench. One day a girl came in and",
    "Q: What is 12 times 12?\nA:",
]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def expected() -> list[tuple[list[int], list[int]]]:
    tok = hf_oracle.tokenizer()
    out = []
    for prompt in PROMPTS:
        ids = tok(prompt)["input_ids"]
        out.append((ids, hf_oracle.greedy(ids, MAX_TOKENS)))
    return out


def _completion_body(prompt_ids: list[int]) -> dict:
    return {
        "prompt": prompt_ids,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }


def test_sequential_http_completions_match_hf(stack, expected) -> None:
    tok = hf_oracle.tokenizer()
    with httpx.Client(base_url=stack.http_url, timeout=120) as client:
        for prompt_ids, hf_tokens in expected:
            r = client.post("/v1/completions", json=_completion_body(prompt_ids))
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["usage"]["completion_tokens"] == MAX_TOKENS
            assert body["usage"]["prompt_tokens"] == len(prompt_ids)
            assert body["choices"][0]["finish_reason"] == "length"
            assert body["choices"][0]["text"] == tok.decode(hf_tokens, skip_special_tokens=True)


async def _grpc_generate(addr: str, prompt_ids: list[int]) -> list[int]:
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = generation_pb2.GenerateRequest(
            token_ids=generation_pb2.TokenIds(ids=prompt_ids),
            sampling=generation_pb2.SamplingParameters(
                max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True
            ),
        )
        tokens: list[int] = []
        last = None
        async for response in stub.Generate(request, timeout=300):
            tokens.extend(response.token_ids)
            last = response
        assert last is not None and last.finish_reason == "length"
        assert last.usage.completion_tokens == MAX_TOKENS
        return tokens


def test_concurrent_grpc_generations_match_hf_token_for_token(stack, expected) -> None:
    async def run_all() -> list[list[int]]:
        return await asyncio.gather(*(_grpc_generate(stack.grpc_addr, ids) for ids, _ in expected))

    results = asyncio.run(run_all())
    for (_, hf_tokens), got in zip(expected, results, strict=True):
        assert got == hf_tokens


def test_concurrent_streaming_http_matches_hf(stack, expected) -> None:
    tok = hf_oracle.tokenizer()

    async def stream_one(client: httpx.AsyncClient, prompt_ids: list[int]) -> tuple[str, dict]:
        body = {
            **_completion_body(prompt_ids),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        text, usage = "", {}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                import json

                chunk = json.loads(line[6:])
                for choice in chunk["choices"]:
                    text += choice["text"]
                if chunk.get("usage"):
                    usage = chunk["usage"]
        return text, usage

    async def run_all():
        async with httpx.AsyncClient(base_url=stack.http_url, timeout=300) as client:
            return await asyncio.gather(*(stream_one(client, ids) for ids, _ in expected))

    for (_, hf_tokens), (text, usage) in zip(expected, asyncio.run(run_all()), strict=True):
        assert text == tok.decode(hf_tokens, skip_special_tokens=True)
        assert usage["completion_tokens"] == MAX_TOKENS
