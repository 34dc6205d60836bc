"""``cdiv`` is exact at block boundaries, and it is the only ceiling division in the source."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmesh.services.contracts.math_utils import cdiv

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        (0, 1, 0),
        (0, 16, 0),  # no tokens, no blocks
        (1, 16, 1),
        (15, 16, 1),
        (16, 16, 1),  # exactly full: no extra block
        (17, 16, 2),  # one token over: one more block
        (32, 16, 2),
        (33, 16, 3),
        (7, 1, 7),
        (3, 7, 1),
        (2**53 + 1, 1, 2**53 + 1),  # past float precision: math.ceil(a / b) says 2**53
    ],
)
def test_exact_values(a: int, b: int, expected: int) -> None:
    assert cdiv(a, b) == expected


@given(st.integers(min_value=0, max_value=2**80), st.integers(min_value=1, max_value=2**40))
def test_is_the_fewest_blocks_that_hold_a(a: int, b: int) -> None:
    blocks = cdiv(a, b)
    assert blocks * b >= a
    assert (blocks - 1) * b < a or blocks == 0


# Negated floor division, the two ways it is spelled: the minus signs around a
# floor division, or a floor division by a negated divisor.
_CEIL_DIV_IDIOM = re.compile(r"-\(\s*-|//\s*-\s*[\w(]")
_SKIPPED_DIRS = {".git", ".venv", "venv", "build", "dist", "__pycache__"}


def _source_files() -> list[Path]:
    """Every hand-written Python file, and the shell scripts that embed Python."""
    files = []
    for folder, subfolders, names in os.walk(REPO_ROOT):
        subfolders[:] = [d for d in subfolders if d not in _SKIPPED_DIRS]  # never walk a venv
        files += [
            Path(folder, name)
            for name in names
            if name.endswith((".py", ".sh")) and "_pb2" not in name
        ]
    return files


def test_the_scan_sees_both_spellings() -> None:
    minus = "-"  # spelled out, so that this file does not trip its own scan
    assert _CEIL_DIV_IDIOM.search(f"blocks = {minus}({minus}num_tokens // block_size)")
    assert _CEIL_DIV_IDIOM.search(f"blocks = {minus}(num_tokens // {minus}block_size)")
    assert not _CEIL_DIV_IDIOM.search("full_blocks = num_tokens // block_size - 1")


def test_no_hand_written_ceiling_division_outside_cdiv() -> None:
    cdiv_home = REPO_ROOT / "services" / "contracts" / "math_utils.py"
    files = _source_files()
    assert cdiv_home in files and REPO_ROOT / "benchmarks" / "gpu_check.sh" in files
    found = [
        f"{path.relative_to(REPO_ROOT)}:{number}: {line.strip()}"
        for path in files
        if path != cdiv_home
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if _CEIL_DIV_IDIOM.search(line)
    ]
    assert not found, "use kvmesh.services.contracts.math_utils.cdiv:\n" + "\n".join(found)
    assert _CEIL_DIV_IDIOM.search(cdiv_home.read_text()), "the scan no longer sees cdiv's own"
