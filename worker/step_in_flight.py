"""A step between its two halves on one rank: begun (inputs built, this stage's
layers run) and not yet finished (final hidden states back, sampled).

Pipeline overlap runs the first half of step n+1 before the second half of
step n; what the second half needs lives here in between.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvmesh.services.contracts.step import ModelRunnerOutput
from kvmesh.worker.lora.step_batch import LoRABatch
from kvmesh.worker.prompt_logprobs import PromptLogprobsSpan
from kvmesh.worker.step_inputs import StepInputs


class Arrival:
    """A point-to-point receive that may be waited on from two threads, once.

    gloo's ``Work.wait`` of a receive must be called exactly once (a second
    call waits for another message), and ``is_completed`` stays False until
    it was: the worker's event loop waits in a helper thread to learn that the
    last stage's output is back, and the step thread waits again to use it.
    """

    def __init__(self, tensor: torch.Tensor, work: Any) -> None:
        self._tensor = tensor
        self._work = work
        self._lock = threading.Lock()
        self._done = False

    def wait(self) -> torch.Tensor:
        with self._lock:
            if not self._done:
                self._work.wait()
                self._done = True
        return self._tensor


@dataclass
class StepInFlight:
    output: ModelRunnerOutput
    started: float
    # The requests that run (empty: the step computes nothing on this rank).
    req_ids: list[str] = field(default_factory=list)
    inputs: StepInputs | None = None
    prompt_spans: list[PromptLogprobsSpan] = field(default_factory=list)
    lora: LoRABatch | None = None
    prepared: float = 0.0
    # Pipeline parallel: this stage's activations on their way to the next
    # stage (waited before the step completes; the tensors stay alive until then).
    sends: list[tuple[torch.Tensor, Any]] = field(default_factory=list)
    # Pipeline parallel, first stage: the last stage's output, being received.
    final_hidden: Arrival | None = None
    # The driver's sampled token per sampling row (-1: failed), for the other ranks.
    sampled: np.ndarray | None = None
    # Requests dropped by a later step while this one still used their rows:
    # removed once this step completes.
    removals: list[str] = field(default_factory=list)

    @property
    def sample_rows(self) -> np.ndarray:
        if self.inputs is None:
            return np.zeros(0, dtype=np.int64)
        return self.inputs.rows[self.inputs.sample_mask]

    def wait_until_finishable(self) -> None:
        """Block until finishing would not wait for another stage (for a helper thread)."""
        if self.final_hidden is not None:
            self.final_hidden.wait()
