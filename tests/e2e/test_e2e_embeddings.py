"""Pooling models through the whole stack: the OpenAI client's embeddings.create,
/score, /rerank, /classify, and the 400s a client sees for bad input."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from kvmesh.services.cli.local_stack import LocalStack
from tests.encoder_checkpoints import build_cross_encoder, build_embedding_model

pytestmark = pytest.mark.e2e
pytest.importorskip("sentence_transformers")

STARTUP_TIMEOUT_S = 300
TEXTS = ["the quick brown fox", "paris is the capital of france", "a reranker scores documents"]


def _start(folder: Path) -> LocalStack:
    stack = LocalStack(["--dtype", "float32", "--max-num-batched-tokens", "512"], model=folder)
    stack.wait_ready(STARTUP_TIMEOUT_S)
    return stack


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalStack, Path]]:
    folder = build_embedding_model(tmp_path_factory.mktemp("embed") / "st", dense_dim=None)
    stack = _start(folder)
    yield stack, folder
    assert stack.stop() == 0, "".join(stack.log[-50:])


@pytest.fixture(scope="module")
def reranker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalStack, Path]]:
    folder = build_cross_encoder(tmp_path_factory.mktemp("rerank") / "ce")
    stack = _start(folder)
    yield stack, folder
    assert stack.stop() == 0, "".join(stack.log[-50:])


def test_openai_client_embeddings_float_and_base64(embedder) -> None:
    from sentence_transformers import SentenceTransformer

    stack, folder = embedder
    expected = SentenceTransformer(str(folder), device="cpu").encode(TEXTS)
    client = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="none", timeout=120)
    floats = client.embeddings.create(model=folder.name, input=TEXTS, encoding_format="float")
    # The client asks for base64 by default and decodes it itself.
    packed = client.embeddings.create(model=folder.name, input=TEXTS)
    for out in (floats, packed):
        got = np.array([d.embedding for d in out.data], dtype=np.float32)
        assert [d.index for d in out.data] == [0, 1, 2]
        cosine = (
            (got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
        )
        assert cosine.min() >= 0.99999
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > len(TEXTS)
    ids = SentenceTransformer(str(folder), device="cpu").tokenizer(TEXTS[0])["input_ids"]
    by_ids = client.embeddings.create(model=folder.name, input=[ids], encoding_format="float")
    np.testing.assert_allclose(by_ids.data[0].embedding, floats.data[0].embedding, atol=1e-5)


def test_bad_embedding_requests_are_400(embedder) -> None:
    stack, folder = embedder
    url = f"{stack.http_url}/v1/embeddings"
    cases = [
        {"input": []},
        {"input": "hello", "dimensions": 8},  # not a Matryoshka model
        {"input": [[5] * 600]},  # over the model's maximum, no truncation
        {"input": ["x"] * 100_000},
    ]
    for body in cases:
        response = httpx.post(url, json={"model": folder.name, **body}, timeout=60)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["type"] == "invalid_request_error"
    truncated = httpx.post(
        url,
        json={"input": [[5] * 600], "truncate_prompt_tokens": 16, "encoding_format": "float"},
        timeout=60,
    )
    assert truncated.status_code == 200, truncated.text
    assert truncated.json()["usage"]["prompt_tokens"] == 16
    # One flat list of token ids is one input, not 600 against --max-prompts-per-request.
    flat = httpx.post(url, json={"input": [5] * 600, "truncate_prompt_tokens": 16}, timeout=60)
    assert flat.status_code == 200, flat.text
    assert flat.json()["usage"]["prompt_tokens"] == 16


def test_the_schema_bounds_the_inputs_of_one_call(embedder) -> None:
    stack, _ = embedder
    schema = httpx.get(f"{stack.http_url}/openapi.json", timeout=60).json()
    inputs = schema["components"]["schemas"]["EmbeddingRequest"]["properties"]["input"]["anyOf"]
    # Strings and lists of token ids: --max-prompts-per-request's default.
    assert sorted(a.get("maxItems", 0) for a in inputs) == [0, 0, 128, 128]


def test_rerank_and_score_equal_the_cross_encoder(reranker) -> None:
    from sentence_transformers import CrossEncoder

    stack, folder = reranker
    query, docs = "what is the capital of france?", TEXTS
    expected = CrossEncoder(str(folder), device="cpu").predict([(query, d) for d in docs])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = {"query": query, "documents": docs, "top_n": 2, "return_documents": True}
        result = httpx.post(stack.http_url + path, json=body, timeout=60).json()["results"]
        assert len(result) == 2
        assert [r["index"] for r in result] == list(np.argsort(-expected)[:2])
        for r in result:
            assert abs(r["relevance_score"] - expected[r["index"]]) < 1e-4
            assert r["document"]["text"] == docs[r["index"]]
    score = httpx.post(
        stack.http_url + "/score", json={"text_1": query, "text_2": docs}, timeout=60
    ).json()
    np.testing.assert_allclose([d["score"] for d in score["data"]], expected, atol=1e-4)
    classify = httpx.post(stack.http_url + "/classify", json={"input": docs}, timeout=60).json()
    assert [d["num_classes"] for d in classify["data"]] == [1, 1, 1]
    refused = httpx.post(stack.http_url + "/v1/embeddings", json={"input": "x"}, timeout=60)
    assert refused.status_code == 400


def test_grpc_embed_equals_http(embedder) -> None:
    import grpc

    from kvmesh.protos import generation_pb2, generation_pb2_grpc

    stack, _ = embedder
    http = httpx.post(
        f"{stack.http_url}/v1/embeddings",
        json={"input": TEXTS, "encoding_format": "float"},
        timeout=60,
    ).json()
    with grpc.insecure_channel(stack.grpc_addr) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        out = stub.Embed(generation_pb2.EmbedRequest(texts=TEXTS), timeout=60)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Embed(generation_pb2.EmbedRequest(texts=TEXTS, dimensions=4), timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Matryoshka" in refused.value.details()
    for got, expected in zip(out.embeddings, http["data"], strict=True):
        np.testing.assert_allclose(list(got.values), expected["embedding"], atol=1e-6)
    assert out.usage.prompt_tokens == http["usage"]["prompt_tokens"]


@pytest.fixture(scope="module")
def decoder_embedder(tmp_path_factory: pytest.TempPathFactory):
    """A tiny random Qwen3 generation checkpoint (the default model's tokenizer)
    served as an embedding model by --runner pooling, as Qwen3-Embedding is."""
    import shutil

    from kvmesh.services.runtime.model_prep import default_model_path, is_prepared
    from tests.worker.model_families import make_family_checkpoint

    source = default_model_path()
    if not is_prepared(source):
        pytest.skip("default model not prepared (run `make install`)")
    folder = tmp_path_factory.mktemp("decoder-embed") / "qwen3-embed"
    hf = make_family_checkpoint(folder, "Qwen3ForCausalLM", vocab_size=49_152)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, folder / name)
    stack = LocalStack(
        ["--dtype", "float32", "--max-num-batched-tokens", "512", "--runner", "pooling"],
        model=folder,
    )
    stack.wait_ready(STARTUP_TIMEOUT_S)
    yield stack, folder, hf
    assert stack.stop() == 0, "".join(stack.log[-50:])


def test_decoder_embeddings_through_the_stack_equal_transformers(decoder_embedder) -> None:
    import torch
    from transformers import AutoTokenizer

    stack, folder, hf = decoder_embedder
    client = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="none", timeout=120)
    out = client.embeddings.create(model=folder.name, input=TEXTS)
    got = np.array([d.embedding for d in out.data], dtype=np.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    expected = []
    for text in TEXTS:
        with torch.no_grad():
            states = hf.model(torch.tensor([tokenizer(text)["input_ids"]])).last_hidden_state
        expected.append(torch.nn.functional.normalize(states[0, -1], dim=0).numpy())
    cosine = (got * np.array(expected)).sum(1) / np.linalg.norm(got, axis=1)
    assert cosine.min() >= 0.99999
    assert out.usage.prompt_tokens == sum(len(tokenizer(t)["input_ids"]) for t in TEXTS)
    # A bi-encoder's /score: the cosine of the two embeddings.
    score = httpx.post(
        f"{stack.http_url}/score",
        json={"model": folder.name, "text_1": TEXTS[0], "text_2": TEXTS[1:]},
        timeout=60,
    )
    assert score.status_code == 200, score.text
    np.testing.assert_allclose(
        [d["score"] for d in score.json()["data"]], got[1:] @ got[0], atol=1e-5
    )
    # A generation request to a pooling model is refused, not served.
    completion = httpx.post(
        f"{stack.http_url}/v1/completions",
        json={"model": folder.name, "prompt": "hi", "max_tokens": 2},
        timeout=60,
    )
    assert 400 <= completion.status_code < 500, completion.text


def test_decoder_yes_no_reranker_through_the_stack(tmp_path: Path) -> None:
    """--hf-overrides classifier_from_token (Qwen3-Reranker's flags) through
    `kvmesh up`: /rerank's relevance is P("yes") from the LM head's two logits."""
    import torch

    from tests.worker.model_families import make_family_checkpoint
    from tests.worker.word_tokenizer import NO_ID, YES_ID, save_word_tokenizer

    folder = tmp_path / "qwen3-reranker"
    hf = make_family_checkpoint(folder, "Qwen3ForCausalLM")
    save_word_tokenizer(folder, hf.config.vocab_size)
    overrides = (
        '{"architectures": ["Qwen3ForSequenceClassification"], '
        '"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}'
    )
    stack = LocalStack(
        ["--dtype", "float32", "--max-num-batched-tokens", "256", "--hf-overrides", overrides],
        model=folder,
    )
    try:
        stack.wait_ready(STARTUP_TIMEOUT_S)
        documents = ["w2 w3", "w100 w101 w102 w7", "w50"]
        response = httpx.post(
            f"{stack.http_url}/v1/rerank",
            json={"model": folder.name, "query": "w5 w9 w33", "documents": documents},
            timeout=60,
        )
        assert response.status_code == 200, response.text
        by_index = {r["index"]: r["relevance_score"] for r in response.json()["results"]}
        for index, document in enumerate(documents):
            ids = [int(w[1:]) for w in f"w5 w9 w33 {document}".split()]
            with torch.no_grad():
                logits = hf(torch.tensor([ids])).logits[0, -1]
            expected = torch.sigmoid(logits[YES_ID] - logits[NO_ID]).item()
            assert by_index[index] == pytest.approx(expected, abs=1e-4)
    finally:
        assert stack.stop() == 0, "".join(stack.log[-50:])
