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

The door uses the gate's own count and paths, so it refuses exactly the calls
the middleware would refuse at that instant; a call it lets through may still
be refused by the middleware (slots taken since), never the other way round.
Calls without the API key are let through to get their 401 from the app.

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
from uvicorn._types import ASGI3Application
from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

from kvmesh.gateway.admission import AdmissionGate
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

    class DoorProtocol(HttpToolsProtocol):
        accepted_at = 0.0

        def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
            self.accepted_at = self.loop.time()
            super().connection_made(transport)  # type: ignore[arg-type]

        def _start_asgi_task(self, cycle: RequestResponseCycle, app: ASGI3Application) -> None:
            if gate.guards(cycle.scope["path"]) and self._authorized(cycle) and gate.refuses():
                self._refuse(cycle)
                return
            super()._start_asgi_task(cycle, app)

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
            DOOR_REFUSAL_SECONDS.observe(self.loop.time() - self.accepted_at)

    return DoorProtocol
