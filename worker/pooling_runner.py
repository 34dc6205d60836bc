"""The pooling runner: one forward over a step's packed prompts, one vector each.

It stands where the ModelRunner stands for generation (the worker service
calls ``execute_model`` per step and ``reset`` when a scheduler detaches), but
it holds no KV cache and no persistent batch: the scheduler sends each
pooling request once, with its whole prompt, and the request is finished by
that step. The answer is ``ModelRunnerOutput.pooled``: the embedding (the
checkpoint's pooling pipeline, worker/pooler.py) or the classifier's logits.
A request that fails (an input the model cannot hold) fails alone.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvmesh.services.contracts.step import ModelRunnerOutput, NewRequestData, SchedulerOutput
from kvmesh.worker.config import ModelConfig
from kvmesh.worker.decoder_pooling import DecoderBackbone, TokenClassifier
from kvmesh.worker.model_loader import iterate_weights
from kvmesh.worker.models.bert import ENCODER_ARCHITECTURES, BertEncoder, EncoderConfig, PackedBatch
from kvmesh.worker.pooler import PoolerSpec, finish_embedding

logger = logging.getLogger(__name__)


def checkpoint_architecture(folder: str | Path) -> str:
    """The first ``architectures`` name of the folder's config.json ("" if none)."""
    config = json.loads((Path(folder) / "config.json").read_text())
    architectures = config.get("architectures") or [""]
    return str(architectures[0])


def is_pooling_checkpoint(folder: str | Path) -> bool:
    """True for an encoder the pooling runner serves (read from config.json)."""
    return checkpoint_architecture(folder) in ENCODER_ARCHITECTURES


@dataclass(frozen=True)
class PoolingModelInfo:
    """What the gateway needs to validate pooling requests (WorkerInfo fields 19-23)."""

    tasks: tuple[str, ...]
    embedding_dim: int
    matryoshka_dimensions: tuple[int, ...]
    labels: tuple[str, ...]
    max_model_len: int


