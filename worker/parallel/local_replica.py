"""Spawn a replica's ranks as local processes (tests and benchmarks; ``kvmesh up`` has its own).

``target(layout, init_addr, *args, out)`` runs in each rank's process; rank 0
puts one result on ``out``, which ``run_local_replica`` returns once every
rank has exited.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any

from kvmesh.services.runtime.ports import free_ports
from kvmesh.worker.parallel.layout import RankLayout

# Ranks fork from a server process that imported these once, instead of each
# spawned rank importing torch and the model code again (~4-5 s of CPU per rank).
# Importing torch starts no threads, so forking after it is safe; a rank's
# threads and its process group are created after the fork.
_FORKSERVER_PRELOAD = ["torch", "torch.distributed", "kvmesh.worker.model_runner"]


def run_local_replica(
    target: Callable[..., None],
    tp_size: int,
    pp_size: int,
    args: tuple[Any, ...],
    timeout_s: float = 600,
) -> Any:
    context = multiprocessing.get_context("forkserver")  # never fork a process running torch
    context.set_forkserver_preload(_FORKSERVER_PRELOAD)
    out = context.Queue()
    address = f"127.0.0.1:{free_ports(1)[0]}"
    processes = [
        context.Process(
            target=target, args=(RankLayout(tp_size, pp_size, rank), address, *args, out)
        )
        for rank in range(tp_size * pp_size)
    ]
    for process in processes:
        process.start()
    try:
        result = out.get(timeout=timeout_s)
    finally:
        for process in processes:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
    codes = [p.exitcode for p in processes]
    if any(codes):
        raise RuntimeError(f"a rank failed: exit codes {codes}")
    return result
