"""Multi-LoRA end to end (`kvmesh up --enable-lora`): adapters made here with PEFT on
the default model; through the gateway each one's greedy output equals transformers +
PEFT in float32, alone and mixed in one batch with the base model, prefix caching
never hands one adapter's KV to another, and adapters load and unload while serving."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path

import httpx
import pytest

from kvmesh.services.cli.local_stack import LocalStack
from kvmesh.services.runtime.model_prep import default_model_path
from tests.e2e import hf_oracle
from tests.e2e.conftest import start_stack, stop_stack
from tests.e2e.test_e2e_greedy_matches_hf import PROMPTS
from tests.lora_adapters import make_lora_adapter

pytestmark = pytest.mark.e2e

MAX_TOKENS = 16
ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# name -> (rank, alpha, target modules); "late" is loaded through the API while serving.
ADAPTERS = {
    "all16": (16, 32.0, ALL_MODULES),
    "attn8": (8, 16.0, ("q_proj", "k_proj", "v_proj", "o_proj")),
    "mlp4": (4, 8.0, ("gate_proj", "up_proj", "down_proj")),
    "late": (16, 16.0, ("q_proj", "v_proj", "down_proj")),
}
# A prompt of several full blocks, so that a prefix-cache hit would matter.
LONG_PROMPT = PROMPTS[3] * 2


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory: pytest.TempPathFactory):
    """(adapter folders, prompts as ids, expected tokens by model name then prompt).

    The last prompt is the long one only the prefix-cache test sends first.
    """
    root = tmp_path_factory.mktemp("adapters")
    tok = hf_oracle.tokenizer()
    prompts = [tok(p)["input_ids"] for p in [*PROMPTS[:3], LONG_PROMPT]]
    expected = {None: [hf_oracle.greedy(p, MAX_TOKENS) for p in prompts]}
    folders: dict[str, Path] = {}
    for seed, (name, (rank, alpha, targets)) in enumerate(ADAPTERS.items()):
        folders[name] = root / name
        model = make_lora_adapter(
            default_model_path(),
            folders[name],
            rank=rank,
            alpha=alpha,
            target_modules=targets,
            seed=seed,
            scale=0.02,
        )
        expected[name] = [hf_oracle.greedy(p, MAX_TOKENS, model=model) for p in prompts]
        del model
        gc.collect()
    return folders, prompts, expected


def _lora_stack_args(folders: dict[str, Path], names: list[str]) -> list[str]:
    """``kvmesh up`` flags serving ``names`` with a slot for each."""
    return [
        "--enable-lora",
        "--lora-modules",
        *(f"{name}={folders[name]}" for name in names),
        "--max-loras",
        str(len(names)),
        "--max-lora-rank",
        "16",
        "--num-kv-blocks",
        "256",
        "--max-model-len",
        "1024",
    ]


@pytest.fixture(scope="module")
def lora_stack(lora_setup) -> LocalStack:
    folders, _, _ = lora_setup
    stack = start_stack(_lora_stack_args(folders, ["all16", "attn8", "mlp4"]))
    yield stack
    assert stop_stack(stack) == 0, "".join(stack.log[-50:])


async def _complete(client: httpx.AsyncClient, model: str, prompt: list[int]) -> dict:
    response = await client.post(
        "/v1/completions",
        json={
            "model": model,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        },
    )
    assert response.status_code == 200, response.text
    return response.json()


def _token_ids(body: dict) -> list[int]:
    # return_tokens_as_token_ids: each token reads "token_id:<id>".
    return [int(t.split(":")[1]) for t in body["choices"][0]["logprobs"]["tokens"]]


def _model_name(stack: LocalStack) -> str:
    return httpx.get(f"{stack.http_url}/v1/models", timeout=10).json()["data"][0]["id"]


def _assert_mixed_batch_equals_peft(stack: LocalStack, lora_setup, names: list[str | None]) -> None:
    """Every prompt (but the long one) under each of ``names`` (None: the base
    model), all at once, equals transformers + PEFT's greedy tokens."""
    _, prompts, expected = lora_setup
    prompts = prompts[:-1]
    base_name = _model_name(stack)
    for name in names:
        if name is not None:
            assert expected[name] != expected[None], f"adapter {name} does not change the output"

    async def run() -> list[list[int]]:
        async with httpx.AsyncClient(base_url=stack.http_url, timeout=300) as client:
            bodies = await asyncio.gather(
                *(_complete(client, name or base_name, p) for name in names for p in prompts)
            )
        return [_token_ids(body) for body in bodies]

    got = iter(asyncio.run(run()))
    for name in names:
        for index in range(len(prompts)):
            assert next(got) == expected[name][index], (name, index)


