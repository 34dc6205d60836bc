"""What ``kvmesh up`` decides about each child: when to restart it, when it is hung.

- ``RestartBudget``: restarts are a rate, not a lifetime count, so that a stack
  that runs for weeks keeps healing rare failures while a crash loop (a bad
  flag, a missing model) still stops the launcher.
- ``LivenessWatch``: a process can be alive and useless (stopped, deadlocked).
  Once it has answered its liveness probe, ``failures`` misses in a row mean
  it is hung and must be killed, so that the restart path takes over. Before
  its first answer it is starting (imports, weights), and is left alone.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable


class RestartBudget:
    """At most ``max_restarts`` restarts within any ``window_s`` seconds."""

    def __init__(
        self, max_restarts: int, window_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._clock = clock
        self._times: deque[float] = deque()

    @property
    def recent(self) -> int:
        """Restarts within the window, as of now."""
        horizon = self._clock() - self.window_s
        while self._times and self._times[0] <= horizon:
            self._times.popleft()
        return len(self._times)

    def try_restart(self) -> bool:
        """Count one restart if the budget allows it; False means give up."""
        if self.recent >= self.max_restarts:
            return False
        self._times.append(self._clock())
        return True


class LivenessWatch:
    """Probe results of one child since its last (re)start."""

    def __init__(
        self, period_s: float, failures: int = 3, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.period_s = period_s
        self.failures = failures
        self._clock = clock
        self.restarted()

    def restarted(self) -> None:
        self._answered = False
        self._misses = 0
        self._last_probe = self._clock()

    def due(self) -> bool:
        return self.period_s > 0 and self._clock() - self._last_probe >= self.period_s

    def record(self, alive: bool) -> bool:
        """One probe's answer; True when the child is now judged hung."""
        self._last_probe = self._clock()
        if alive:
            self._answered, self._misses = True, 0
            return False
        if not self._answered:
            return False  # still starting
        self._misses += 1
        return self._misses >= self.failures
