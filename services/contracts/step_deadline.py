"""How long one engine step may take before its worker counts as hung.

A dead worker breaks its stream at once; a hung one (stopped, deadlocked in a
kernel, swapping) just stops answering, and every request in flight would
wait for the transport's own timeouts. The deadline is derived from the steps
actually measured, so it follows the hardware and the model:

    deadline = clamp(p99_factor * p99 * scale, min_s, cold_s)

where ``p99`` is over the last ``window`` steps and ``scale`` stretches it for
a step with more tokens than any of them (a long prefill after a run of
decodes), linearly, which overestimates: compute grows slower than tokens.
The first ``warm_steps`` steps of a worker (a cold start: first-use kernel
compiles, weight reorders, page faults) get ``cold_s`` and are left out of the
measurements, which they would dominate for a long time (measured: the first
step of the 2-core dev box took ~1 s, decode steps after it ~30 ms).

The scheduler fails a step over when its worker misses the deadline; the
worker marks itself not alive when its own step overruns it, so that an
orchestrator restarts it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvmesh.services.runtime.config import StepDeadlineOptions


@dataclass(frozen=True)
class StepDeadlinePolicy:
    min_s: float = 10.0
    p99_factor: float = 20.0
    cold_s: float = 300.0
    window: int = 256
    warm_steps: int = 8

    def __post_init__(self) -> None:
        if not 0 < self.min_s <= self.cold_s:
            raise ValueError("need 0 < min_s <= cold_s")
        if self.p99_factor < 1 or self.window < 1 or self.warm_steps < 0:
            raise ValueError("need p99_factor >= 1, window >= 1 and warm_steps >= 0")

    @classmethod
    def from_options(cls, options: StepDeadlineOptions) -> StepDeadlinePolicy:
        return cls(
            min_s=options.step_deadline_min_s,
            p99_factor=options.step_deadline_p99_factor,
            cold_s=options.step_deadline_cold_s,
        )


class StepDeadline:
    """Recent step durations and the deadline they imply for the next step."""

    def __init__(self, policy: StepDeadlinePolicy | None = None) -> None:
        self.policy = policy or StepDeadlinePolicy()
        self._seconds: deque[float] = deque(maxlen=self.policy.window)
        self._tokens: deque[int] = deque(maxlen=self.policy.window)
        self._num_cold_steps = 0

    @property
    def warm(self) -> bool:
        return bool(self._seconds)

    def record(self, seconds: float, num_tokens: int) -> None:
        if self._num_cold_steps < self.policy.warm_steps:
            self._num_cold_steps += 1
            return
        self._seconds.append(seconds)
        self._tokens.append(num_tokens)

    def reset(self) -> None:
        """Forget every measurement: a new worker starts cold."""
        self._seconds.clear()
        self._tokens.clear()
        self._num_cold_steps = 0

    def for_step(self, num_tokens: int) -> float:
        """Seconds a step of ``num_tokens`` tokens may take."""
        policy = self.policy
        if not self.warm:
            return policy.cold_s
        ordered = sorted(self._seconds)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        scale = max(1.0, num_tokens / max(1, max(self._tokens)))
        return min(policy.cold_s, max(policy.min_s, policy.p99_factor * p99 * scale))
