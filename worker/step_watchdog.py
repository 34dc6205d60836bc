"""The worker's own view of a hung step: liveness fails while a step is overdue.

The scheduler fails a worker over when a step misses its deadline, but only an
orchestrator can restart the process, and it asks the worker itself. A step
stuck in a kernel leaves the event loop free to answer health checks, so the
loop watches the step thread: while the running step is older than its
deadline (``kvmesh.services.contracts.step_deadline``) the liveness service says NOT_SERVING,
and so does readiness, so that the scheduler, which failed the worker over,
does not attach to it again before the step ends. A worker that is stopped
outright answers nothing, which fails the probes too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator

from kvmesh.services.contracts.step_deadline import StepDeadline

logger = logging.getLogger(__name__)


class StepWatchdog:
    """Times each step (on the event loop) and reports when one overruns."""

    def __init__(
        self,
        deadline: StepDeadline,
        set_alive: Callable[[bool], Awaitable[None]],  # liveness (and readiness) on/off
        poll_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.deadline = deadline
        self._set_alive = set_alive
        self._poll_s = poll_s
        self._clock = clock
        # (start, tokens, deadline) of the step running now.
        self._running: tuple[float, int, float] | None = None
        self.alive = True

    @contextlib.contextmanager
    def step(self, num_tokens: int) -> Iterator[None]:
        """Wrap one step's execution; its duration joins the measurements."""
        started = self._clock()
        self._running = (started, num_tokens, self.deadline.for_step(num_tokens))
        try:
            yield
        finally:
            self._running = None
            self.deadline.record(self._clock() - started, num_tokens)

    def overdue(self) -> bool:
        running = self._running
        return running is not None and self._clock() - running[0] > running[2]

    async def check(self) -> None:
        """Flip liveness when the running step crosses its deadline (and back after)."""
        overdue = self.overdue()
        if overdue == (not self.alive):
            return
        if overdue:
            assert self._running is not None
            started, num_tokens, deadline = self._running
            logger.error(
                "step of %d tokens running for %.1fs, past its %.1fs deadline: not alive",
                num_tokens,
                self._clock() - started,
                deadline,
            )
        else:
            logger.warning("the overdue step ended; alive again")
        self.alive = not overdue
        await self._set_alive(self.alive)

    async def run(self) -> None:
        """Check forever (cancel to stop)."""
        while True:
            await asyncio.sleep(self._poll_s)
            await self.check()
