"""Who waits in what order, and who is preempted when blocks run out.

- fcfs: arrival order; the victim is the most recently admitted running request.
- priority: lower ``priority`` value first, ties by arrival time (as vLLM); the
  victim is the running request with the highest value, latest arrival on ties.

A preempted request goes back to the front of its place in the queue: for fcfs
the very front, for priority wherever its (priority, arrival) puts it.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator

from kvmesh.scheduler.request import Request
from kvmesh.services.runtime.config import SCHEDULING_POLICIES, SchedulingPolicyName, check_choice


class RequestQueue(ABC):
    """The waiting queue. ``peek``/``pop`` give the next request to admit.

    ``peek`` and ``pop`` require a non-empty queue (the scheduler checks
    ``bool(queue)`` first). Requests in it are WAITING or PREEMPTED and hold
    no blocks.
    """

    @abstractmethod
    def add(self, request: Request) -> None:
        """Queue a newly arrived request."""

    @abstractmethod
    def prepend(self, request: Request) -> None:
        """Requeue a preempted request ahead of those that arrived after it."""

    @abstractmethod
    def peek(self) -> Request: ...

    @abstractmethod
    def pop(self) -> Request: ...

    @abstractmethod
    def remove_requests(self, requests: Iterable[Request]) -> None:
        """Drop these requests (aborted or finished while waiting); O(n)."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """Requests in admission order."""

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSQueue(RequestQueue):
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove_requests(self, requests: Iterable[Request]) -> None:
        gone = {id(r) for r in requests}
        self._queue = deque(r for r in self._queue if id(r) not in gone)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue(RequestQueue):
    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        # Tie-break after (priority, arrival) so Requests are never compared.
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        heapq.heappush(
            self._heap, (request.priority, request.arrival_time, next(self._counter), request)
        )

    def prepend(self, request: Request) -> None:
        # (priority, arrival) already puts it ahead of everything that came later.
        self.add(request)

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove_requests(self, requests: Iterable[Request]) -> None:
        gone = {id(r) for r in requests}
        self._heap = [entry for entry in self._heap if id(entry[3]) not in gone]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap, key=lambda e: e[:3]))


class SchedulingPolicy(ABC):
    """Orders requests; never changes them. The Scheduler owns every request and queue.

    Contract:
    - ``make_waiting_queue`` is called once per Scheduler; the queue it returns
      is that scheduler's alone, and it admits in the order ``peek``/``pop`` give.
    - ``select_victim`` is called only when a running request cannot get
      blocks, with the scheduler's running list (non-empty, admission order).
      It must not mutate the list or the requests; the scheduler pops the
      returned index and preempts that request (recompute). The victim may be
      the very request that needs the blocks: it then waits for a later step.
    - Both answers depend only on the requests' fields (priority, arrival
      time, order): the same inputs give the same victim, so runs replay.

    Not thread-safe, like the Scheduler that calls it.
    """

    name: str

    @abstractmethod
    def make_waiting_queue(self) -> RequestQueue:
        """A new, empty waiting queue ordered as this policy admits."""

    @abstractmethod
    def select_victim(self, running: list[Request]) -> int:
        """Index in ``running`` (admission order, non-empty) of the request to preempt."""


class FCFSPolicy(SchedulingPolicy):
    name = SchedulingPolicyName.FCFS

    def make_waiting_queue(self) -> RequestQueue:
        return FCFSQueue()

    def select_victim(self, running: list[Request]) -> int:
        return len(running) - 1


class PriorityPolicy(SchedulingPolicy):
    name = SchedulingPolicyName.PRIORITY

    def make_waiting_queue(self) -> RequestQueue:
        return PriorityQueue()

    def select_victim(self, running: list[Request]) -> int:
        return max(
            range(len(running)),
            key=lambda i: (running[i].priority, running[i].arrival_time, i),
        )


# One class per name that kvmesh.services.runtime.config declares (a test checks both ways).
POLICY_CLASSES: dict[str, type[SchedulingPolicy]] = {
    cls.name: cls for cls in (FCFSPolicy, PriorityPolicy)
}


def make_policy(name: str) -> SchedulingPolicy:
    check_choice("scheduling policy", name, SCHEDULING_POLICIES)
    return POLICY_CLASSES[name]()
