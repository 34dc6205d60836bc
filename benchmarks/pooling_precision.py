"""The accuracy cost of --dtype bfloat16 and --quantization int8/w8a8 for pooling
models: the cosine of each input's embedding to its float32 embedding.

Two models: the default SmolLM2-135M (real trained weights) served as a decoder
embedding model (--runner pooling: last token, normalized), and a
BERT-base-shaped encoder with random weights (mean pooling + Normalize; random
weights say less about a trained model's cost than SmolLM2 does). Inputs are
random token ids of log-uniform lengths in [16, 512].

    python -m benchmarks.pooling_precision --inputs 24
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from benchmarks.embeddings_compare import log_uniform_prompts
from kvmesh.kernels import native
from kvmesh.services.contracts.pooling_params import PoolingParams
from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.services.contracts.step import NewRequestData, SchedulerOutput
from kvmesh.services.runtime.model_prep import default_model_path
from kvmesh.worker.config import ModelConfig
from kvmesh.worker.pooling_runner import PoolingRunner
from tests.encoder_checkpoints import build_embedding_model

SETTINGS = (("float32", ""), ("bfloat16", ""), ("float32", "int8"), ("float32", "w8a8"))


def embed(runner: PoolingRunner, prompts: list[list[int]], step_tokens: int = 2048) -> np.ndarray:
    out: list[np.ndarray] = []
    start = 0
    while start < len(prompts):
        step = SchedulerOutput.make_empty(start)
        used = 0
        while start < len(prompts) and (not step.scheduled_new_reqs or used < step_tokens):
            p = prompts[start]
            step.scheduled_new_reqs.append(
                NewRequestData(str(start), p, [], SamplingParams(pooling=PoolingParams()), [], 0)
            )
            used += len(p)
            start += 1
        result = runner.execute_model(step)
        assert not result.errors, result.errors
        out += [np.frombuffer(result.pooled[r.req_id], "<f4") for r in step.scheduled_new_reqs]
    return np.stack(out)


def report(name: str, build, prompts: list[list[int]]) -> None:
    exact = None
    for dtype, quantization in SETTINGS:
        if quantization == "w8a8" and native.unavailable_reason() is not None:
            print(f"{name} {quantization}: not run ({native.unavailable_reason()})")
            continue
        got = embed(build(dtype, quantization), prompts)
        if exact is None:
            exact = got
            continue
        cosine = (got * exact).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(exact, axis=1)
        label = quantization or dtype
        print(f"{name} {label}: cosine to float32 min {cosine.min():.6f} mean {cosine.mean():.6f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=24)
    args = parser.parse_args()
    torch.manual_seed(0)
    smol = default_model_path()

    def decoder(dtype: str, quantization: str) -> PoolingRunner:
        config = ModelConfig.from_pretrained(smol, dtype=dtype, quantization=quantization or None)
        return PoolingRunner(smol, decoder=config)

    print(f"{args.inputs} inputs, 16-512 tokens log-uniform")
    report(
        "SmolLM2-135M (decoder, last token)", decoder, log_uniform_prompts(args.inputs, 49000, 0)
    )
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_embedding_model(
            Path(tmp) / "bert", dense_dim=None, hidden=768, layers=12, heads=12
        )

        def encoder(dtype: str, quantization: str) -> PoolingRunner:
            return PoolingRunner(folder, dtype=getattr(torch, dtype), quantization=quantization)

        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        report("BERT-base random (mean)", encoder, log_uniform_prompts(args.inputs, vocab, 0))


if __name__ == "__main__":
    main()
