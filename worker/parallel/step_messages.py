"""The driver's stream to the other ranks: one ordered message per broadcast.

A message is one tag byte, the tokens the driver sampled in the steps it
finished since its previous message, then the kind's payload:

- STEP: the serialized ``StepRequest`` exactly as the scheduler sent it (no
  re-encoding on the driver; each rank decodes it itself): begin that step;
- FINISH: finish the oldest begun step (stage 0 computes its logits);
- RESET, STOP, KEEPALIVE (below).

Tokens ride on the next message rather than a broadcast of their own, so a
stage that is still running an earlier step never holds the driver up, and
they always arrive before any step that could schedule their requests again
(the scheduler sees a step's tokens only after the driver finished it).
Encoding: ``u32`` count of finished steps, then per step a ``u32`` count and
that many little-endian ``int64`` tokens (-1: the row failed on the driver).
"""

from __future__ import annotations

import struct
from enum import Enum

import numpy as np

STEP = b"S"
FINISH = b"F"
RESET = b"R"  # the scheduler detached: every rank clears its persistent batch
STOP = b"Q"  # the driver is shutting down: the other ranks exit
# Nothing to run: sent while the replica idles, so that a rank waiting for the
# next step never waits past the collective timeout (which would end it), and
# a rank that died while idle is noticed by the driver's next keep-alive.
KEEPALIVE = b"K"

_COUNT = struct.Struct("<I")
_TOKEN = np.dtype("<i8")


class MessageKind(Enum):
    STEP = STEP
    FINISH = FINISH
    RESET = RESET
    STOP = STOP
    KEEPALIVE = KEEPALIVE


def encode_message(
    kind: MessageKind, sampled: list[np.ndarray] | None = None, payload: bytes = b""
) -> bytes:
    sampled = sampled or []
    parts = [kind.value, _COUNT.pack(len(sampled))]
    for tokens in sampled:
        parts.append(_COUNT.pack(len(tokens)))
        parts.append(np.ascontiguousarray(tokens, dtype=_TOKEN).tobytes())
    parts.append(payload)
    return b"".join(parts)


def parse_message(message: bytes) -> tuple[MessageKind, list[np.ndarray], bytes]:
    """(kind, the tokens of each step finished since the last message, payload)."""
    kind = MessageKind(message[:1])
    offset = 1
    (num_steps,) = _COUNT.unpack_from(message, offset)
    offset += _COUNT.size
    sampled: list[np.ndarray] = []
    for _ in range(num_steps):
        (count,) = _COUNT.unpack_from(message, offset)
        offset += _COUNT.size
        sampled.append(np.frombuffer(message, dtype=_TOKEN, count=count, offset=offset).copy())
        offset += count * _TOKEN.itemsize
    return kind, sampled, message[offset:]
