"""The import graph keeps the design's shape (tests/import_graph.py reads it).

- No import circles among first-party modules, ``TYPE_CHECKING`` imports included.
- No service imports another service's modules, except the client surface a
  service publishes for the others (``PUBLISHED`` in tests/import_graph.py).
- ``services/`` (the shared contracts and chassis) imports no service and
  nothing above it (``services/cli/bench/``, ``benchmarks/``).
- Nothing shipped imports ``benchmarks/`` or ``tests/``; tests do not import
  ``benchmarks/`` (what they share with a script lives under ``tests/``).

A known exception names the edge and why it stays for now; one that no longer
exists fails the test, so the list cannot go stale.
"""

from __future__ import annotations

import pytest

from tests.import_graph import (
    PACKAGES,
    PUBLISHED,
    SERVICES,
    Edge,
    circles,
    cross_service_edges,
    edges_from,
    find_modules,
    import_edges,
    is_published,
    package_of,
)

# (source, target) -> why the edge stays for now.
KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {}

SHIPPED = tuple(p for p in PACKAGES if p != "benchmarks")


@pytest.fixture(scope="module")
def edges() -> list[Edge]:
    return import_edges(find_modules(packages=(*PACKAGES, "tests")))


def _unexcused(found: list[Edge]) -> list[str]:
    return [
        f"{e.source} -> {e.target} (line {e.line})"
        for e in found
        if (e.source, e.target) not in KNOWN_EXCEPTIONS
    ]


def test_no_import_circles(edges: list[Edge]) -> None:
    assert circles(edges) == []


def test_no_service_imports_another_services_internals(edges: list[Edge]) -> None:
    crossing = [e for e in cross_service_edges(edges) if not is_published(e.target)]
    assert _unexcused(crossing) == []


def test_published_client_surfaces_import_nothing_else_of_their_service(
    edges: list[Edge],
) -> None:
    """Else a published module would drag its service's internals into its callers."""
    leaking = [
        e
        for service, surface in PUBLISHED.items()
        for e in edges
        if e.source in surface and package_of(e.target) == service and e.target not in surface
    ]
    assert _unexcused(leaking) == []


def test_services_imports_no_service_and_nothing_above_it(edges: list[Edge]) -> None:
    upward = edges_from(edges, ["services"], [*SERVICES, "bench", "benchmarks", "tests"])
    assert _unexcused(upward) == []


def test_shipped_code_imports_no_developer_scripts_or_tests(edges: list[Edge]) -> None:
    assert _unexcused(edges_from(edges, SHIPPED, ["benchmarks", "tests"])) == []


def test_tests_import_no_benchmarks(edges: list[Edge]) -> None:
    assert _unexcused(edges_from(edges, ["tests"], ["benchmarks"])) == []


def test_every_known_exception_still_exists(edges: list[Edge]) -> None:
    present = {(e.source, e.target) for e in edges}
    assert sorted(set(KNOWN_EXCEPTIONS) - present) == []


def test_the_graph_reader_sees_type_checking_and_function_level_imports(tmp_path) -> None:
    """The rules above are only as good as the reader: check it on a made-up package."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n"
    )
    (package / "b.py").write_text("def f():\n    from pkg import c\n")
    (package / "c.py").write_text("from . import a\nimport os\n")
    found = import_edges(find_modules(tmp_path, ["pkg"]))
    assert {(e.source, e.target) for e in found} == {
        ("pkg.a", "pkg.b"),
        ("pkg.b", "pkg.c"),
        ("pkg.c", "pkg.a"),
    }
    assert circles(found) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_nothing_below_the_program_top_imports_it(edges: list[Edge]) -> None:
    """services/cli is the program's top (the command, launcher, load generator): a
    service or the ground floor importing it would make the top a dependency."""
    top = ("kvmesh.services.cli", "kvmesh.__main__")
    below = [
        e
        for e in edges
        if e.target.startswith("kvmesh.services.cli")
        and not e.source.startswith(top)
        and package_of(e.source) not in ("tests", "benchmarks")
    ]
    assert _unexcused(below) == []
