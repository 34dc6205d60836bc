"""The streaming client against the fake server: timing, token counts, failures."""

from __future__ import annotations

import pytest

from kvmesh.services.cli.bench.client import ClientConfig, CompletionsClient
from kvmesh.services.cli.bench.dataset import SampleRequest
from kvmesh.services.cli.bench.sampling import CHAT, NONE_GIVEN, SAMPLING_SETTINGS
from tests.bench.fake_openai_server import MODEL_ID, PROMPT_TOKENS, FakeOpenAIServer

REQUEST = SampleRequest(request_id="req-1", prompt=[11, 12, 13], prompt_len=3, output_len=6)


def client_for(server: FakeOpenAIServer, **overrides: object) -> CompletionsClient:
    return CompletionsClient(ClientConfig(base_url=server.base_url, model=MODEL_ID, **overrides))


async def test_stream_timing_and_usage(fake_server: FakeOpenAIServer) -> None:
    fake_server.reset(first_delay_s=0.05, chunk_delay_s=0.01)
    async with client_for(fake_server) as client:
        output = await client.send(REQUEST)
    assert output.success, output.error
    assert output.output_tokens == 6
    assert output.prompt_len == PROMPT_TOKENS  # the server's count replaces ours
    assert output.generated_text == "t0 t1 t2 t3 t4 t5 "
    # One TTFT plus one gap per later token event; together they span the latency.
    assert len(output.itl) == 5
    assert output.ttft >= 0.05
    assert output.latency >= 0.05 + 5 * 0.01
    assert output.ttft + sum(output.itl) == pytest.approx(output.latency, abs=1e-9)


async def test_request_body_asks_for_a_greedy_stream_of_exact_length(
    fake_server: FakeOpenAIServer,
) -> None:
    async with client_for(fake_server, api_key="secret") as client:
        await client.send(REQUEST)
    payload = fake_server.observed.payloads[0]
    assert payload["model"] == MODEL_ID
    assert payload["prompt"] == [11, 12, 13]
    assert payload["max_tokens"] == 6
    assert payload["temperature"] == 0.0
    assert payload["ignore_eos"] is True
    assert payload["stream"] is True
    assert payload["stream_options"] == {"include_usage": True}
    headers = fake_server.observed.headers[0]
    assert headers["authorization"] == "Bearer secret"
    assert headers["x-request-id"] == "req-1"


async def test_each_sampling_setting_sends_its_fields_and_none_given_sends_none(
    fake_server: FakeOpenAIServer,
) -> None:
    assert set(SAMPLING_SETTINGS) == {"greedy", "none-given", "t0.7-p0.9"}
    for setting in (NONE_GIVEN, CHAT):
        async with client_for(fake_server, sampling=setting) as client:
            await client.send(REQUEST)
    none_given, chat = fake_server.observed.payloads[-2:]
    # Nothing sent: the server's defaults (temperature 1), as vllm bench serve.
    assert "temperature" not in none_given and "top_p" not in none_given
    assert none_given["ignore_eos"] is True
    assert (chat["temperature"], chat["top_p"]) == (0.7, 0.9)


async def test_without_usage_the_token_events_are_counted(fake_server: FakeOpenAIServer) -> None:
    fake_server.reset(send_usage=False, num_chunks=4)
    async with client_for(fake_server) as client:
        output = await client.send(REQUEST)
    assert output.success
    assert output.output_tokens == 4
    assert output.prompt_len == 3


async def test_http_error_is_a_failed_request_with_the_body(fake_server: FakeOpenAIServer) -> None:
    fake_server.reset(http_status=429)
    async with client_for(fake_server) as client:
        output = await client.send(REQUEST)
    assert not output.success
    assert output.error.startswith("HTTP 429")
    assert "refused" in output.error


async def test_error_event_mid_stream_fails_the_request(fake_server: FakeOpenAIServer) -> None:
    fake_server.reset(error_after_chunks=2)
    async with client_for(fake_server) as client:
        output = await client.send(REQUEST)
    assert not output.success
    assert "engine died" in output.error


async def test_unreachable_server_fails_without_raising() -> None:
    config = ClientConfig(base_url="http://127.0.0.1:9", model="m", timeout_s=5)
    async with CompletionsClient(config) as client:
        output = await client.send(REQUEST)
    assert not output.success
    assert "Connect" in output.error


async def test_first_model_id_comes_from_v1_models(fake_server: FakeOpenAIServer) -> None:
    async with client_for(fake_server) as client:
        assert await client.first_model_id() == MODEL_ID