def test_every_adapter_and_the_base_mixed_in_one_batch_equal_peft(lora_stack, lora_setup) -> None:
    _assert_mixed_batch_equals_peft(lora_stack, lora_setup, [None, "all16", "attn8", "mlp4"])


def test_prefix_cache_is_never_shared_across_adapters(lora_stack, lora_setup) -> None:
    _, prompts, expected = lora_setup
    long_prompt, index = prompts[-1], len(prompts) - 1
    base_name = _model_name(lora_stack)

    async def run() -> list[dict]:
        async with httpx.AsyncClient(base_url=lora_stack.http_url, timeout=300) as client:
            # One after another: each request finds the previous ones' blocks cached.
            return [
                await _complete(client, name, long_prompt)
                for name in (base_name, "all16", "attn8", "all16", base_name)
            ]

    bodies = asyncio.run(run())
    outputs = [_token_ids(body) for body in bodies]
    assert outputs == [
        expected[None][index],
        expected["all16"][index],
        expected["attn8"][index],
        expected["all16"][index],
        expected[None][index],
    ]
    cached = [
        (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        for body in bodies
    ]
    # The repeats hit their own blocks; each first use of an adapter (and the
    # base model's, first of all) hits nothing though the same prompt is cached.
    assert cached[:3] == [0, 0, 0]
    assert cached[3] > 0 and cached[4] > 0


def test_load_and_unload_while_serving(lora_stack, lora_setup) -> None:
    folders, prompts, expected = lora_setup
    base_name = _model_name(lora_stack)

    async def run() -> None:
        async with httpx.AsyncClient(base_url=lora_stack.http_url, timeout=300) as client:
            # Base-model traffic keeps flowing while the adapter set changes.
            background = asyncio.gather(*(_complete(client, base_name, p) for p in prompts))
            assert (
                await client.post("/v1/completions", json={"model": "late", "prompt": "x"})
            ).status_code == 404
            body = {"lora_name": "late", "lora_path": str(folders["late"])}
            loaded = await client.post("/v1/load_lora_adapter", json=body)
            assert loaded.status_code == 200, loaded.text
            late = await asyncio.gather(*(_complete(client, "late", p) for p in prompts))
            assert [_token_ids(b) for b in late] == expected["late"]
            ids = [c["id"] for c in (await client.get("/v1/models")).json()["data"]]
            assert "late" in ids
            unloaded = await client.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
            assert unloaded.status_code == 200
            gone = await client.post("/v1/completions", json={"model": "late", "prompt": "x"})
            assert gone.status_code == 404
            assert [_token_ids(b) for b in await background] == expected[None]

    asyncio.run(run())


@pytest.fixture(scope="module")
def tensor_parallel_lora_stack(lora_setup) -> LocalStack:
    """Two worker ranks (TP=2: 2 + 1 of the 3 KV heads), each applying its cut of
    every adapter (worker/lora/adapter.py, ``shard_adapter``)."""
    folders, _, _ = lora_setup
    stack = start_stack(
        ["--tensor-parallel-size", "2", *_lora_stack_args(folders, ["all16", "mlp4"])]
    )
    yield stack
    assert stop_stack(stack) == 0, "".join(stack.log[-50:])


def test_tensor_parallel_adapters_equal_peft(tensor_parallel_lora_stack, lora_setup) -> None:
    _assert_mixed_batch_equals_peft(tensor_parallel_lora_stack, lora_setup, [None, "all16", "mlp4"])
