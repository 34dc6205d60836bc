"""What it costs to get each step to a second rank: driver broadcast (gloo) vs a direct gRPC send.

The scheduler keeps one Execute stream to the driver (rank 0), which forwards
each StepRequest's bytes to the other ranks with two gloo broadcasts (length,
bytes; worker/parallel/collectives.py). The alternative the issue names is the
scheduler sending every rank the step itself. Both are measured here between
two processes on this machine, for a decode step of 64 running requests and a
prefill step of 4 new 512-token prompts:

- driver broadcast: the driver re-serializes the decoded request, broadcasts
  it, and the follower decodes it; measured as a ping-pong (the follower
  answers with a one-int broadcast) so both ends are in the time;
- direct send: the same bytes over a gRPC stream to the follower, which
  decodes them and answers one byte (the scheduler would do this once per
  extra rank, on its own event loop).

Prints µs per step for each and their ratio.
Run from the repository root: PYTHONPATH=. python benchmarks/tp_step_broadcast_bench.py
"""

from __future__ import annotations

import asyncio
import multiprocessing
import statistics
import time

import grpc
import torch
import torch.distributed as dist

from kvmesh.protos import worker_pb2
from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.services.contracts.step import NewRequestData, SchedulerOutput
from kvmesh.services.contracts.step_codec import scheduler_output_to_proto
from kvmesh.worker.parallel.collectives import Collectives
from kvmesh.worker.parallel.layout import RankLayout

ROUNDS = 400
_METHOD = "/bench.Echo/Step"


def decode_step(num_running: int) -> worker_pb2.StepRequest:
    step = SchedulerOutput.make_empty(7)
    cached = step.scheduled_cached_reqs
    for i in range(num_running):
        req_id = f"cmpl-{i:08x}-0"
        cached.req_ids.append(req_id)
        cached.new_block_ids.append([1000 + i] if i % 16 == 0 else [])
        cached.num_computed_tokens.append(300 + i)
        step.num_scheduled_tokens[req_id] = 1
    step.total_num_scheduled_tokens = num_running
    return scheduler_output_to_proto(step)


def prefill_step(num_new: int, prompt_len: int) -> worker_pb2.StepRequest:
    step = SchedulerOutput.make_empty(8)
    for i in range(num_new):
        req_id = f"cmpl-{i:08x}-0"
        step.scheduled_new_reqs.append(
            NewRequestData(
                req_id=req_id,
                prompt_token_ids=list(range(1000, 1000 + prompt_len)),
                output_token_ids=[],
                sampling_params=SamplingParams(temperature=0.0),
                block_ids=list(range(i * 32, i * 32 + prompt_len // 16)),
                num_computed_tokens=0,
            )
        )
        step.num_scheduled_tokens[req_id] = prompt_len
    step.total_num_scheduled_tokens = num_new * prompt_len
    return scheduler_output_to_proto(step)


def _gloo_rank(rank: int, address: str, payloads: list[bytes], out) -> None:
    torch.set_num_threads(1)
    collectives = Collectives(RankLayout(1, 2, rank), address, 60, torch.device("cpu"))
    reply = torch.zeros(1, dtype=torch.int64)
    results = []
    for payload in payloads:
        request = worker_pb2.StepRequest.FromString(payload)
        times = []
        for _ in range(ROUNDS):
            start = time.perf_counter()
            if rank == 0:
                collectives.broadcast_step(request.SerializeToString())
            else:
                worker_pb2.StepRequest.FromString(collectives.broadcast_step(None))
            dist.broadcast(reply, 1)
            times.append(time.perf_counter() - start)
        results.append(statistics.median(times))
    if rank == 0:
        out.put(results)
    collectives.close()


def _grpc_server(port: int, ready) -> None:
    async def serve() -> None:
        async def step(requests, context):
            async for data in requests:
                worker_pb2.StepRequest.FromString(data)
                yield b"k"

        server = grpc.aio.server()
        handler = grpc.stream_stream_rpc_method_handler(step)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("bench.Echo", {"Step": handler}),)
        )
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ready.set()
        await server.wait_for_termination()

    asyncio.run(serve())


async def _grpc_client(port: int, payloads: list[bytes]) -> list[float]:
    results = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream(_METHOD)()
        for payload in payloads:
            request = worker_pb2.StepRequest.FromString(payload)
            times = []
            for _ in range(ROUNDS):
                start = time.perf_counter()
                await call.write(request.SerializeToString())
                await call.read()
                times.append(time.perf_counter() - start)
            results.append(statistics.median(times))
        await call.done_writing()
    return results


def main() -> None:
    from kvmesh.services.cli.local_stack import free_ports

    cases = {
        "decode, 64 running": decode_step(64),
        "decode, 256 running": decode_step(256),
        "prefill, 4 x 512 new": prefill_step(4, 512),
    }
    payloads = [c.SerializeToString() for c in cases.values()]
    context = multiprocessing.get_context("spawn")
    gloo_port, grpc_port = free_ports(2)
    out = context.Queue()
    ranks = [
        context.Process(target=_gloo_rank, args=(r, f"127.0.0.1:{gloo_port}", payloads, out))
        for r in range(2)
    ]
    for p in ranks:
        p.start()
    gloo = out.get(timeout=300)
    for p in ranks:
        p.join()
    ready = context.Event()
    server = context.Process(target=_grpc_server, args=(grpc_port, ready), daemon=True)
    server.start()
    ready.wait(60)
    direct = asyncio.run(_grpc_client(grpc_port, payloads))
    server.kill()
    print(f"{'step':<24}{'bytes':>8}{'broadcast µs':>15}{'gRPC send µs':>15}{'ratio':>8}")
    for (name, _), payload, g, d in zip(cases.items(), payloads, gloo, direct, strict=True):
        print(f"{name:<24}{len(payload):>8}{g * 1e6:>15.0f}{d * 1e6:>15.0f}{g / d:>8.2f}")
    print("(medians of round trips: the step out, one small answer back; ratio = broadcast/gRPC)")


if __name__ == "__main__":
    main()
