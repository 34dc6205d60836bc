"""An encoder's embeddings under --dtype bfloat16 and --quantization int8/w8a8:
close to float32 (the cost docs/serving.md states), and really changed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvmesh.kernels import native
from kvmesh.services.contracts.pooling_params import PoolingParams
from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.services.contracts.step import NewRequestData, SchedulerOutput
from kvmesh.worker.models.linear import PackedLinear
from kvmesh.worker.pooling_runner import PoolingRunner
from tests.encoder_checkpoints import build_embedding_model

pytest.importorskip("sentence_transformers")


def _embed(runner: PoolingRunner, prompts: list[list[int]]) -> np.ndarray:
    step = SchedulerOutput.make_empty(1)
    step.scheduled_new_reqs = [
        NewRequestData(f"r{i}", p, [], SamplingParams(pooling=PoolingParams()), [], 0)
        for i, p in enumerate(prompts)
    ]
    out = runner.execute_model(step)
    assert not out.errors, out.errors
    return np.stack(
        [np.frombuffer(out.pooled[f"r{i}"], dtype=np.float32) for i in range(len(prompts))]
    )


@pytest.mark.parametrize(
    ("dtype", "quantization"),
    [(torch.bfloat16, ""), (torch.float32, "int8"), (torch.float32, "w8a8")],
)
def test_reduced_precision_stays_close_to_float32(
    tmp_path: Path, dtype: torch.dtype, quantization: str
) -> None:
    if quantization == "w8a8" and native.unavailable_reason() is not None:
        pytest.skip(f"w8a8 needs the C++ kernels: {native.unavailable_reason()}")
    folder = build_embedding_model(tmp_path / "st", dense_dim=None, hidden=64, heads=4)
    prompts = [[2, *range(5, 5 + n), 3] for n in (3, 40, 120, 17)]
    exact = _embed(PoolingRunner(folder), prompts)
    runner = PoolingRunner(folder, dtype=dtype, quantization=quantization)
    if quantization:
        assert isinstance(runner.encoder.layers[0].qkv, PackedLinear)
    got = _embed(runner, prompts)
    cosine = (got * exact).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(exact, axis=1)
    assert cosine.min() >= 0.99
    assert not np.array_equal(got, exact)