class PoolingRunner:
    """Runs an encoder checkpoint folder, or a decoder converted to pooling
    (``decoder``: its ModelConfig, which carries its dtype and quantization;
    worker/decoder_pooling.py), over packed steps. ``quantization``: an
    encoder's projections as int8 codes (BertEncoder.pack)."""

    def __init__(
        self,
        folder: str | Path,
        dtype: torch.dtype = torch.float32,
        max_model_len: int | None = None,
        num_threads: int | None = None,
        *,
        quantization: str = "",
        decoder: ModelConfig | None = None,
        convert: str = "embed",
        hf_overrides: dict[str, Any] | None = None,
    ) -> None:
        if num_threads:
            torch.set_num_threads(num_threads)
        self.folder = Path(folder)
        self.encoder: BertEncoder | None = None
        self.decoder: DecoderBackbone | None = None
        self.token_classifier: TokenClassifier | None = None
        if decoder is None:
            self.config = EncoderConfig.from_folder(self.folder)
            self.dtype = dtype
            self.encoder = BertEncoder(self.config)
            self.encoder.load_weights(iterate_weights(self.folder, torch.float32))
            self.encoder.to(dtype).eval()
            self.encoder.pack(quantization)
            architecture, num_layers = self.config.architecture, self.config.num_layers
            hidden_size, limit = self.config.hidden_size, self.config.max_input_tokens
            self.vocab_size = self.config.vocab_size
            is_classifier, labels = self.config.is_classifier, self.config.id2label
        else:
            self.dtype = decoder.dtype
            self.decoder = DecoderBackbone(decoder)
            architecture, num_layers = decoder.architecture, decoder.num_layers
            hidden_size, limit = decoder.hidden_size, decoder.max_model_len
            self.vocab_size = decoder.vocab_size
            is_classifier = convert == "classify"
            if is_classifier:
                from transformers import AutoTokenizer  # the tokens' ids, at start-up only

                self.token_classifier = TokenClassifier.from_overrides(
                    hf_overrides or {}, AutoTokenizer.from_pretrained(decoder.path)
                )
                if self.token_classifier is None:
                    raise ValueError("--convert classify needs hf_overrides classifier_from_token")
            num_labels = self.token_classifier.num_labels if self.token_classifier else 0
            labels = tuple(f"LABEL_{i}" for i in range(num_labels))
        self.is_classifier = is_classifier
        self.pooler = PoolerSpec.from_folder(self.folder, is_encoder=decoder is None)
        if self.pooler.max_seq_length:
            limit = min(limit, self.pooler.max_seq_length)
        self.max_model_len = min(limit, max_model_len) if max_model_len else limit
        tasks = ("classify",) if is_classifier else ("embed",)
        self.info = PoolingModelInfo(
            tasks=tasks,
            embedding_dim=self.pooler.output_dim(hidden_size),
            matryoshka_dimensions=self.pooler.matryoshka_dimensions,
            labels=labels,
            max_model_len=self.max_model_len,
        )
        logger.info(
            "pooling runner: %s, %d layers, pooling %s%s, tasks %s, max_model_len %d, dtype %s",
            architecture,
            num_layers,
            self.pooler.pooling_type,
            f" + {len(self.pooler.dense)} Dense" if self.pooler.dense else "",
            ",".join(tasks),
            self.max_model_len,
            self.dtype,
        )

    def reset(self) -> None:
        """Nothing persists between steps."""

    def _refusal(self, req: NewRequestData) -> str | None:
        params = req.sampling_params.pooling
        if params is None:
            return "a pooling model serves pooling requests only (embeddings, score, classify)"
        if params.task not in self.info.tasks:
            return f"this model serves {', '.join(self.info.tasks)}, not {params.task!r}"
        if not req.prompt_token_ids:
            return "empty input"
        if len(req.prompt_token_ids) > self.max_model_len:
            return (
                f"input of {len(req.prompt_token_ids)} tokens exceeds the model's maximum "
                f"of {self.max_model_len}"
            )
        return None

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        output = ModelRunnerOutput.make_empty(scheduler_output.step_id)
        runnable: list[NewRequestData] = []
        for req in scheduler_output.scheduled_new_reqs:
            refusal = self._refusal(req)
            if refusal is None:
                runnable.append(req)
            else:
                output.errors[req.req_id] = refusal
        if not runnable:
            return output
        results = self._results(runnable)
        for i, req in enumerate(runnable):
            params = req.sampling_params.pooling
            assert params is not None
            vector = results[i]
            if params.task == "embed":
                vector = finish_embedding(vector, self.pooler, params.normalize, params.dimensions)
            output.pooled[req.req_id] = vector.cpu().numpy().astype(np.float32).tobytes()
        return output

    def _results(self, runnable: list[NewRequestData]) -> torch.Tensor:
        """``[num_reqs, dim]``: each request's pooled vector (before its Matryoshka
        cut and normalization) or its classifier logits, in float32."""
        prompts = [r.prompt_token_ids for r in runnable]
        if self.decoder is not None:
            if self.is_classifier or self.pooler.pooling_type == "last":
                # Only the last rows are read: the last layer computes just those.
                last = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
                states = self.decoder.forward(prompts, last)
                if self.token_classifier is not None:
                    return self.token_classifier.logits(self.decoder.vocab_logits(states))
                return self.pooler.pool(states, [1] * len(prompts)).float()
            hidden = self.decoder.forward(prompts)
            return self.pooler.pool(hidden, [len(p) for p in prompts]).float()
        assert self.encoder is not None
        batch = PackedBatch.pack(
            prompts,
            [r.sampling_params.pooling.first_segment_len for r in runnable],  # type: ignore[union-attr]
        )
        hidden = self.encoder(batch)
        if self.is_classifier:
            starts = torch.tensor(batch.cu_seqlens[:-1])
            return self.encoder.classify(hidden[starts]).float()
        return self.pooler.pool(hidden, batch.seq_lens).float()
