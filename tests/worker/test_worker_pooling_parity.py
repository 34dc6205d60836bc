"""The pooling runner's embeddings and rerank scores equal sentence-transformers'."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from kvmesh.services.contracts.pooling_params import PoolingParams
from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.services.contracts.step import NewRequestData, SchedulerOutput
from kvmesh.worker.pooling_runner import PoolingRunner
from tests.encoder_checkpoints import CORPUS, build_cross_encoder, build_embedding_model

pytest.importorskip("sentence_transformers")


def _texts(n: int, seed: int = 0) -> list[str]:
    """Mixed lengths: a few words up to several sentences."""
    rng = random.Random(seed)
    words = " ".join(CORPUS).split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(1, 60))) for _ in range(n)]


def _run(runner: PoolingRunner, prompts: list[list[int]], params: list[PoolingParams]):
    new = [
        NewRequestData(
            req_id=f"r{i}",
            prompt_token_ids=ids,
            output_token_ids=[],
            sampling_params=SamplingParams(pooling=p),
            block_ids=[],
            num_computed_tokens=0,
        )
        for i, (ids, p) in enumerate(zip(prompts, params, strict=True))
    ]
    step = SchedulerOutput.make_empty(7)
    step.scheduled_new_reqs = new
    step.num_scheduled_tokens = {r.req_id: len(r.prompt_token_ids) for r in new}
    out = runner.execute_model(step)
    assert not out.errors, out.errors
    return [np.frombuffer(out.pooled[f"r{i}"], dtype=np.float32) for i in range(len(prompts))]


@pytest.mark.parametrize(
    ("family", "pooling", "dense_dim", "normalize"),
    [
        ("bert", "mean", 24, True),
        ("bert", "cls", None, True),
        ("xlm-roberta", "mean", None, False),
        ("xlm-roberta", "lasttoken", 16, True),
    ],
)
def test_embeddings_match_sentence_transformers(
    tmp_path: Path, family: str, pooling: str, dense_dim: int | None, normalize: bool
) -> None:
    from sentence_transformers import SentenceTransformer

    folder = build_embedding_model(
        tmp_path / "st", family=family, pooling=pooling, dense_dim=dense_dim, normalize=normalize
    )
    st = SentenceTransformer(str(folder), device="cpu")
    texts = _texts(12)
    expected = st.encode(texts, batch_size=5, convert_to_numpy=True)
    prompts = [st.tokenizer(t)["input_ids"] for t in texts]
    assert len({len(p) for p in prompts}) > 6  # mixed lengths in one packed step
    got = _run(PoolingRunner(folder), prompts, [PoolingParams()] * len(prompts))
    for g, e in zip(got, expected, strict=True):
        assert g.shape == e.shape
        cosine = float(np.dot(g, e) / (np.linalg.norm(g) * np.linalg.norm(e)))
        assert cosine >= 0.99999
        np.testing.assert_allclose(g, e, atol=1e-4)


def test_matryoshka_cut_then_normalize(tmp_path: Path) -> None:
    folder = build_embedding_model(tmp_path / "st", dense_dim=None)
    runner = PoolingRunner(folder)
    ids = [2, 10, 11, 12, 3]
    full, cut = _run(
        runner, [ids, ids], [PoolingParams(normalize=False), PoolingParams(dimensions=8)]
    )
    expected = full[:8] / np.linalg.norm(full[:8])
    np.testing.assert_allclose(cut, expected, atol=1e-6)


@pytest.mark.parametrize("family", ["bert", "xlm-roberta"])
def test_rerank_scores_match_cross_encoder(tmp_path: Path, family: str) -> None:
    from sentence_transformers import CrossEncoder

    folder = build_cross_encoder(tmp_path / "ce", family=family)
    ce = CrossEncoder(str(folder), device="cpu")
    query = "what is the capital of france?"
    docs = _texts(6, seed=3)
    expected = ce.predict([(query, d) for d in docs])  # sigmoid of the one logit
    tokenizer = ce.tokenizer
    prompts, params = [], []
    for d in docs:
        enc = tokenizer(query, d)
        prompts.append(enc["input_ids"])
        types = enc.get("token_type_ids") or []
        first = types.index(1) if 1 in types else None
        params.append(PoolingParams(task="classify", first_segment_len=first))
    got = _run(PoolingRunner(folder), prompts, params)
    scores = [float(torch.sigmoid(torch.tensor(g[0]))) for g in got]
    np.testing.assert_allclose(scores, expected, atol=1e-4)


def test_bad_requests_fail_alone(tmp_path: Path) -> None:
    folder = build_embedding_model(tmp_path / "st")
    runner = PoolingRunner(folder)
    step = SchedulerOutput.make_empty(1)
    ok = NewRequestData("ok", [2, 5, 3], [], SamplingParams(pooling=PoolingParams()), [], 0)
    long = NewRequestData("long", [5] * 600, [], SamplingParams(pooling=PoolingParams()), [], 0)
    gen = NewRequestData("gen", [2, 3], [], SamplingParams(), [], 0)
    step.scheduled_new_reqs = [ok, long, gen]
    out = runner.execute_model(step)
    assert set(out.pooled) == {"ok"}
    assert "exceeds" in out.errors["long"]
    assert "pooling requests only" in out.errors["gen"]
