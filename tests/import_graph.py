"""The first-party import graph, read from the source (nothing is imported).

Every ``import`` counts: module level, inside functions, and under
``TYPE_CHECKING`` (a circle closed only for the type checker is still a
circle in the design). ``tests/test_layout_imports.py`` holds the rules;
run this file to print the graph's facts:

    python -m tests.import_graph            # circles and boundary crossings
    python -m tests.import_graph --edges    # every edge, one a line
"""

from __future__ import annotations

import argparse
import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The shipped top-level packages (pyproject's packages.find) and the
# developer scripts beside them; a package not in this checkout is skipped.
PACKAGES = (
    "kvmesh",
    "services",
    "gateway",
    "scheduler",
    "worker",
    "detokenizer",
    "kvstore",
    "kernels",
    "protos",
    "bench",
    "benchmarks",
)
# One process each; none may reach into another's modules (they talk gRPC).
SERVICES = ("gateway", "scheduler", "worker", "detokenizer", "kvstore")
# A service's modules that other services may import: the kvstore's client
# library, its store key (layout tag) and its block format, the way every
# service imports protos/. Everything else of a service is its own.
PUBLISHED = {
    "kvstore": frozenset({"kvmesh.kvstore.client", "kvmesh.kvstore.layout", "kvmesh.kvstore.block"})
}


@dataclass(frozen=True)
class Edge:
    """``source`` imports ``target`` (both dotted module names) at ``line``."""

    source: str
    target: str
    line: int


# The shipped packages install under this namespace (pyproject's package-dir) and
# are imported by it; the folders stay at the repository's top.
NAMESPACE = "kvmesh"


def package_of(module: str) -> str:
    """The top folder a module lives in: ``kvmesh.<package>.x`` lives in ``<package>``."""
    head, _, rest = module.partition(".")
    if head == NAMESPACE and rest.split(".", 1)[0] in PACKAGES:
        return rest.split(".", 1)[0]
    return head


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    if parts[0] in PACKAGES and parts[0] not in (NAMESPACE, "benchmarks"):
        parts.insert(0, NAMESPACE)
    return ".".join(parts)


def find_modules(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> dict[str, Path]:
    """Dotted name -> file of every first-party module (generated protobuf code left out)."""
    modules: dict[str, Path] = {}
    for package in packages:
        if not (root / package).is_dir():
            continue
        for path in sorted((root / package).rglob("*.py")):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            modules[_module_name(path, root)] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest known module that ``name`` names or lies in."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _imported_names(node: ast.AST, module: str, is_package: bool) -> Iterator[str]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            # Relative: strip one part per dot beyond the module's own package.
            anchor = module.split(".")
            drop = node.level - 1 if is_package else node.level
            anchor = anchor[: len(anchor) - drop] if drop else anchor
            base = ".".join([*anchor, base] if base else anchor)
        for alias in node.names:
            # ``from pkg import mod`` imports the submodule when there is one.
            yield f"{base}.{alias.name}"


def import_edges(modules: dict[str, Path]) -> list[Edge]:
    """Each first-party module a module imports, once (at its first import)."""
    edges: dict[tuple[str, str], Edge] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for name in _imported_names(node, module, is_package):
                target = _resolve(name, modules)
                if target is not None and target != module:
                    edge = Edge(module, target, node.lineno)
                    previous = edges.setdefault((module, target), edge)
                    if edge.line < previous.line:
                        edges[(module, target)] = edge
    return list(edges.values())


def circles(edges: Iterable[Edge]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.source, set()).add(edge.target)
        graph.setdefault(edge.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    # Iterative, so a deep chain of imports cannot hit the recursion limit.
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = []
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        work.append((start, iter(sorted(graph[start]))))
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def cross_service_edges(edges: Iterable[Edge]) -> list[Edge]:
    """A service's module importing another service's module (published or not)."""
    return [
        e
        for e in edges
        if package_of(e.source) in SERVICES
        and package_of(e.target) in SERVICES
        and package_of(e.source) != package_of(e.target)
    ]


def is_published(module: str) -> bool:
    return module in PUBLISHED.get(package_of(module), ())


def edges_from(edges: Iterable[Edge], sources: Iterable[str], targets: Iterable[str]) -> list[Edge]:
    """Edges from a module in one of the ``sources`` packages into one of ``targets``."""
    source_set, target_set = set(sources), set(targets)
    return [
        e
        for e in edges
        if package_of(e.source) in source_set and package_of(e.target) in target_set
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--edges", action="store_true", help="print every edge")
    args = parser.parse_args(argv)
    modules = find_modules()
    edges = import_edges(modules)
    if args.edges:
        for e in sorted(edges, key=lambda e: (e.source, e.target)):
            print(f"{e.source} -> {e.target}  (line {e.line})")
        return 0
    found = circles(edges)
    crossing = cross_service_edges(edges)
    upward = edges_from(edges, ["services"], [*SERVICES, "bench", "benchmarks"])
    print(f"{len(modules)} modules, {len(edges)} import edges")
    print(f"{len(found)} circles")
    for component in found:
        print("  " + " <-> ".join(component))
    internal = [e for e in crossing if not is_published(e.target)]
    print(
        f"{len(crossing)} imports across a service boundary: "
        f"{len(crossing) - len(internal)} into a published client surface, "
        f"{len(internal)} into another service's internals"
    )
    for e in crossing:
        where = "published" if is_published(e.target) else "INTERNAL"
        print(f"  {e.source} -> {e.target}  (line {e.line}, {where})")
    print(
        f"{len(upward)} imports from services/ into a service, services/cli/bench/ or benchmarks/"
    )
    for e in upward:
        print(f"  {e.source} -> {e.target}  (line {e.line})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
