"""What the driver broadcasts to the other ranks: a step, a reset, a keep-alive or the end.

One tag byte, then for a step the serialized ``StepRequest`` exactly as the
scheduler sent it (no re-encoding on the driver; each rank decodes it itself).
"""

from __future__ import annotations

from enum import Enum

STEP = b"S"
RESET = b"R"  # the scheduler detached: every rank clears its persistent batch
STOP = b"Q"  # the driver is shutting down: the other ranks exit
# Nothing to run: sent while the replica idles, so that a rank waiting for the
# next step never waits past the collective timeout (which would end it), and
# a rank that died while idle is noticed by the driver's next keep-alive.
KEEPALIVE = b"K"


class MessageKind(Enum):
    STEP = STEP
    RESET = RESET
    STOP = STOP
    KEEPALIVE = KEEPALIVE


def step_message(step_request_bytes: bytes) -> bytes:
    return STEP + step_request_bytes


def parse_message(message: bytes) -> tuple[MessageKind, bytes]:
    """(kind, the StepRequest's bytes for a step, else b"")."""
    kind = MessageKind(message[:1])
    return kind, message[1:]
