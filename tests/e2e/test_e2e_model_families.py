"""Families other than Llama through the whole stack (gateway, scheduler,
worker, detokenizer): greedy completions equal transformers float32 with
prefix caching on, a KV pool small enough to preempt, and TP=2.

The tiny random checkpoints reuse the default model's tokenizer (their vocab
is its 49,152 tokens), so prompts and completions are text as for any model.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import httpx
import pytest
import torch

from kvmesh.services.cli.local_stack import LocalStack
from kvmesh.services.runtime.model_prep import default_model_path, is_prepared
from tests.e2e.conftest import STARTUP_TIMEOUT_S, stop_stack
from tests.worker.conftest import hf_greedy_tokens
from tests.worker.model_families import make_family_checkpoint

pytestmark = pytest.mark.e2e

MAX_TOKENS = 24
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _checkpoint(folder: Path, architecture: str, **overrides: object) -> torch.nn.Module:
    source = default_model_path()
    if not is_prepared(source):
        pytest.skip("default model not prepared (run `make install`)")
    vocab = 49_152  # the default model's tokenizer
    model = make_family_checkpoint(folder, architecture, vocab_size=vocab, **overrides)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)
    return model


def _prompts() -> list[list[int]]:
    """Eight prompts in pairs sharing a 48-token prefix (prefix-cache hits)."""
    prefixes = [[(97 * i + 13 * j) % 40_000 + 100 for j in range(48)] for i in range(4)]
    return [[*p, 1_000 + k, 2_000 + k] for p in prefixes for k in range(2)]


def _scheduler_metric(stack: LocalStack, name: str) -> float:
    text = httpx.get(stack.metrics_url("scheduler"), timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


@pytest.mark.parametrize(
    ("architecture", "tp", "overrides"),
    [
        ("Qwen3MoeForCausalLM", 1, {}),
        ("Gemma3ForCausalLM", 2, {}),
        # A 16-token window under 50-token prompts and 24 more tokens: every
        # layer's attention is windowed, in prefill chunks and decodes alike.
        ("MistralForCausalLM", 1, {"sliding_window": 16}),
    ],
    ids=["Qwen3MoeForCausalLM-tp1", "Gemma3ForCausalLM-tp2", "Mistral-window16-tp1"],
)
def test_family_through_the_stack_equals_transformers(
    tmp_path: Path, architecture: str, tp: int, overrides: dict
) -> None:
    hf_model = _checkpoint(tmp_path, architecture, **overrides)
    prompts = _prompts()
    expected = [
        hf_greedy_tokens(hf_model, p, MAX_TOKENS, min_new_tokens=MAX_TOKENS) for p in prompts
    ]
    assert all(len(set(tokens)) > 1 for tokens in expected)
    # 14 blocks of 16 tokens; eight requests at once of up to 74 tokens (5 blocks
    # each): decodes run out and preempt. Chunks of 32 tokens split every prompt.
    # A windowed model holds window-sized KV (2-4 blocks a request, blocks that left
    # the window go back to the pool), so it gets a smaller pool to preempt in.
    windowed = "sliding_window" in overrides
    args = [
        "--dtype",
        "float32",
        "--num-kv-blocks",
        "8" if windowed else "28",
        "--max-model-len",
        "256",
        "--max-num-batched-tokens",
        "32",
        "--tensor-parallel-size",
        str(tp),
    ]
    stack = LocalStack(args, model=tmp_path)
    try:
        stack.wait_ready(STARTUP_TIMEOUT_S)

        async def one(client: httpx.AsyncClient, ids: list[int]) -> list[int]:
            r = await client.post(
                "/v1/completions",
                json={
                    "prompt": ids,
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0,
                    "ignore_eos": True,
                    "logprobs": 0,
                    "return_tokens_as_token_ids": True,
                },
            )
            assert r.status_code == 200, r.text
            tokens = r.json()["choices"][0]["logprobs"]["tokens"]
            return [int(t.removeprefix("token_id:")) for t in tokens]

        async def run_all() -> list[list[int]]:
            async with httpx.AsyncClient(base_url=stack.http_url, timeout=600) as client:
                return list(await asyncio.gather(*(one(client, p) for p in prompts)))

        got = asyncio.run(run_all())
        assert got == expected

        # The pairs above hit only where the second of a pair is scheduled after
        # the first's prefix is computed, which hangs on arrival order under load;
        # the last prompt again, its blocks freed and cached, always hits.
        async def run_again() -> list[int]:
            async with httpx.AsyncClient(base_url=stack.http_url, timeout=600) as client:
                return await one(client, prompts[-1])

        assert asyncio.run(run_again()) == expected[-1]
        assert _scheduler_metric(stack, "vllm:prefix_cache_hits_total") > 0
        assert _scheduler_metric(stack, "vllm:num_preemptions_total") > 0
    finally:
        assert stop_stack(stack) == 0, "".join(stack.log[-50:])
