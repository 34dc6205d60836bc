"""A generation checkpoint served by the pooling runner (--runner pooling /
--convert): embeddings equal transformers' last hidden state pooled, a yes/no
reranker's score equals the LM head's two logits, and the flag combinations
vLLM refuses are refused here by name."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kvmesh.services.contracts.pooling_params import PoolingParams
from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.services.contracts.step import NewRequestData, SchedulerOutput
from kvmesh.worker.config import ModelConfig
from kvmesh.worker.pooling_runner import PoolingRunner
from kvmesh.worker.runner_choice import choose_runner
from tests.worker.model_families import make_family_checkpoint
from tests.worker.word_tokenizer import save_word_tokenizer

QWEN3 = "Qwen3ForCausalLM"
RERANKER_OVERRIDES = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True,
}


def _prompts() -> list[list[int]]:
    """Mixed lengths (1 to 70 tokens: several KV blocks) packed in one step."""
    lengths = [1, 5, 17, 33, 70, 9, 16]
    return [[(31 * i + 7 * j) % 150 + 3 for j in range(n)] for i, n in enumerate(lengths)]


def _run(runner: PoolingRunner, prompts: list[list[int]], params: PoolingParams) -> np.ndarray:
    step = SchedulerOutput.make_empty(3)
    step.scheduled_new_reqs = [
        NewRequestData(f"r{i}", ids, [], SamplingParams(pooling=params), [], 0)
        for i, ids in enumerate(prompts)
    ]
    step.num_scheduled_tokens = {r.req_id: len(r.prompt_token_ids) for r in step.scheduled_new_reqs}
    out = runner.execute_model(step)
    assert not out.errors, out.errors
    return np.stack(
        [np.frombuffer(out.pooled[f"r{i}"], dtype=np.float32) for i in range(len(prompts))]
    )


def _hf_last_hidden(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out = model.model(torch.tensor([ids]))  # the decoder without its LM head
    return out.last_hidden_state[0]


def _cosines(got: np.ndarray, expected: np.ndarray) -> np.ndarray:
    return (got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)


def _decoder_runner(
    folder: Path,
    dtype: str = "float32",
    quantization: str | None = None,
    hf_overrides: dict | None = None,
) -> PoolingRunner:
    config = ModelConfig.from_pretrained(folder, dtype=dtype, quantization=quantization)
    convert = "embed" if hf_overrides is None else "classify"
    return PoolingRunner(folder, decoder=config, convert=convert, hf_overrides=hf_overrides)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    folder = tmp_path_factory.mktemp("qwen3-embed")
    return folder, make_family_checkpoint(folder, QWEN3)


def test_last_token_embedding_equals_transformers(qwen3) -> None:
    folder, hf = qwen3
    prompts = _prompts()
    runner = _decoder_runner(folder)
    assert runner.info.tasks == ("embed",)
    assert runner.info.embedding_dim == hf.config.hidden_size
    got = _run(runner, prompts, PoolingParams())
    expected = np.stack(
        [torch.nn.functional.normalize(_hf_last_hidden(hf, p)[-1], dim=0).numpy() for p in prompts]
    )
    assert _cosines(got, expected).min() >= 0.99999
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    # Unnormalized on request: the state itself.
    raw = _run(runner, prompts[:3], PoolingParams(normalize=False))
    for vector, p in zip(raw, prompts[:3], strict=True):
        np.testing.assert_allclose(vector, _hf_last_hidden(hf, p)[-1].numpy(), atol=1e-4)


def test_sentence_transformers_pooling_config_is_honoured(qwen3, tmp_path: Path) -> None:
    """A folder whose modules.json says mean pooling, no Normalize: that, not the default."""
    folder, hf = qwen3
    st = tmp_path / "st"
    st.mkdir()
    for item in folder.iterdir():
        (st / item.name).symlink_to(item)
    (st / "1_Pooling").mkdir()
    (st / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, "pooling_mode": "mean"})
    )
    (st / "modules.json").write_text(
        json.dumps(
            [
                {
                    "idx": 0,
                    "name": "0",
                    "path": "",
                    "type": "sentence_transformers.models.Transformer",
                },
                {
                    "idx": 1,
                    "name": "1",
                    "path": "1_Pooling",
                    "type": "sentence_transformers.models.Pooling",
                },
            ]
        )
    )
    prompts = _prompts()
    got = _run(_decoder_runner(st), prompts, PoolingParams())
    expected = np.stack([_hf_last_hidden(hf, p).mean(0).numpy() for p in prompts])
    assert _cosines(got, expected).min() >= 0.99999
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_yes_no_reranker_scores_from_the_lm_head(tmp_path: Path) -> None:
    hf = make_family_checkpoint(tmp_path, QWEN3)
    vocab = save_word_tokenizer(tmp_path, hf.config.vocab_size)
    runner = _decoder_runner(tmp_path, hf_overrides=RERANKER_OVERRIDES)
    assert runner.info.tasks == ("classify",)
    assert runner.info.labels == ("LABEL_0",)
    prompts = _prompts()
    got = _run(runner, prompts, PoolingParams(task="classify"))
    with torch.no_grad():
        expected = [
            float(
                (logits := hf(torch.tensor([p])).logits[0, -1])[vocab["yes"]] - logits[vocab["no"]]
            )
            for p in prompts
        ]
    np.testing.assert_allclose(got[:, 0], expected, atol=1e-4)
    # The score the gateway reports, sigmoid(yes - no), is P(yes) of the two-way softmax.
    assert len(set(np.round(got[:, 0], 3))) == len(prompts)  # not a constant


def test_bf16_and_int8_cost_is_small(qwen3) -> None:
    """--dtype bfloat16 and --quantization int8 load as generation does; the
    cosine to float32 stays high (the figures in docs/serving.md)."""
    folder, _ = qwen3
    prompts = _prompts()
    exact = _run(_decoder_runner(folder), prompts, PoolingParams())
    bf16 = _run(_decoder_runner(folder, dtype="bfloat16"), prompts, PoolingParams())
    int8 = _run(_decoder_runner(folder, quantization="int8"), prompts, PoolingParams())
    assert _cosines(bf16, exact).min() >= 0.99
    assert _cosines(int8, exact).min() >= 0.99
    assert _cosines(int8, exact).min() < 1.0  # int8 did change the weights


@pytest.mark.parametrize(
    ("runner", "convert", "overrides", "expected"),
    [
        ("auto", "auto", "", ("generate", "none")),
        ("pooling", "auto", "", ("pooling", "embed")),
        ("auto", "embed", "", ("pooling", "embed")),
        ("auto", "auto", json.dumps(RERANKER_OVERRIDES), ("pooling", "classify")),
    ],
)
def test_runner_choice_follows_vllm(
    runner: str, convert: str, overrides: str, expected: tuple[str, str]
) -> None:
    choice = choose_runner(QWEN3, runner, convert, overrides)
    assert (choice.runner, choice.convert) == expected


@pytest.mark.parametrize(
    ("architecture", "runner", "convert", "overrides", "named"),
    [
        (QWEN3, "pooling", "none", "", "--convert"),
        (QWEN3, "generate", "embed", "", "--runner generate"),
        (QWEN3, "auto", "classify", "", "classifier_from_token"),
        (QWEN3, "pooling", "auto", '{"rope_theta": 5}', "rope_theta"),
        ("BertModel", "generate", "auto", "", "--runner generate"),
        ("BertModel", "auto", "classify", "", "classification head"),
    ],
)
def test_unservable_flag_combinations_are_refused_by_name(
    architecture: str, runner: str, convert: str, overrides: str, named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        choose_runner(architecture, runner, convert, overrides)
