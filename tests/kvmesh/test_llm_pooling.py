"""``kvmesh.LLM``'s embed / score / classify (vllm.LLM's): through the real
scheduler and pooling runner, equal to sentence-transformers and transformers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import kvmesh
from tests.encoder_checkpoints import build_cross_encoder, build_embedding_model
from tests.worker.model_families import make_family_checkpoint
from tests.worker.word_tokenizer import NO_ID, YES_ID, save_word_tokenizer

pytest.importorskip("sentence_transformers")

TEXTS = [
    "the quick brown fox",
    "paris is the capital of france",
    "a reranker scores how well a document answers a query about the capital of france",
]


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / np.linalg.norm(a) / np.linalg.norm(b))


def test_embed_and_score_equal_sentence_transformers(tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    folder = build_embedding_model(tmp_path / "st")
    expected = SentenceTransformer(str(folder), device="cpu").encode(TEXTS)
    # A small budget: the three inputs take more than one scheduler step.
    llm = kvmesh.LLM(folder, dtype="float32", max_num_batched_tokens=24, num_threads=1)
    outputs = llm.embed(TEXTS)
    got = np.array([o.outputs.embedding for o in outputs], dtype=np.float32)
    assert [o.prompt_token_ids for o in outputs] == [llm._encode(t) for t in TEXTS]
    assert min(_cosine(g, e) for g, e in zip(got, expected, strict=True)) >= 0.99999
    scores = [o.outputs.score for o in llm.score(TEXTS[0], TEXTS[1:])]
    np.testing.assert_allclose(scores, [got[0] @ got[1], got[0] @ got[2]], atol=1e-5)
    with pytest.raises(ValueError, match="pooling model"):
        llm.generate("hello")
    with pytest.raises(ValueError, match="not 'classify'"):
        llm.classify(TEXTS)
    with pytest.raises(ValueError, match="input 0"):
        llm.embed([[5] * 30])  # longer than the step budget: refused, named


def test_score_with_a_cross_encoder_equals_its_predict(tmp_path: Path) -> None:
    from sentence_transformers import CrossEncoder

    folder = build_cross_encoder(tmp_path / "ce")
    expected = CrossEncoder(str(folder), device="cpu").predict([(TEXTS[1], t) for t in TEXTS])
    llm = kvmesh.LLM(folder, dtype="float32", num_threads=1)
    scores = [o.outputs.score for o in llm.score(TEXTS[1], TEXTS)]
    np.testing.assert_allclose(scores, expected, atol=1e-4)
    probs = llm.classify(TEXTS)[0].outputs.probs
    assert len(probs) == 1 and 0.0 < probs[0] < 1.0


def test_a_generation_checkpoint_embeds_under_runner_pooling(tmp_path: Path) -> None:
    hf = make_family_checkpoint(tmp_path, "Qwen3ForCausalLM")
    save_word_tokenizer(tmp_path, hf.config.vocab_size)
    prompts = [[5, 9, 33, 2], list(range(3, 40)), [7]]
    llm = kvmesh.LLM(tmp_path, dtype="float32", runner="pooling", num_threads=1)
    got = [o.outputs.embedding for o in llm.embed(prompts)]
    for vector, ids in zip(got, prompts, strict=True):
        with torch.no_grad():
            state = hf.model(torch.tensor([ids])).last_hidden_state[0, -1]
        expected = torch.nn.functional.normalize(state, dim=0).numpy()
        assert _cosine(np.array(vector), expected) >= 0.99999
    with pytest.raises(ValueError, match="needs a pooling model"):
        kvmesh.LLM(tmp_path, dtype="float32", num_threads=1).embed(prompts)


def test_a_yes_no_reranker_scores_pairs(tmp_path: Path) -> None:
    """Qwen3-Reranker style: hf_overrides' classifier_from_token; the score is
    P(yes) of the two-way softmax over the LM head's "no"/"yes" logits."""
    hf = make_family_checkpoint(tmp_path, "Qwen3ForCausalLM")
    save_word_tokenizer(tmp_path, hf.config.vocab_size)
    llm = kvmesh.LLM(
        tmp_path,
        dtype="float32",
        hf_overrides={"classifier_from_token": ["no", "yes"]},
        num_threads=1,
    )
    outputs = llm.score("w5 w9 w33", ["w2 w3", "w100 w101 w102 w7"])
    for out in outputs:
        with torch.no_grad():
            logits = hf(torch.tensor([out.prompt_token_ids])).logits[0, -1]
        expected = torch.sigmoid(logits[YES_ID] - logits[NO_ID]).item()
        assert out.outputs.score == pytest.approx(expected, abs=1e-5)
