"""Responses kept in a (real, in-process) kvstore: any gateway replica continues a conversation."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry

from kvmesh.gateway.openai.app import build_app
from kvmesh.gateway.responses.kvstore_store import KVStoreResponseStore
from kvmesh.gateway.responses.store import ResponseStoreConfig, StoredResponse
from kvmesh.gateway.tokenizer import Tokenizer
from kvmesh.kvstore.client import KVStoreClient
from kvmesh.kvstore.testing import FakeClock, serve_store
from kvmesh.kvstore.tiered import TieredStore
from kvmesh.services.cli.local_stack import free_ports
from kvmesh.services.contracts.errors import UnavailableError
from tests.gateway.fakes import FakeEngineClient
from tests.gateway.helpers import MODEL_NAME

TTL_S = 60.0


def kvstore() -> AbstractAsyncContextManager[str]:
    """An in-process kvstore (served in the test's own loop); yields its address."""
    return serve_store(TieredStore(1 << 20))


def entry(text: str) -> StoredResponse:
    return StoredResponse({"id": "r", "output": text}, [{"role": "user", "content": text}])


async def test_one_replica_reads_what_another_stored_until_it_expires() -> None:
    clock = FakeClock()
    config = ResponseStoreConfig(ttl_s=TTL_S)
    async with (
        kvstore() as kvstore_address,
        KVStoreClient(kvstore_address) as client_a,
        KVStoreClient(kvstore_address) as client_b,
    ):
        replica_a = KVStoreResponseStore(client_a, config, clock)
        replica_b = KVStoreResponseStore(client_b, config, clock)
        await replica_a.put("resp_1", entry("héllo"))
        assert await replica_b.get("resp_1") == entry("héllo")
        await replica_b.put("resp_1", entry("replaced"))
        assert await replica_a.get("resp_1") == entry("replaced")
        assert await replica_a.get("resp_2") is None
        clock.now += TTL_S
        assert await replica_b.get("resp_1") is None
        await replica_a.put("resp_3", entry("x"))
        assert await replica_b.delete("resp_3")
        assert not await replica_a.delete("resp_3")
        assert await replica_a.get("resp_3") is None


async def test_an_unreachable_kvstore_is_unavailable_on_read_and_a_miss_on_write() -> None:
    (port,) = free_ports(1)
    async with KVStoreClient(f"127.0.0.1:{port}", timeout_s=0.5) as client:
        store = KVStoreResponseStore(client)
        await store.put("resp_1", entry("lost"))  # logged, not raised: the answer was served
        with pytest.raises(UnavailableError):
            await store.get("resp_1")


async def test_a_conversation_continues_on_another_gateway(
    engine: FakeEngineClient, tokenizer: Tokenizer
) -> None:
    engine.script = [
        *tokenizer.encode("Blue.", add_special_tokens=False),
        tokenizer.eos_token_ids[0],
    ]
    clients = []
    async with (
        kvstore() as kvstore_address,
        KVStoreClient(kvstore_address) as store_a,
        KVStoreClient(kvstore_address) as store_b,
    ):
        for store in (store_a, store_b):
            app = build_app(
                engine,
                tokenizer,
                MODEL_NAME,
                metrics_registry=CollectorRegistry(),
                response_store=KVStoreResponseStore(store),
            )
            http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
            clients.append(
                openai.AsyncOpenAI(
                    base_url="http://gateway/v1", api_key="x", http_client=http, max_retries=0
                )
            )
        gateway_a, gateway_b = clients
        first = await gateway_a.responses.create(model=MODEL_NAME, input="Colour of the sky?")
        second = await gateway_b.responses.create(
            model=MODEL_NAME, previous_response_id=first.id, input="And of the sea?"
        )
        assert second.output_text == "Blue."
        prompt = tokenizer.decode(engine.requests[-1].prompt_token_ids)
        assert prompt.index("Colour of the sky?") < prompt.index("Blue.") < prompt.index("sea?")
        assert (await gateway_b.responses.retrieve(first.id)).output_text == "Blue."
        for client in clients:
            await client.close()
