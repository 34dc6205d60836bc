"""The public gRPC API accepts the same parameters as the HTTP API."""

from __future__ import annotations

import json

import grpc
import pytest

from kvmesh.protos import generation_pb2, generation_pb2_grpc
from tests.e2e import hf_oracle

pytestmark = pytest.mark.e2e


def _generate(stack, **sampling) -> list[generation_pb2.GenerateResponse]:
    prompt = sampling.pop("text", "The three primary colors are")
    with grpc.insecure_channel(stack.grpc_addr) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = generation_pb2.GenerateRequest(
            text=prompt, sampling=generation_pb2.SamplingParameters(**sampling)
        )
        return list(stub.Generate(request, timeout=120))


def _by_index(responses) -> dict[int, str]:
    texts: dict[int, str] = {}
    for r in responses:
        texts[r.index] = texts.get(r.index, "") + r.text
    return texts


def test_n_samples_with_seed_and_usage(stack) -> None:
    responses = _generate(stack, n=3, max_tokens=12, temperature=1.0, seed=7)
    texts = _by_index(responses)
    assert sorted(texts) == [0, 1, 2]
    finals = [r for r in responses if r.finish_reason]
    assert len(finals) == 3 and all(r.usage.completion_tokens == 12 for r in finals)
    # Same seed, same prompt: every sample draws the same tokens.
    assert len(set(texts.values())) == 1


def test_echo_prepends_the_prompt(stack) -> None:
    prompt = "The three primary colors are"
    texts = _by_index(_generate(stack, text=prompt, echo=True, max_tokens=6, temperature=0.0))
    ids = hf_oracle.tokenizer()(prompt)["input_ids"]
    expected = hf_oracle.tokenizer().decode(hf_oracle.greedy(ids, 6), skip_special_tokens=True)
    assert texts[0] == prompt + expected


def test_structured_choice_and_json_schema(stack) -> None:
    choices = generation_pb2.ChoiceList(choices=["red", "green", "blue"])
    texts = _by_index(_generate(stack, choice=choices, max_tokens=8, temperature=0.0))
    assert texts[0] in {"red", "green", "blue"}
    schema = {"type": "object", "properties": {"color": {"type": "string"}}, "required": ["color"]}
    texts = _by_index(
        _generate(stack, json_schema=json.dumps(schema), max_tokens=32, temperature=0.0)
    )
    assert isinstance(json.loads(texts[0])["color"], str)


def test_bad_schema_is_invalid_argument(stack) -> None:
    with pytest.raises(grpc.RpcError) as excinfo:
        _generate(stack, json_schema="{not json", max_tokens=4)
    assert excinfo.value.code() == grpc.StatusCode.INVALID_ARGUMENT
