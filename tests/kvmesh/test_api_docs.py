"""docs/serving.md spells out the Python API's constructors: every parameter it names
exists with the default it states, and none is left out."""

from __future__ import annotations

import ast
import inspect
import re

import pytest

import kvmesh
from tests.docs.doc_commands import REPO

SERVING = (REPO / "docs" / "serving.md").read_text()


@pytest.mark.parametrize("name", ["LLM", "SamplingParams", "Client"])
def test_documented_signature_matches_the_code(name: str) -> None:
    match = re.search(rf"`kvmesh\.{name}\((.*?)\)`", SERVING, re.DOTALL)
    assert match, f"docs/serving.md does not spell out kvmesh.{name}(...)"
    documented: dict[str, str] = {}
    for part in " ".join(match.group(1).split()).split(","):
        part = part.strip()
        if part and part != "*":
            key, _, default = part.partition("=")
            documented[key.strip()] = default.strip()
    signature = inspect.signature(getattr(kvmesh, name))
    assert set(documented) == set(signature.parameters)
    for key, parameter in signature.parameters.items():
        stated = documented[key]
        if not stated or parameter.default is inspect.Parameter.empty:
            assert not stated and parameter.default is inspect.Parameter.empty, key
            continue
        if stated == "1 GiB":
            assert parameter.default == 1 << 30, key
        elif stated == "{}":
            pass  # a default_factory: the field's default is a fresh dict
        else:
            assert ast.literal_eval(stated) == parameter.default, key
