"""The gateway's first bound: how many generation calls it serves at once.

Past the bound a call is refused with 429 before its body is read, tokenized
or sent anywhere, so that refusing costs microseconds however deep the
overload (measured before this gate: with 2,000 calls at once, 429s came 9 s
late, behind the parsing, tokenizing and AddRequest round trips of calls that
were refused anyway). Without tracing, a full gate refuses even earlier, from
the HTTP protocol object (gateway/openai/door.py). The bound defaults to what
the engine can hold, its running batch plus its waiting queue
(``SchedulerInfo``); the scheduler stays the authority and still answers 429
itself when several gateways share it.

A call holds one slot from its first byte to its last (a stream's last event),
whatever its ``n`` or number of prompts: slots bound this gateway's memory and
work; the scheduler bounds engine requests.
"""

from __future__ import annotations

import logging

from starlette.types import ASGIApp, Receive, Scope, Send

from kvmesh.gateway.openai.errors import error_response
from kvmesh.services.contracts.errors import OverloadedError

logger = logging.getLogger(__name__)

# The pooling APIs (gateway/openai/pooling_routes.py) queue engine requests too.
POOLING_PATHS = frozenset(
    {"/v1/embeddings", "/pooling", "/score", "/rerank", "/v1/rerank", "/v2/rerank", "/classify"}
)
# Set in a call's scope["extensions"] by the HTTP door (gateway/openai/door.py),
# which took the call's slot already and gives it back when the call ends.
ADMITTED_EXTENSION = "kvmesh.admitted"
GENERATION_PATHS = (
    frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"}) | POOLING_PATHS
)


class AdmissionGate:
    """A counter with a limit; single event loop, so no lock."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"admission limit must be >= 1, got {limit}")
        self.limit = limit
        self.in_use = 0
        self.refused = 0

    def try_enter(self) -> bool:
        if self.in_use >= self.limit:
            self.refused += 1
            return False
        self.in_use += 1
        return True

    def refuses(self) -> bool:
        """True, and counted as a refusal, when no slot is left; takes no slot either way."""
        if self.in_use >= self.limit:
            self.refused += 1
            return True
        return False

    @staticmethod
    def guards(path: str) -> bool:
        """Whether a call to ``path`` needs a slot (the generation and pooling APIs)."""
        return path in GENERATION_PATHS

    def leave(self) -> None:
        self.in_use -= 1

    def refusal(self) -> OverloadedError:
        return OverloadedError(
            f"this server is at its limit of {self.limit} requests in flight; retry later",
            code="server_overloaded",
        )


class AdmissionMiddleware:
    """Hold a gate slot for each generation call; refuse one at once when none is left."""

    def __init__(self, app: ASGIApp, gate: AdmissionGate) -> None:
        self.app = app
        self.gate = gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or not self.gate.guards(scope["path"])
            or ADMITTED_EXTENSION in scope.get("extensions", {})
        ):
            await self.app(scope, receive, send)
            return
        if not self.gate.try_enter():
            await error_response(self.gate.refusal())(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.gate.leave()
