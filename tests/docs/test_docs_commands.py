"""The README and docs/ name only commands, flags and links that exist.

Every `kvmesh ...` line is checked against `kvmesh <subcommand> --help` and, when
it is a literal command (not synopsis notation), parsed as the CLI would parse
it; every bare `--flag` must be some `kvmesh` command's (or, for the few named
in OTHER_TOOLS_FLAGS, its owner's); every `make X` must be a Makefile target;
every relative link must reach a file and, with `#anchor`, a heading in it;
every repository path named in code (`worker/models/__init__.py`, or a module's
symbol, `services/runtime/model_prep.resolve_model_path`) must exist, which keeps the
"Adding ..." checklists of docs/architecture.md true as files move.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.docs.doc_commands import DOCS, REPO, check_doc, commands

_LINK = re.compile(r"\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*$", re.MULTILINE)


def _ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(REPO)) for p in paths]


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_commands_and_flags_exist(doc: Path) -> None:
    assert check_doc(doc) == []


def test_the_docs_name_commands_at_all() -> None:
    """Guards the extraction itself: the README and serving.md do name commands."""
    readme = list(commands(REPO / "README.md", "make"))
    assert {c.tokens[0] for c in readme} >= {"up", "test"}
    serving = list(commands(REPO / "docs" / "serving.md", "kvmesh"))
    assert len(serving) >= 10 and any(c.literal for c in serving)


def test_a_missing_flag_subcommand_or_target_is_reported(tmp_path: Path) -> None:
    doc = tmp_path / "bad.md"
    doc.write_text(
        "Run `kvmesh up --kv-offload --no-such-flag` or `kvmesh serve worker --http-port 1`.\n"
        "The bare `--also-not-a-flag` and `--max-num-seqs` (real).\n"
        "`kvmesh launch` is not a subcommand; `kvmesh up --dtype float64` does not parse.\n"
        "```bash\nmake no-such-target\nkvmesh up \\\n  --nope 3\n```\n"
    )
    problems = "\n".join(check_doc(doc))
    assert "has no --no-such-flag" in problems
    assert "`kvmesh serve worker --help` has no --http-port" in problems  # the gateway's
    assert "--also-not-a-flag is in no `kvmesh ... --help`" in problems
    assert "--max-num-seqs" not in problems
    assert "no subcommand 'launch'" in problems
    assert "--dtype float64: does not parse" in problems
    assert "no target 'no-such-target'" in problems
    assert "has no --nope" in problems  # a continued line is one command


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*_]", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_relative_links_reach_a_file_and_heading(doc: Path) -> None:
    broken = []
    for target in _LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        file_part, _, anchor = target.partition("#")
        path = (doc.parent / file_part).resolve() if file_part else doc
        if not path.exists():
            broken.append(f"{target}: no such file")
            continue
        if anchor and path.suffix == ".md":
            slugs = {_slug(h) for h in _HEADING.findall(path.read_text())}
            if anchor not in slugs:
                broken.append(f"{target}: no heading with anchor #{anchor}")
    assert broken == []


_TOP_LEVEL = {p.name for p in REPO.iterdir() if not p.name.startswith(".")}
_PATH = re.compile(r"`((?:[A-Za-z0-9_.-]+/)+[A-Za-z0-9_.-]*)`")


def _exists(path: str) -> bool:
    if (REPO / path).exists():
        return True
    # `package/module.symbol`: the module's file.
    module = path.rsplit(".", 1)[0]
    return "." in path and (REPO / f"{module}.py").is_file()


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_repository_paths_exist(doc: Path) -> None:
    missing = []
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        for path in _PATH.findall(line):
            if path.split("/")[0] in _TOP_LEVEL and not _exists(path):
                missing.append(f"{number}: {path}")
    assert missing == []


def _python_blocks(doc: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", doc.read_text(), re.MULTILINE | re.DOTALL)


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_python_examples_compile_and_name_real_api(doc: Path) -> None:
    import importlib.util

    import kvmesh

    names: set[str] = set()
    for block in _python_blocks(doc):
        compile(block, f"{doc.name} example", "exec")  # SyntaxError fails the test
        # In prose, kvmesh.* also names proto packages and span events; in code, the API.
        names |= set(re.findall(r"\bkvmesh\.([A-Za-z_]\w*)", block))
    unknown = [
        name
        for name in sorted(names)
        if not hasattr(kvmesh, name) and importlib.util.find_spec(f"kvmesh.{name}") is None
    ]
    assert unknown == []
