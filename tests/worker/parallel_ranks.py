"""Run one replica's ranks as spawned processes on CPU (gloo), for the parallel tests.

Rank 0 drives a LocalDriver through a StepBroadcaster, exactly the path the
worker service takes; the other ranks follow. Rank 0 puts each request's
output tokens and logprobs on a queue.
"""

from __future__ import annotations

import multiprocessing
import socket
from dataclasses import dataclass

import torch

from services.sampling_params import SamplingParams
from worker.config import CacheConfig, ModelConfig
from worker.local_driver import LocalDriver
from worker.model_runner import ModelRunner
from worker.parallel.collectives import Collectives
from worker.parallel.driver import BroadcastingRunner, StepBroadcaster, follow_driver
from worker.parallel.layout import RankLayout

MAX_NEW_TOKENS = 6
TOP_LOGPROBS = 5
# Each request's greedy tokens, then per sampled token its (token, logprob) top list.
Result = dict[str, tuple[list[int], list[list[tuple[int, float]]]]]


@dataclass(frozen=True)
class RunSpec:
    checkpoint: str
    prompts: list[list[int]]
    chunk_size: int | None = None
    dense: bool = False  # plain F.linear instead of oneDNN / block codes


def free_address() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def build_runner(spec: RunSpec, collectives: Collectives | None) -> ModelRunner:
    runner = ModelRunner(
        ModelConfig.from_pretrained(spec.checkpoint, max_model_len=128),
        CacheConfig(block_size=16, num_kv_blocks=64),
        num_threads=1,
        collectives=collectives,
    )
    if spec.dense:
        runner.model.pack_weights(use_onednn=False, use_native=False)
    return runner


def drive(runner, spec: RunSpec) -> Result:
    driver = LocalDriver(runner, chunk_size=spec.chunk_size)
    params = SamplingParams(temperature=0.0, logprobs=TOP_LOGPROBS)
    for index, prompt in enumerate(spec.prompts):
        driver.add_request(f"r{index}", prompt, params, max_new_tokens=MAX_NEW_TOKENS)
    finished = driver.run()
    return {
        req_id: (
            request.output_token_ids,
            [
                [(lp.token_id, lp.logprob), *zip(lp.top_token_ids, lp.top_logprobs, strict=True)]
                for lp in request.logprobs
            ],
        )
        for req_id, request in finished.items()
    }


def _rank_main(layout: RankLayout, address: str, spec: RunSpec, results) -> None:
    collectives = Collectives(layout, address, timeout_s=60, device=torch.device("cpu"))
    try:
        runner = build_runner(spec, collectives)
        if not layout.is_driver:
            follow_driver(runner, collectives)
            return
        broadcaster = StepBroadcaster(runner, collectives)
        try:
            broadcaster.keep_alive()  # what an idle driver sends: the others wait on
            results.put(drive(BroadcastingRunner(broadcaster), spec))
        finally:
            broadcaster.stop()
    finally:
        collectives.close()


def run_replica(tp_size: int, pp_size: int, spec: RunSpec, timeout_s: float = 240) -> Result:
    """Greedy results of a TP x PP replica of spawned ranks."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    address = free_address()
    processes = [
        context.Process(
            target=_rank_main, args=(RankLayout(tp_size, pp_size, rank), address, spec, results)
        )
        for rank in range(tp_size * pp_size)
    ]
    for process in processes:
        process.start()
    try:
        result = results.get(timeout=timeout_s)
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    assert all(p.exitcode == 0 for p in processes), [p.exitcode for p in processes]
    return result


def run_single(spec: RunSpec) -> Result:
    return drive(build_runner(spec, None), spec)
