"""429 from the HTTP protocol object: a full gateway refuses a generation call before the ASGI app.

``AdmissionMiddleware`` (gateway/admission.py) already refused before reading
the body, yet 6,000 calls at once against a bound of 600 got their 429s up to
6.8 s late (docs/performance.md, issue 43): each refusal still cost an asyncio
task, an ASGI scope walk through five middlewares and a ``JSONResponse``. Here
the refusal is written from uvicorn's protocol callback that would have
started that task, as soon as the request line and headers are parsed: no
task, no middleware, one ``transport.write`` of prebuilt bytes. The body is
never looked at (httptools skips it while the answer is complete), so the
same connection can carry the next request when the client kept it alive.

The door takes the gate's slot itself, when the headers are parsed: a burst
has thousands of requests parsed before the first of their tasks runs, so a
slot taken later (as the middleware does) leaves the door seeing an empty gate
(measured: 0 of 5,400 refusals came from a door that only looked). The slot is
held until the call's ASGI task ends, as the middleware holds it, and the
middleware skips calls that carry ``ADMITTED_EXTENSION``. Calls without the
API key are let through without a slot to get their 401 from the app.

``kvmesh_gateway_door_refusal_seconds`` times each refusal from the
connection's accept (``connection_made``) to its 429 written: the part of a
refusal's latency the gateway owns. A client's connect-to-429 minus it is time
in the kernel's accept queue and in the client itself.
"""

from __future__ import annotations

import asyncio
import hmac
import json

from prometheus_client import Histogram
from uvicorn._types import ASGI3Application, ASGIReceiveCallable, ASGISendCallable, Scope
from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

from kvmesh.gateway.admission import ADMITTED_EXTENSION, AdmissionGate
from kvmesh.gateway.openai.errors import RETRY_AFTER_S, error_body

_OVERLOADED = 429

# Exposed as kvmesh_gateway_door_refusal_seconds_{bucket,count,sum}.
DOOR_REFUSAL_SECONDS = Histogram(
    "kvmesh_gateway_door_refusal_seconds",
    "Seconds from a connection's accept to the 429 the full gateway wrote on it "
    "(calls refused before the ASGI app).",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)


def _refusal_head_and_body(gate: AdmissionGate) -> tuple[bytes, bytes]:
    """The 429's fixed headers and body: the same JSON the middleware's ``error_response`` sends."""
    body = json.dumps(
        error_body(gate.refusal()), ensure_ascii=False, allow_nan=False, separators=(",", ":")
    ).encode()
    head = (
        b"content-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n"
        b"retry-after: " + str(RETRY_AFTER_S).encode() + b"\r\n"
    )
    return head, body


def door_protocol(gate: AdmissionGate, api_key: str | None) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol that answers 429 itself while ``gate`` is full."""
    expected_auth = f"Bearer {api_key}".encode() if api_key else None
    head, body = _refusal_head_and_body(gate)

    def holding_the_slot(app: ASGI3Application) -> ASGI3Application:
        async def admitted(
            scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
        ) -> None:
            try:
                await app(scope, receive, send)
            finally:
                gate.leave()

        return admitted

    class DoorProtocol(HttpToolsProtocol):
        # When this request started: the connection's accept for its first
        # request, the request's first byte for later ones (keep-alive).
        started_at = 0.0
        requests_begun = 0

        def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
            self.started_at = self.loop.time()
            super().connection_made(transport)  # type: ignore[arg-type]

        def on_message_begin(self) -> None:
            if self.requests_begun:
                self.started_at = self.loop.time()
            self.requests_begun += 1
            super().on_message_begin()

        def _start_asgi_task(self, cycle: RequestResponseCycle, app: ASGI3Application) -> None:
            if not (gate.guards(cycle.scope["path"]) and self._authorized(cycle)):
                super()._start_asgi_task(cycle, app)
            elif gate.try_enter():
                # The slot is taken here, not when the task first runs: a burst
                # parses thousands of requests before any of their tasks starts.
                cycle.scope.setdefault("extensions", {})[ADMITTED_EXTENSION] = {}
                super()._start_asgi_task(cycle, holding_the_slot(app))
            else:
                self._refuse(cycle)

        def _authorized(self, cycle: RequestResponseCycle) -> bool:
            if expected_auth is None:
                return True
            sent = next((v for k, v in cycle.scope["headers"] if k == b"authorization"), b"")
            return hmac.compare_digest(sent, expected_auth)

        def _refuse(self, cycle: RequestResponseCycle) -> None:
            parts = [STATUS_LINE[_OVERLOADED]]
            for name, value in self.server_state.default_headers:
                parts += [name, b": ", value, b"\r\n"]
            parts.append(head)
            if not cycle.keep_alive:
                parts.append(b"connection: close\r\n")
            parts += [b"\r\n", body]
            self.transport.write(b"".join(parts))
            # What RequestResponseCycle.send does after a response's last byte:
            # the rest of this body is skipped, and the connection closes or
            # waits for the next request.
            cycle.response_started = cycle.response_complete = True
            cycle.message_event.set()
            if not cycle.keep_alive:
                self.transport.close()
            cycle.on_response()
            DOOR_REFUSAL_SECONDS.observe(self.loop.time() - self.started_at)

    return DoorProtocol
