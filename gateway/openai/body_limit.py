"""Refuse HTTP request bodies over ``--max-request-body-bytes`` with 413 and an OpenAI error body.

A declared Content-Length over the limit is refused before a byte of the body
is read; a chunked body is counted as it arrives and refused as soon as it
passes the limit. Either way the gateway holds at most the limit per request.
The answer is an INVALID_REQUEST error (type ``invalid_request_error``, code
``request_too_large``) with HTTP's own status for it, 413.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvmesh.gateway.openai.errors import error_response
from kvmesh.services.contracts.errors import InvalidRequestError

_PAYLOAD_TOO_LARGE = 413


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _refusal(self) -> InvalidRequestError:
        return InvalidRequestError(
            f"the request body exceeds {self.max_bytes} bytes", code="request_too_large"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await error_response(self._refusal(), _PAYLOAD_TOO_LARGE)(scope, receive, send)
            return
        received = 0
        messages: list[Message] = []
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                await error_response(self._refusal(), _PAYLOAD_TOO_LARGE)(scope, receive, send)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            # The body as read, then whatever comes next (a disconnect, for
            # handlers that watch for one).
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)
