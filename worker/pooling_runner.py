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

import numpy as np
import torch

from kvmesh.services.contracts.step import ModelRunnerOutput, NewRequestData, SchedulerOutput
from kvmesh.worker.model_loader import iterate_weights
from kvmesh.worker.models.bert import ENCODER_ARCHITECTURES, BertEncoder, EncoderConfig, PackedBatch
from kvmesh.worker.pooler import PoolerSpec, finish_embedding

logger = logging.getLogger(__name__)


def is_pooling_checkpoint(folder: str | Path) -> bool:
    """True for an encoder the pooling runner serves (read from config.json)."""
    config = json.loads((Path(folder) / "config.json").read_text())
    architectures = config.get("architectures") or []
    return bool(architectures) and architectures[0] in ENCODER_ARCHITECTURES


@dataclass(frozen=True)
class PoolingModelInfo:
    """What the gateway needs to validate pooling requests (WorkerInfo fields 19-23)."""

    tasks: tuple[str, ...]
    embedding_dim: int
    matryoshka_dimensions: tuple[int, ...]
    labels: tuple[str, ...]
    max_model_len: int


class PoolingRunner:
    """Runs an encoder checkpoint folder over packed steps."""

    def __init__(
        self,
        folder: str | Path,
        dtype: torch.dtype = torch.float32,
        max_model_len: int | None = None,
        num_threads: int | None = None,
    ) -> None:
        if num_threads:
            torch.set_num_threads(num_threads)
        self.folder = Path(folder)
        self.config = EncoderConfig.from_folder(self.folder)
        self.dtype = dtype
        self.model = BertEncoder(self.config)
        self.model.load_weights(iterate_weights(self.folder, torch.float32))
        self.model.to(dtype).eval()
        self.pooler = PoolerSpec.from_folder(self.folder, is_encoder=True)
        limit = self.config.max_input_tokens
        if self.pooler.max_seq_length:
            limit = min(limit, self.pooler.max_seq_length)
        self.max_model_len = min(limit, max_model_len) if max_model_len else limit
        tasks = ("classify",) if self.config.is_classifier else ("embed",)
        self.info = PoolingModelInfo(
            tasks=tasks,
            embedding_dim=self.pooler.output_dim(self.config.hidden_size),
            matryoshka_dimensions=self.pooler.matryoshka_dimensions,
            labels=self.config.id2label,
            max_model_len=self.max_model_len,
        )
        logger.info(
            "pooling runner: %s, %d layers, pooling %s%s, tasks %s, max_model_len %d, dtype %s",
            self.config.architecture,
            self.config.num_layers,
            self.pooler.pooling_type,
            f" + {len(self.pooler.dense)} Dense" if self.pooler.dense else "",
            ",".join(tasks),
            self.max_model_len,
            dtype,
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
        batch = PackedBatch.pack(
            [r.prompt_token_ids for r in runnable],
            [r.sampling_params.pooling.first_segment_len for r in runnable],  # type: ignore[union-attr]
        )
        hidden = self.model(batch)
        if self.config.is_classifier:
            starts = torch.tensor(batch.cu_seqlens[:-1])
            results = self.model.classify(hidden[starts]).float()
        else:
            results = self.pooler.pool(hidden, batch.seq_lens).float()
        for i, req in enumerate(runnable):
            params = req.sampling_params.pooling
            assert params is not None
            vector = results[i]
            if params.task == "embed":
                vector = finish_embedding(vector, self.pooler, params.normalize, params.dimensions)
            output.pooled[req.req_id] = vector.numpy().astype(np.float32).tobytes()
        return output
