"""kvmesh.Client / kvmesh.AsyncClient against a started stack: the public gRPC
stream without protobuf, greedy tokens equal to transformers'."""

from __future__ import annotations

import pytest

import kvmesh
from tests.e2e import hf_oracle

pytestmark = pytest.mark.e2e

PROMPT = "The three primary colors are"
GREEDY = kvmesh.SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def test_generate_and_stream_equal_transformers(stack) -> None:
    ids = hf_oracle.tokenizer()(PROMPT)["input_ids"]
    expected = hf_oracle.greedy(ids, 10)
    with kvmesh.Client(stack.grpc_addr, timeout=120) as client:
        out = client.generate(PROMPT, GREEDY, request_id="python-client-1")
        chunks = list(client.stream(ids, GREEDY))
        assert client.tokenize(PROMPT) == ids
        info = client.model_info()
    (sample,) = out.outputs
    assert out.request_id == "python-client-1" and out.prompt == PROMPT
    assert sample.token_ids == expected
    assert sample.text == hf_oracle.tokenizer().decode(expected, skip_special_tokens=True)
    assert sample.finish_reason == "length"
    # Streamed from token ids: the same tokens, chunk by chunk, usage on the last.
    assert [t for c in chunks for t in c.token_ids] == expected
    assert "".join(c.text for c in chunks) == sample.text
    assert chunks[-1].finish_reason == "length"
    assert (chunks[-1].prompt_tokens, chunks[-1].completion_tokens) == (len(ids), 10)
    assert info.max_model_len > 0 and info.vocab_size > 0 and info.eos_token_ids


def test_stop_string_and_samples(stack) -> None:
    with kvmesh.Client(stack.grpc_addr, timeout=120) as client:
        full = client.generate(PROMPT, GREEDY).outputs[0].text
        stop = full[len(full) // 2 : len(full) // 2 + 2]
        stopped = client.generate(
            PROMPT, kvmesh.SamplingParams(temperature=0.0, max_tokens=10, stop=stop)
        ).outputs[0]
        samples = client.generate(
            PROMPT, kvmesh.SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=4)
        )
    assert stopped.text == full[: full.index(stop)]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", stop)
    assert [s.index for s in samples.outputs] == [0, 1]
    assert all(s.finished for s in samples.outputs)


def test_bad_input_is_a_client_error(stack) -> None:
    with kvmesh.Client(stack.grpc_addr, timeout=120) as client:
        too_long = [1] * (client.model_info().max_model_len + 1)
        with pytest.raises(kvmesh.ClientError) as info:
            client.generate(too_long, kvmesh.SamplingParams(max_tokens=4))
    assert info.value.code == "INVALID_ARGUMENT"
    assert "context length" in info.value.details


async def test_async_client_streams_the_same_tokens(stack) -> None:
    ids = hf_oracle.tokenizer()(PROMPT)["input_ids"]
    async with kvmesh.AsyncClient(stack.grpc_addr, timeout=120) as client:
        out = await client.generate(PROMPT, GREEDY)
        streamed = [c async for c in client.stream(PROMPT, GREEDY)]
        assert await client.tokenize(PROMPT) == ids
    assert out.outputs[0].token_ids == hf_oracle.greedy(ids, 10)
    assert [t for c in streamed for t in c.token_ids] == out.outputs[0].token_ids


def test_chat_is_rendered_by_the_server_with_the_models_template(stack) -> None:
    messages = [{"role": "user", "content": "What is 2+2?"}]
    tokenizer = hf_oracle.tokenizer()
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    expected = hf_oracle.greedy(ids, 8, stop_at_eos=True)
    params = kvmesh.SamplingParams(temperature=0.0, max_tokens=8)
    with kvmesh.Client(stack.grpc_addr, timeout=120) as client:
        reply = client.chat(messages, params)
        streamed = [t for c in client.stream(messages, params) for t in c.token_ids]
    assert reply.outputs[0].token_ids == expected
    assert streamed == expected
