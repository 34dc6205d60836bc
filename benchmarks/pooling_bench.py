"""Embedding throughput: kvmesh's pooling runner (packed, no padding) against
sentence-transformers' ``encode`` (padded batches) on the same inputs, in process.

A BERT-base-sized random checkpoint (12 layers, hidden 768, 12 heads, mean
pooling + Normalize) is built in a temporary folder (no download). Inputs are
random token ids of log-uniform lengths in [16, 512]. Both sides run float32 on
the same threads; the runner gets steps of at most ``--step-tokens`` tokens, as
the scheduler would pack them. Prints inputs/s of each and the ratio.

    python -m benchmarks.pooling_bench --inputs 96
"""

from __future__ import annotations

import argparse
import math
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from kvmesh.services.contracts.pooling_params import PoolingParams
from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.services.contracts.step import NewRequestData, SchedulerOutput
from kvmesh.worker.pooling_runner import PoolingRunner
from tests.encoder_checkpoints import build_embedding_model


def _lengths(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [round(math.exp(rng.uniform(math.log(16), math.log(512)))) for _ in range(n)]


def _steps(prompts: list[list[int]], step_tokens: int) -> list[list[int]]:
    """Indices of the prompts of each step, packed in order under the budget."""
    steps: list[list[int]] = [[]]
    used = 0
    for i, p in enumerate(prompts):
        if used + len(p) > step_tokens and steps[-1]:
            steps.append([])
            used = 0
        steps[-1].append(i)
        used += len(p)
    return steps


def run_kvmesh(runner: PoolingRunner, prompts: list[list[int]], step_tokens: int) -> np.ndarray:
    out: dict[int, np.ndarray] = {}
    for step_id, indices in enumerate(_steps(prompts, step_tokens)):
        step = SchedulerOutput.make_empty(step_id)
        step.scheduled_new_reqs = [
            NewRequestData(str(i), prompts[i], [], SamplingParams(pooling=PoolingParams()), [], 0)
            for i in indices
        ]
        result = runner.execute_model(step)
        for i in indices:
            out[i] = np.frombuffer(result.pooled[str(i)], dtype=np.float32)
    return np.stack([out[i] for i in range(len(prompts))])


def run_sentence_transformers(model, prompts: list[list[int]], batch_size: int) -> np.ndarray:
    """``encode``'s own path (length-sorted padded batches), fed token ids."""
    vectors = []
    order = np.argsort([-len(p) for p in prompts])  # encode sorts by length too
    with torch.inference_mode():
        for start in range(0, len(prompts), batch_size):
            batch = [prompts[i] for i in order[start : start + batch_size]]
            width = max(len(p) for p in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for row, p in enumerate(batch):
                ids[row, : len(p)] = torch.tensor(p)
                mask[row, : len(p)] = 1
            features = {"input_ids": ids, "attention_mask": mask}
            vectors.append(model(features)["sentence_embedding"].numpy())
    stacked = np.concatenate(vectors)
    result = np.empty_like(stacked)
    result[order] = stacked
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=96)
    parser.add_argument("--step-tokens", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' default")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from sentence_transformers import SentenceTransformer

    with tempfile.TemporaryDirectory() as tmp:
        folder = build_embedding_model(
            Path(tmp) / "bert-base", dense_dim=None, hidden=768, layers=12, heads=12
        )
        runner = PoolingRunner(folder)
        st = SentenceTransformer(str(folder), device="cpu")
        st.eval()
        vocab = runner.config.vocab_size
        rng = random.Random(args.seed)
        prompts = [
            [2, *(rng.randrange(5, vocab) for _ in range(n - 2)), 3]
            for n in _lengths(args.inputs, args.seed)
        ]
        tokens = sum(len(p) for p in prompts)
        # Warm both up (first-call allocations, oneDNN primitive caches).
        run_kvmesh(runner, prompts[:4], args.step_tokens)
        run_sentence_transformers(st, prompts[:4], args.batch_size)
        start = time.perf_counter()
        ours = run_kvmesh(runner, prompts, args.step_tokens)
        kvmesh_s = time.perf_counter() - start
        start = time.perf_counter()
        theirs = run_sentence_transformers(st, prompts, args.batch_size)
        st_s = time.perf_counter() - start
    cosine = (ours * theirs).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
    threads = torch.get_num_threads()
    print(f"{args.inputs} inputs, {tokens} tokens (16-512 log-uniform), threads {threads}")
    print(
        f"kvmesh pooling runner (packed, {args.step_tokens}-token steps): "
        f"{args.inputs / kvmesh_s:.2f} inputs/s ({kvmesh_s:.1f} s)"
    )
    print(
        f"sentence-transformers (padded, batch {args.batch_size}): "
        f"{args.inputs / st_s:.2f} inputs/s ({st_s:.1f} s)"
    )
    print(
        f"ratio kvmesh / sentence-transformers: {st_s / kvmesh_s:.2f}x; "
        f"min cosine {cosine.min():.6f}"
    )


if __name__ == "__main__":
    main()
