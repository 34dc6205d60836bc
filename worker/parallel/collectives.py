"""The collectives a replica's ranks use each step, over torch.distributed.

gloo on CPU; on CUDA the model's tensors (all-reduce, all-gather, activations)
go over NCCL while the step stream and other host data stay on gloo groups.
Every rank must call the same collectives in the same order: the model
runner's step is identical on every rank up to sampling. The step stream has
a group of its own, because a rank other than the driver receives it on a
thread of its own (worker/parallel/driver.py) while its step thread runs the
model's collectives: two threads never share a group.

A rank stuck in a collective (its peer died or hangs) raises once the process
group's timeout passes; the caller treats that as fatal for the rank, and the
launcher restarts the replica as a whole.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kvmesh.worker.parallel.layout import RankLayout
from kvmesh.worker.parallel.sharding import vocab_shard_size
from kvmesh.worker.step_in_flight import Arrival

logger = logging.getLogger(__name__)

# Bytes of the one broadcast that carries a step to the other ranks.
STEP_CHUNK_BYTES = 16 * 1024


class Collectives:
    """One replica's process groups and the few operations a step needs."""

    def __init__(
        self, layout: RankLayout, init_addr: str, timeout_s: float, device: torch.device
    ) -> None:
        self.layout = layout
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL binds each rank to its current device
        dist.init_process_group(
            backend,
            init_method=f"tcp://{init_addr}",
            rank=layout.rank,
            world_size=layout.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        self.device = device
        # Host data (the step's bytes, sampled tokens) always travels over gloo.
        self.host_group = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD
        # The driver's step stream only (see the module docstring).
        self.step_group = dist.new_group(backend="gloo")
        # Every rank creates every group, in the same order (torch.distributed's rule).
        tp_groups = [
            dist.new_group(layout.tp_group_ranks(p), backend=backend) for p in range(layout.pp_size)
        ]
        self.tp_group = tp_groups[layout.pp_rank]
        logger.info(
            "rank %d of %d (tp %d/%d, pp %d/%d) joined %s via %s",
            layout.rank,
            layout.world_size,
            layout.tp_rank,
            layout.tp_size,
            layout.pp_rank,
            layout.pp_size,
            backend,
            init_addr,
        )

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- tensor parallel -------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum the row-parallel partial outputs of the TP group, in place."""
        dist.all_reduce(x, group=self.tp_group)
        return x

    def all_gather_vocab(self, shard: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Full ``[rows, vocab]`` logits from each rank's equal-width vocab shard."""
        width = vocab_shard_size(vocab_size, self.layout.tp_size)
        if shard.shape[-1] < width:  # the last rank's shard may be short
            shard = F.pad(shard, (0, width - shard.shape[-1]))
        parts = [torch.empty_like(shard) for _ in range(self.layout.tp_size)]
        dist.all_gather(parts, shard.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)[..., :vocab_size]

    # -- pipeline parallel -----------------------------------------------------

    def isend_hidden(self, hidden: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Start sending activations to the next stage: (the tensor, to keep alive
        until the send is waited, and its work). gloo's send waits for the
        receiver to post its receive, so the sender must not wait at once."""
        hidden = hidden.contiguous()
        return hidden, dist.isend(hidden, self.layout.next_stage_rank)

    def recv_hidden(self, like_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        hidden = torch.empty(like_shape, dtype=dtype, device=self.device)
        dist.recv(hidden, self.layout.previous_stage_rank)
        return hidden

    def irecv_hidden(self, like_shape: tuple[int, ...], dtype: torch.dtype) -> Arrival:
        """Post the receive of the previous stage's activations; receives from one
        peer match its sends in order."""
        hidden = torch.empty(like_shape, dtype=dtype, device=self.device)
        return Arrival(hidden, dist.irecv(hidden, self.layout.previous_stage_rank))

    # -- the step and its result (host data, from the driver) ------------------

    def broadcast_step(self, message: bytes | None) -> bytes:
        """The driver's message on every rank (the driver passes it, the others None).

        One broadcast of a fixed ``STEP_CHUNK_BYTES`` buffer (an 8-byte length,
        then the message) carries any step up to that size (a decode step of
        256 running requests is ~10 KB); a larger one sends its rest in a second.
        """
        chunk = torch.zeros(STEP_CHUNK_BYTES, dtype=torch.uint8)
        if message is not None:
            head = len(message).to_bytes(8, "little") + message[: STEP_CHUNK_BYTES - 8]
            chunk[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        dist.broadcast(chunk, 0, group=self.step_group)
        if message is not None:
            if len(message) > STEP_CHUNK_BYTES - 8:
                rest = bytearray(message[STEP_CHUNK_BYTES - 8 :])
                dist.broadcast(torch.frombuffer(rest, dtype=torch.uint8), 0, group=self.step_group)
            return message
        data = chunk.numpy().tobytes()
        length = int.from_bytes(data[:8], "little")
        if length <= STEP_CHUNK_BYTES - 8:
            return data[8 : 8 + length]
        rest = torch.empty(length - (STEP_CHUNK_BYTES - 8), dtype=torch.uint8)
        dist.broadcast(rest, 0, group=self.step_group)
        return data[8:] + rest.numpy().tobytes()

    def all_gather_host(self, value: object) -> list:
        """Every rank's ``value`` (picklable host data), indexed by rank."""
        gathered: list = [None] * self.layout.world_size
        dist.all_gather_object(gathered, value, group=self.host_group)
        return gathered
