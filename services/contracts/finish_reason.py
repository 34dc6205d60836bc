"""Why a request ended: the one owner of the finish reasons and their names.

``FinishReason.value`` is the OpenAI ``finish_reason`` string the gateway
sends; the wire name is ``common.proto``'s ``FINISH_REASON_<NAME>``, derived
from the member's name rather than restated in a table, so adding a reason
means adding it here and to the proto enum (a test checks both agree).
"Not finished" is ``None`` here and ``FINISH_REASON_UNSPECIFIED`` on the wire.
"""

from __future__ import annotations

import enum

from kvmesh.protos import common_pb2

_PROTO_PREFIX = "FINISH_REASON_"


class FinishReason(enum.Enum):
    """Why a request ended; ``.value`` is the OpenAI ``finish_reason`` string."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"

    def to_proto(self) -> common_pb2.FinishReason.ValueType:
        return common_pb2.FinishReason.Value(_PROTO_PREFIX + self.name)


# Both directions computed once from the names (the gateway converts every delta).
_TO_PROTO: dict[FinishReason | None, common_pb2.FinishReason.ValueType] = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    **{reason: reason.to_proto() for reason in FinishReason},
}
_FROM_PROTO = {value: reason for reason, value in _TO_PROTO.items()}


def finish_reason_to_proto(reason: FinishReason | None) -> common_pb2.FinishReason.ValueType:
    """The wire value of ``reason``; UNSPECIFIED for a request that goes on."""
    return _TO_PROTO[reason]


def finish_reason_from_proto(value: int) -> FinishReason | None:
    """The reason a wire value names; None for UNSPECIFIED (not finished).

    ValueError for a number this build's proto does not know.
    """
    try:
        return _FROM_PROTO[value]
    except KeyError:
        raise ValueError(f"unknown finish reason {value}") from None
