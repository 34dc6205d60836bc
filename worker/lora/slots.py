"""The worker's adapter slots: a small LRU pool of LoRA weights, stacked per projection.

Every (possibly fused) projection of every layer holds one ``[max_loras, ...]``
tensor pair, so an adapter is a slot index and a step mixing adapters needs no
weight copies. The model fuses q/k/v and gate/up into single matmuls; an
adapter still has one A and one B per module, so a fused projection stacks its
modules' A's along the rank (one shrink for all slices) and puts each module's
B in its own output rows and rank columns (a block-diagonal B, one expand).
Columns are packed per slot (an adapter of rank r uses ``r`` per targeted
slice); the rest of the slot stays zero, so a kernel that reads the whole
padded slot (the Triton path) adds exact zeros there.

On CPU, B is stored transposed (``[slots, columns, out]``; ``lora_b`` is a
view of it with the usual shape), the layout the C++ kernel
(kernels/csrc/lora_cpu.cpp) streams along output rows; with the table of
each slot's column and row ranges per slice it reads only B's diagonal
blocks. The torch matmuls take either layout, so the kernel is a switch.

The scheduler never puts more distinct adapters into a step than ``max_loras``,
so ``activate`` can always make room by evicting adapters the step does not use.

Every rank of a tensor/pipeline-parallel replica runs the same ``activate``
calls in the same order, so their slots stay the same as long as every load
ends the same everywhere: an adapter that fails on one rank (a path another
machine lacks) is failed on all of them (``agree_on_failures``), else the
ranks would run different tokens through their collectives.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvmesh.kernels import native as native_kernels
from kvmesh.services.contracts.lora_request import LoRARequest
from kvmesh.worker.lora.adapter import LoRAAdapter
from kvmesh.worker.lora.step_batch import LoRABatch

logger = logging.getLogger(__name__)

# Every rank's load errors (lora_id -> message) merged: what all ranks then fail.
AgreeOnFailures = Callable[[dict[str, str]], dict[str, str]]

# The C++ kernel's calls below this many multiply-adds (~35 µs on one core)
# stay on the calling thread: a decode step's delta is smaller than the wait
# for a second thread on a busy box (kernels/csrc/lora_cpu.cpp).
NATIVE_MIN_PARALLEL_MACS = 1 << 21


@dataclass(frozen=True)
class ProjectionShape:
    """One projection as the model computes it: its input width and output slices."""

    in_features: int
    # (PEFT module name, first output row, rows) per slice of the fused output.
    slices: tuple[tuple[str, int, int], ...]

    @property
    def out_features(self) -> int:
        return sum(size for _, _, size in self.slices)


class ProjectionSlots:
    """One projection's adapter weights for every slot, scaling folded into B."""

    def __init__(
        self,
        shape: ProjectionShape,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.shape = shape
        columns = len(shape.slices) * max_rank
        self.lora_a = torch.zeros(max_loras, columns, shape.in_features, dtype=dtype, device=device)
        # [slots, columns, out] on CPU (the C++ kernel's layout), else None.
        self.lora_b_t: torch.Tensor | None = None
        if device.type == "cpu":
            self.lora_b_t = torch.zeros(max_loras, columns, shape.out_features, dtype=dtype)
            self.lora_b = self.lora_b_t.transpose(1, 2)
        else:
            self.lora_b = torch.zeros(
                max_loras, shape.out_features, columns, dtype=dtype, device=device
            )
        # Columns in use per slot; 0 when the slot's adapter targets no slice here.
        self.num_columns = [0] * max_loras
        # Per slot and slice: (first column, columns, first output row, rows),
        # what the C++ kernel reads of the slot (kernels/csrc/lora_cpu.cpp).
        self.slice_table = torch.zeros(max_loras, len(shape.slices), 4, dtype=torch.int64)
        for index, (_, row, size) in enumerate(shape.slices):
            self.slice_table[:, index, 2:] = torch.tensor([row, size])
        # Set by LoRASlots once at load (worker/lora/setup.py): the C++ kernel.
        self.native = False
        # Calls with fewer multiply-adds run on one thread (tests lower it).
        self.min_parallel_macs = NATIVE_MIN_PARALLEL_MACS

    def fill(self, slot: int, adapter: LoRAAdapter, layer: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.slice_table[slot, :, :2] = 0
        rank, column = adapter.config.rank, 0
        for index, (module, row, size) in enumerate(self.shape.slices):
            weights = adapter.modules.get((layer, module))
            if weights is None:
                continue
            self.slice_table[slot, index, :2] = torch.tensor([column, rank])
            lora_a, lora_b = weights
            self.lora_a[slot, column : column + rank] = lora_a
            self.lora_b[slot, row : row + size, column : column + rank] = (
                lora_b * adapter.config.scaling
            )
            column += rank
        self.num_columns[slot] = column

    def add_delta(self, y: torch.Tensor, x: torch.Tensor, batch: LoRABatch) -> None:
        """y[t] += B_s (A_s x[t]) for every token t of a segment with slot s (in place).

        On CPU the segments are contiguous token runs: the C++ kernel serves
        all of them in one call, or (``native`` off) each adapter is two plain
        matmuls over a row slice, Punica's segmented shrink/expand without any
        gather. Given per-token slots (a GPU step), one launch of the Triton
        kernels serves every adapter.
        """
        if batch.token_slots is not None:
            from kvmesh.kernels.triton_lora import add_lora_triton  # imports triton

            add_lora_triton(y, x, self.lora_a, self.lora_b, batch.token_slots)
            return
        if self.native:
            assert self.lora_b_t is not None and batch.segment_table is not None
            torch.ops.kvmesh.add_lora(
                y,
                x,
                self.lora_a,
                self.lora_b_t,
                batch.segment_table,
                self.slice_table,
                self.min_parallel_macs,
            )
            return
        for start, end, slot in batch.segments:
            columns = self.num_columns[slot]
            if columns:
                shrunk = torch.mm(x[start:end], self.lora_a[slot, :columns].t())
                y[start:end].addmm_(shrunk, self.lora_b[slot, :, :columns].t())


class LoRASlots:
    """``max_loras`` slots, least recently used first out, over every layer's projections."""

    def __init__(
        self,
        layer_shapes: Sequence[dict[str, ProjectionShape]],
        max_loras: int,
        max_rank: int,
        load: Callable[[LoRARequest], LoRAAdapter],
        dtype: torch.dtype,
        device: torch.device,
        agree_on_failures: AgreeOnFailures | None = None,
    ) -> None:
        if max_loras <= 0 or max_rank <= 0:
            raise ValueError("max_loras and max_lora_rank must be positive")
        self.max_loras = max_loras
        self.max_rank = max_rank
        self._load = load
        self._agree_on_failures = agree_on_failures
        self.layers: list[dict[str, ProjectionSlots]] = [
            {
                name: ProjectionSlots(shape, max_loras, max_rank, dtype, device)
                for name, shape in shapes.items()
            }
            for shapes in layer_shapes
        ]
        # lora_id -> slot, least recently used first.
        self._slot_of: OrderedDict[str, int] = OrderedDict()
        self._free = list(range(max_loras - 1, -1, -1))

    @property
    def native(self) -> bool:
        """Whether the C++ kernel computes the delta (else torch matmuls or Triton)."""
        return all(p.native for projections in self.layers for p in projections.values())

    def set_native(self, enabled: bool) -> None:
        """Switch every projection between the C++ kernel and the torch matmuls
        (chosen once at load, worker/lora/setup.py; switched by A/B benchmarks).
        The kernel needs the CPU layout and ``torch.ops.kvmesh`` loaded."""
        reason = native_kernels.unavailable_reason()
        if enabled and reason is not None:
            raise ValueError(f"native kernels unavailable: {reason}")
        for projections in self.layers:
            for projection in projections.values():
                if enabled and projection.lora_b_t is None:
                    raise ValueError("the C++ LoRA kernel runs on CPU only")
                projection.native = enabled

    @property
    def loaded_ids(self) -> list[str]:
        """Adapters in slots, least recently used first."""
        return list(self._slot_of)

    def activate(self, wanted: dict[str, LoRARequest]) -> tuple[dict[str, int], dict[str, str]]:
        """Slots for one step's adapters, loading missing ones.

        Returns (slot by lora_id, error by lora_id): an adapter that fails to
        load (here or, with ``agree_on_failures``, on another rank), or one
        past ``max_loras`` distinct adapters, gets an error and no slot; the
        others are unaffected.
        """
        slots: dict[str, int] = {}
        errors: dict[str, str] = {}
        for lora_id in wanted:
            if lora_id in self._slot_of:
                self._slot_of.move_to_end(lora_id)
                slots[lora_id] = self._slot_of[lora_id]
        attempted = False
        for lora_id, lora in wanted.items():
            if lora_id in slots:
                continue
            attempted = True
            slot = self._take_slot(keep=slots)
            if slot is None:
                errors[lora_id] = f"more than max_loras={self.max_loras} adapters in one step"
                continue
            try:
                self._fill(slot, self._load(lora))
            except (OSError, ValueError, RuntimeError) as exc:
                self._free.append(slot)
                errors[lora_id] = f"LoRA adapter {lora.lora_name!r} failed to load: {exc}"
                logger.warning("adapter %s (%s): %s", lora.lora_name, lora.lora_path, exc)
                continue
            self._slot_of[lora_id] = slot
            slots[lora_id] = slot
            logger.info("adapter %s loaded into slot %d", lora.lora_name, slot)
        # Whether this call loads anything is the same on every rank (same calls,
        # same slots so far), so either all of them agree here or none does.
        if attempted and self._agree_on_failures is not None:
            for lora_id, message in self._agree_on_failures(errors).items():
                if lora_id in errors:
                    continue
                # Loaded here, failed on another rank: fail it here too.
                slot = slots.pop(lora_id)
                del self._slot_of[lora_id]
                self._free.append(slot)
                errors[lora_id] = message
        return slots, errors

    def _take_slot(self, keep: dict[str, int]) -> int | None:
        if self._free:
            return self._free.pop()
        for lora_id, slot in self._slot_of.items():  # least recently used first
            if lora_id not in keep:
                del self._slot_of[lora_id]
                return slot
        return None

    def _fill(self, slot: int, adapter: LoRAAdapter) -> None:
        for layer, projections in enumerate(self.layers):
            for projection in projections.values():
                projection.fill(slot, adapter, layer)
