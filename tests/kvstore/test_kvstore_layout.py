"""KVLayout: a canonical, stable namespace per cache shape; validated at the edge."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest

from kvmesh.kvstore.layout import NAMESPACE_BYTES, KVLayout
from kvmesh.services.contracts.errors import InvalidRequestError

BASE = KVLayout("HuggingFaceTB/SmolLM2-135M-Instruct", "bfloat16", 16, 1, tp_rank=0, tp_size=1)


def test_namespace_is_stable_across_processes_and_releases() -> None:
    # Pinned: changing the encoding orphans every stored block, so it must be deliberate.
    assert BASE.namespace.hex() == "625645aa3a6fc58b35d3956fc055f4ba"
    assert len(BASE.namespace) == NAMESPACE_BYTES
    assert BASE.namespace == hashlib.sha256(BASE.canonical_bytes()).digest()[:16]


@pytest.mark.parametrize(
    "change",
    [
        {"model": "other"},
        {"dtype": "float16"},
        {"block_size": 32},
        {"layout_version": 2},
        {"tp_rank": 1, "tp_size": 2},
        {"tp_size": 2},
    ],
)
def test_every_field_changes_the_namespace(change: dict) -> None:
    assert dataclasses.replace(BASE, **change).namespace != BASE.namespace


def test_length_prefixes_keep_fields_apart() -> None:
    # Without length prefixes ("ab", "c") and ("a", "bc") would encode alike.
    assert KVLayout("ab", "c", 16, 1).namespace != KVLayout("a", "bc", 16, 1).namespace


def test_block_key_is_namespace_then_hash() -> None:
    block_hash = bytes(range(32))
    assert BASE.block_key(block_hash) == BASE.namespace + block_hash
    for bad in (b"", b"x" * 65):
        with pytest.raises(InvalidRequestError):
            BASE.block_key(bad)


def test_proto_roundtrip() -> None:
    assert KVLayout.from_proto(BASE.to_proto()) == BASE


@pytest.mark.parametrize(
    "fields",
    [
        ("", "bfloat16", 16, 1, 0, 1),
        ("m", "", 16, 1, 0, 1),
        ("m", "bfloat16", 0, 1, 0, 1),
        ("m", "bfloat16", 16, 0, 0, 1),
        ("m", "bfloat16", 16, 1, 2, 2),
        ("m", "bfloat16", 16, 1, 0, 0),
    ],
)
def test_incomplete_layouts_are_rejected(fields: tuple) -> None:
    with pytest.raises(InvalidRequestError):
        KVLayout(*fields)
