"""``LLM.embed`` / ``LLM.score`` / ``LLM.classify``: a pooling model in this
process, as ``vllm.LLM`` serves one (``runner="pooling"`` or an encoder
checkpoint).

The inputs go through the real scheduler and the pooling runner
(kvmesh/pooling_engine.py); scoring follows the server's ``/score``: a
cross-encoder or yes/no reranker scores each pair in one forward (sigmoid of
its one logit), an embedding model scores the cosine of the two embeddings.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvmesh.gateway.tokenizer import Tokenizer
from kvmesh.outputs import (
    ClassificationOutput,
    EmbeddingOutput,
    PoolingRequestOutput,
    ScoringOutput,
)
from kvmesh.pooling_engine import PoolingEngine
from kvmesh.services.contracts.pooling_params import PoolingParams
from kvmesh.worker.config import ModelConfig
from kvmesh.worker.models.registry import check_model
from kvmesh.worker.pooling_runner import PoolingRunner
from kvmesh.worker.runner_choice import RunnerChoice

Prompt = str | Sequence[int]


def build_pooling_engine(
    folder: Path,
    choice: RunnerChoice,
    *,
    dtype: str,
    quantization: str | None,
    max_model_len: int | None,
    num_threads: int | None,
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> PoolingEngine:
    """The pooling runner the worker service would build for these flags."""
    if choice.pools_decoder:
        config = ModelConfig.from_pretrained(
            folder, dtype=dtype, max_model_len=max_model_len, quantization=quantization
        )
        check_model(config)
        runner = PoolingRunner(
            folder,
            num_threads=num_threads,
            decoder=config,
            convert=choice.convert,
            hf_overrides=choice.hf_overrides,
        )
    else:
        config = ModelConfig.from_pretrained(folder, dtype=dtype)
        runner = PoolingRunner(
            folder,
            dtype=config.dtype,
            max_model_len=max_model_len,
            num_threads=num_threads,
            quantization=quantization or "",
        )
    return PoolingEngine(runner, max_num_seqs, max_num_batched_tokens)


class PoolingMethods:
    """The pooling calls of ``kvmesh.LLM`` (``_pooling`` is None for a generation model)."""

    _pooling: PoolingEngine | None
    tokenizer: Tokenizer

    def _pooling_engine(self, task: str) -> PoolingEngine:
        engine = self._pooling
        if engine is None:
            raise ValueError(
                f"{task} needs a pooling model: this LLM generates (load an embedding or "
                "reranking checkpoint, or pass runner='pooling')"
            )
        if task in ("embed", "classify") and task not in engine.runner.info.tasks:
            raise ValueError(
                f"this model serves {', '.join(engine.runner.info.tasks)}, not {task!r}"
            )
        return engine

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer._hf(prompt)["input_ids"])
        return [int(t) for t in prompt]

    def _outputs(self, prompts: list[list[int]], results: list[Any]) -> list[PoolingRequestOutput]:
        return [
            PoolingRequestOutput(str(i), ids, result)
            for i, (ids, result) in enumerate(zip(prompts, results, strict=True))
        ]

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        normalize: bool | None = None,
        dimensions: int | None = None,
    ) -> list[PoolingRequestOutput]:
        """Each prompt's embedding (``outputs.embedding``), in order: the model's
        pooling pipeline, normalized unless ``normalize=False``; ``dimensions``:
        a Matryoshka model's cut."""
        engine = self._pooling_engine("embed")
        info = engine.runner.info
        if dimensions is not None and not (
            dimensions in info.matryoshka_dimensions
            or (-1 in info.matryoshka_dimensions and 0 < dimensions <= info.embedding_dim)
        ):
            raise ValueError(f"dimensions={dimensions} is not one this model was trained for")
        batch = [self._encode(p) for p in _as_list(prompts)]
        params = PoolingParams(task="embed", normalize=normalize, dimensions=dimensions)
        vectors = engine.run(batch, [params] * len(batch))
        return self._outputs(batch, [EmbeddingOutput(v.tolist()) for v in vectors])

    def classify(self, prompts: Prompt | Sequence[Prompt]) -> list[PoolingRequestOutput]:
        """Each prompt's class probabilities (``outputs.probs``): softmax over the
        labels, or the one label's sigmoid (as vLLM and sentence-transformers)."""
        engine = self._pooling_engine("classify")
        batch = [self._encode(p) for p in _as_list(prompts)]
        logits = engine.run(batch, [PoolingParams(task="classify")] * len(batch))
        return self._outputs(batch, [ClassificationOutput(_probabilities(v)) for v in logits])

    def score(
        self, data_1: str | Sequence[str], data_2: str | Sequence[str]
    ) -> list[PoolingRequestOutput]:
        """Scores of the pairs (data_1[i], data_2[i]); one data_1 text pairs with
        every data_2 text (``outputs.score``, in data_2's order)."""
        engine = self._pooling_engine("score")
        first = [data_1] if isinstance(data_1, str) else list(data_1)
        second = [data_2] if isinstance(data_2, str) else list(data_2)
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second) or not second:
            raise ValueError(
                f"data_1 has {len(first)} texts and data_2 {len(second)}: give one data_1 "
                "text, or as many as data_2 (at least one)"
            )
        if "classify" in engine.runner.info.tasks:
            if len(engine.runner.info.labels) != 1:
                raise ValueError("scoring needs a one-label cross-encoder (use classify)")
            pairs = [self._encode_pair(a, b) for a, b in zip(first, second, strict=True)]
            logits = engine.run(
                [ids for ids, _ in pairs],
                [PoolingParams(task="classify", first_segment_len=n) for _, n in pairs],
            )
            scores = [_sigmoid(float(v[0])) for v in logits]
            return self._outputs([ids for ids, _ in pairs], [ScoringOutput(s) for s in scores])
        unique = list(dict.fromkeys([*first, *second]))
        encoded = [self._encode(t) for t in unique]
        vectors = engine.run(encoded, [PoolingParams(task="embed", normalize=True)] * len(unique))
        by_text = dict(zip(unique, vectors, strict=True))
        ids_by_text = dict(zip(unique, encoded, strict=True))
        return self._outputs(
            [ids_by_text[a] + ids_by_text[b] for a, b in zip(first, second, strict=True)],
            [
                ScoringOutput(float(np.dot(by_text[a], by_text[b])))
                for a, b in zip(first, second, strict=True)
            ],
        )

    def _encode_pair(self, first: str, second: str) -> tuple[list[int], int | None]:
        """A pair as the tokenizer gives it to transformers; the second text's
        first index where the tokenizer marks segments (BERT), else None."""
        encoded = self.tokenizer._hf(first, second)
        types = list(encoded.get("token_type_ids") or [])
        return list(encoded["input_ids"]), types.index(1) if 1 in types else None


def _as_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int):
        return [prompts]  # one prompt as token ids
    if not prompts:
        raise ValueError("no prompts")
    return prompts


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _probabilities(logits: np.ndarray) -> list[float]:
    if len(logits) == 1:
        return [_sigmoid(float(logits[0]))]
    return torch.softmax(torch.from_numpy(logits.copy()), dim=0).tolist()
