"""services/contracts/finish_reason.py: the one owner of finish reasons agrees with the wire."""

from __future__ import annotations

import pytest

from kvmesh.protos import common_pb2
from kvmesh.services.contracts.finish_reason import (
    FinishReason,
    finish_reason_from_proto,
    finish_reason_to_proto,
)


def test_every_proto_reason_is_a_finish_reason_and_back() -> None:
    finished = [v for v in common_pb2.FinishReason.values() if v != 0]
    assert {finish_reason_from_proto(v) for v in finished} == set(FinishReason)
    for value in finished:
        reason = finish_reason_from_proto(value)
        assert reason is not None
        assert finish_reason_to_proto(reason) == value


def test_unfinished_is_none_and_unspecified() -> None:
    assert finish_reason_from_proto(common_pb2.FINISH_REASON_UNSPECIFIED) is None
    assert finish_reason_to_proto(None) == common_pb2.FINISH_REASON_UNSPECIFIED


def test_values_are_openai_strings() -> None:
    assert [r.value for r in FinishReason] == ["stop", "length", "abort", "error"]
    assert finish_reason_from_proto(common_pb2.FINISH_REASON_LENGTH) is FinishReason.LENGTH


def test_unknown_wire_value_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown finish reason 99"):
        finish_reason_from_proto(99)
