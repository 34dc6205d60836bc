"""The running stack as a user sees it: health, readiness, errors, metrics, stop strings, aborts."""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvmesh.protos import generation_pb2, generation_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from kvmesh.services.runtime.grpc_server import internal_channel
from kvmesh.worker.step_budget import LONG_STEP_TOKENS, SHORT_STEP_TOKENS, preferred_step_tokens
from tests.e2e import hf_oracle

pytestmark = pytest.mark.e2e


def _metric_value(text: str, name: str) -> float:
    total = 0.0
    found = False
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, f"{name} not exported"
    return total


def test_health_ready_models(stack) -> None:
    with httpx.Client(base_url=stack.http_url, timeout=30) as client:
        assert client.get("/health").status_code == 200
        ready = client.get("/ready")
        assert ready.status_code == 200, ready.text
        models = client.get("/v1/models").json()
        assert models["object"] == "list"
        (model,) = models["data"]
        assert model["id"] == "SmolLM2-135M-Instruct"
        assert model["max_model_len"] == 2048
        # The worker's dtype, reported through scheduler and gateway.
        assert (model["dtype"], model["dtype_reason"]) == ("float32", "--dtype float32")


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"max_tokens": 5}, 400, "prompt"),
        ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
        ({"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
        ({"prompt": "hi", "model": "gpt-nope"}, 404, "model"),
        ({"prompt": "hi", "max_tokens": 5000}, 400, "max_tokens"),
        ({"prompt": [1, 2, 99999999]}, 400, "prompt"),
        ({"prompt": "word " * 3000}, 400, "prompt"),
    ],
)
def test_bad_input_gets_openai_style_4xx(stack, body, status, param) -> None:
    r = httpx.post(stack.http_url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"]
    assert error["param"] == param


def test_malformed_json_is_a_400(stack) -> None:
    r = httpx.post(
        stack.http_url + "/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400
    assert "error" in r.json()


def test_chat_uses_the_models_template(stack) -> None:
    messages = [{"role": "user", "content": "Name a color."}]
    template_ids = hf_oracle.tokenizer().apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True
    )
    if not isinstance(template_ids, list):
        template_ids = template_ids["input_ids"]
    r = httpx.post(
        stack.http_url + "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 8, "temperature": 0},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == len(template_ids)
    expected = hf_oracle.greedy(list(template_ids), 8, stop_at_eos=True)
    text = hf_oracle.tokenizer().decode(expected, skip_special_tokens=True)
    assert body["choices"][0]["message"]["content"] == text


def test_stop_string_ends_generation_and_is_not_emitted(stack) -> None:
    prompt = "Count: one, two, three, four, five,"
    ids = hf_oracle.tokenizer()(prompt)["input_ids"]
    free_text = hf_oracle.tokenizer().decode(hf_oracle.greedy(ids, 24), skip_special_tokens=True)
    stop = free_text.strip().split()[1]  # a word the model will produce
    r = httpx.post(
        stack.http_url + "/v1/completions",
        json={"prompt": prompt, "max_tokens": 24, "temperature": 0, "stop": [stop]},
        timeout=60,
    )
    body = r.json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == stop
    assert choice["text"] == free_text[: free_text.index(stop)]


def test_every_service_exports_prometheus_metrics(stack) -> None:
    httpx.post(
        stack.http_url + "/v1/completions",
        json={"prompt": "Hello there", "max_tokens": 4, "temperature": 0},
        timeout=60,
    ).raise_for_status()
    gateway = httpx.get(stack.http_url + "/metrics", timeout=10).text
    for name in (
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
    ):
        assert _metric_value(gateway, name) > 0, name
    assert 'model_name="SmolLM2-135M-Instruct"' in gateway
    scheduler = httpx.get(stack.metrics_url("scheduler"), timeout=10).text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
    ):
        _metric_value(scheduler, name)
    assert _metric_value(scheduler, "vllm:request_queue_time_seconds_count") > 0
    for service, name in (
        ("worker", "kvmesh:worker_step_seconds_count"),
        ("detokenizer", "kvmesh:detokenizer_tokens_total"),
        ("kvstore", "kvmesh:kvstore_capacity_bytes"),
    ):
        text = httpx.get(stack.metrics_url(service), timeout=10).text
        _metric_value(text, name)


def test_client_disconnect_aborts_and_frees_blocks(stack) -> None:
    body = {
        "prompt": "Tell me a long story.",
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(base_url=stack.http_url, timeout=60) as client,
        client.stream("POST", "/v1/completions", json=body) as r,
    ):
        chunks = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks += 1
            if chunks >= 3:
                break
    # The scheduler must see the abort and release the request's KV blocks.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = httpx.get(stack.metrics_url("scheduler"), timeout=10).text
        if (
            _metric_value(text, "vllm:num_requests_running") == 0
            and _metric_value(text, "vllm:kv_cache_usage_perc") == 0
        ):
            return
        time.sleep(0.25)
    pytest.fail("aborted request still holds the batch or KV blocks:\n" + text)


def test_grpc_health_reflection_and_public_api(stack) -> None:
    for port_name in (
        "grpc_port",
        "scheduler_port",
        "worker_port",
        "detokenizer_port",
        "kvstore_port",
    ):
        with grpc.insecure_channel(f"127.0.0.1:{stack.ports[port_name]}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, port_name
    with grpc.insecure_channel(stack.grpc_addr) as channel:
        responses = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
        names = {s.name for r in responses for s in r.list_services_response.service}
        assert "kvmesh.v1.Generation" in names
        stub = generation_pb2_grpc.GenerationStub(channel)
        tokens = stub.Tokenize(generation_pb2.TokenizeRequest(text="Hello world"), timeout=5)
        assert list(tokens.token_ids) == hf_oracle.tokenizer()("Hello world")["input_ids"]
        info = stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=5)
        assert info.max_model_len == 2048 and info.vocab_size == 49152
        with pytest.raises(grpc.RpcError) as excinfo:
            list(
                stub.Generate(
                    generation_pb2.GenerateRequest(
                        text="hi", sampling=generation_pb2.SamplingParameters(temperature=-3.0)
                    ),
                    timeout=10,
                )
            )
        assert excinfo.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "temperature" in excinfo.value.details()


def test_the_scheduler_steps_with_the_workers_budget_by_default(stack) -> None:
    """No --max-num-batched-tokens: the scheduler takes the budget the worker names
    for its hardware (a CPU here: 1024, or 2048 for bf16 on AMX), as its GetInfo says."""

    async def scheduler_info() -> scheduler_pb2.SchedulerInfo:
        address = f"127.0.0.1:{stack.ports['scheduler_port']}"
        async with internal_channel(address, stack.internal_security("scheduler")) as channel:
            return await scheduler_pb2_grpc.SchedulerStub(channel).GetInfo(
                scheduler_pb2.GetSchedulerInfoRequest(), timeout=10
            )

    info = asyncio.run(scheduler_info())
    expected = preferred_step_tokens("cpu", getattr(torch, info.dtype))
    assert info.max_num_batched_tokens == expected in (SHORT_STEP_TOKENS, LONG_STEP_TOKENS)
