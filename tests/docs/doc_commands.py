"""What the README and docs/ name as commands, and whether each exists.

A doc names a command in a shell code block (```bash) or an inline code span:
`kvmesh up --kv-offload`, `make test`, or a bare flag such as `--max-num-seqs`.
Each is checked against the real thing: the `kvmesh` parser (services/cli/main.py
``build_parser``, the load generator's services/cli/bench/cli.py ``build_parser``), the
Makefile's targets, a benchmark script's own argparse. The checks are plain
functions over text, so a test can feed them a doc that names a missing flag.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]

_FENCE = re.compile(r"^```(\w*)\s*$")
_SPAN = re.compile(r"`([^`\n]+)`")
_FLAG = re.compile(r"--[a-z0-9][a-z0-9-]*")
_MAKE_TARGET = re.compile(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", re.MULTILINE)
# Synopsis notation: such a line names flags but is not a literal command.
_SYNOPSIS = re.compile(r"[\[\]|<>]|\.\.\.|(?<![\w-])[A-Z][A-Z_]*(?![\w-])")
_SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
_SEPARATORS = {"|", "||", "&&", ";"}
_SUBCOMMANDS = ("up", "serve", "prepare-model", "k8s-secret", "bench")
_SERVICES = ("gateway", "scheduler", "worker", "detokenizer", "kvstore")

# Flags the docs name bare (no command in the same code span) that belong to
# something other than `kvmesh`, with their owner: a repo file whose source must
# declare the flag, or an outside tool (not checked).
OTHER_TOOLS_FLAGS: dict[str, str] = {
    "--emulate-avx2": "benchmarks/vllm_compare.py",
    "--rounds": "benchmarks/vllm_compare.py",
    "--vllm-python": "benchmarks/vllm_compare.py",
    "--vllm-dtype": "benchmarks/vllm_compare.py",
    "--all": "kernels/native.py",
    "--native-only": "benchmarks/attention_bench.py",
    "--prefill": "benchmarks/attention_bench.py",
    "--out": "benchmarks/dense_checkpoint.py",
    "--stack": "benchmarks/spec_decode_bench.py",
    "--lora-kernel": "benchmarks/lora_bench.py",
    "--timeout-s": "benchmarks/burst.py",
    "--no-deps": "pip",
    "--no-build-isolation": "pip",
}


@dataclass(frozen=True)
class Command:
    """One command line a doc names."""

    doc: str
    line: int
    tokens: tuple[str, ...]
    literal: bool  # False for synopsis notation ([--flag N], a|b, PATH)

    def where(self) -> str:
        return f"{self.doc}:{self.line}: {' '.join(self.tokens)}"


def doc_snippets(path: Path) -> Iterator[tuple[int, str, bool]]:
    """(line number, text, is a whole shell line) for every shell code line and
    every inline code span of a markdown file; backslash continuations joined."""
    lines = path.read_text().splitlines()
    in_fence, shell, pending, start = False, False, "", 0
    for number, line in enumerate(lines, 1):
        fence = _FENCE.match(line.strip())
        if fence:
            in_fence = not in_fence
            shell = in_fence and fence.group(1) in _SHELL_LANGS
            continue
        if in_fence:
            if not shell:
                continue
            text = re.sub(r"(^|\s)#.*$", "", line).rstrip()
            if not pending:
                start = number
            if text.endswith("\\"):
                pending += text[:-1] + " "
                continue
            yield start, pending + text, True
            pending = ""
            continue
        for span in _SPAN.finditer(line):
            yield number, span.group(1), False


def _split(text: str) -> list[str]:
    try:
        return shlex.split(text, comments=False)
    except ValueError:  # an unbalanced quote in prose
        return text.split()


def commands(path: Path, program: str) -> Iterator[Command]:
    """Every `program ...` command line in a doc (``kvmesh``, ``make``), cut at pipes."""
    doc = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)
    for line, text, _ in doc_snippets(path):
        tokens = _split(text)
        for i, token in enumerate(tokens):
            at_start = i == 0 or tokens[i - 1] in _SEPARATORS
            if at_start and (token == program or token.endswith(f"/bin/{program}")):
                rest = tokens[i + 1 :]
                end = next((j for j, t in enumerate(rest) if t in _SEPARATORS), len(rest))
                args = tuple(rest[:end])
                yield Command(doc, line, args, not _SYNOPSIS.search(" ".join(args)))


def bare_flags(path: Path) -> Iterator[tuple[int, str]]:
    """Flags named in an inline code span that starts with the flag itself."""
    for line, text, whole_line in doc_snippets(path):
        if not whole_line and text.startswith("--"):
            match = _FLAG.match(text)
            if match:
                yield line, match.group(0)


def _help(parser: argparse.ArgumentParser, argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        parser.parse_args([*argv, "--help"])
    return out.getvalue()


@functools.cache
def kvmesh_help(subcommand: tuple[str, ...]) -> frozenset[str]:
    """The flags `kvmesh <subcommand> --help` lists."""
    if subcommand[:1] == ("bench",):
        from kvmesh.services.cli.bench.cli import build_parser as bench_parser

        return frozenset(_FLAG.findall(bench_parser().format_help()))
    from kvmesh.services.cli.main import build_parser

    return frozenset(_FLAG.findall(_help(build_parser(), list(subcommand))))


@functools.cache
def all_kvmesh_flags() -> frozenset[str]:
    flags = set(kvmesh_help(("up",))) | kvmesh_help(("bench",))
    for service in _SERVICES:
        flags |= kvmesh_help(("serve", service))
    return frozenset(flags)


@functools.cache
def make_targets() -> frozenset[str]:
    return frozenset(_MAKE_TARGET.findall((REPO / "Makefile").read_text()))


def check_kvmesh_command(command: Command) -> list[str]:
    """Problems with one documented `kvmesh ...` line (empty: it is true)."""
    args = list(command.tokens)
    if not args:
        return []  # "the `kvmesh` command" in prose
    subcommands = args[0].split("|")
    unknown = [s for s in subcommands if s not in _SUBCOMMANDS]
    if unknown:
        return [f"{command.where()}: no subcommand {unknown[0]!r}"]
    problems = []
    for sub in subcommands:
        scope: list[tuple[str, ...]] = [(sub,)]
        if sub == "serve":
            if len(args) < 2:
                return []  # "`kvmesh serve` runs one service": the subcommand named in prose
            services = args[1].split("|")
            bad = [s for s in services if s not in _SERVICES]
            if bad:
                return [f"{command.where()}: no service {bad[0]!r}"]
            scope = [("serve", s) for s in services]
        for flag in _FLAG.findall(" ".join(args)):
            if flag == "--help":
                continue
            for sub_scope in scope:
                if flag not in kvmesh_help(sub_scope):
                    problems.append(
                        f"{command.where()}: `kvmesh {' '.join(sub_scope)} --help` has no {flag}"
                    )
    if command.literal and "--help" not in args and not problems:
        problems += _parse_problems(command, args)
    return problems


def _parse_problems(command: Command, args: list[str]) -> list[str]:
    """A literal command line must parse (values, choices, ranges) without running."""
    if args[0] == "bench":
        from kvmesh.services.cli.bench.cli import build_parser as bench_parser

        parser, argv = bench_parser(), args[1:]
    else:
        from kvmesh.services.cli.main import build_parser

        parser, argv = build_parser(), args
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parser.parse_args(argv)
    except SystemExit:
        return [f"{command.where()}: does not parse: {err.getvalue().strip().splitlines()[-1]}"]
    return []


def check_bare_flag(doc: str, line: int, flag: str) -> list[str]:
    owner = OTHER_TOOLS_FLAGS.get(flag)
    if owner is None:
        if flag in all_kvmesh_flags():
            return []
        return [f"{doc}:{line}: {flag} is in no `kvmesh ... --help`"]
    source = REPO / owner
    if source.is_file() and f'"{flag}"' not in source.read_text():
        return [f"{doc}:{line}: {owner} declares no {flag}"]
    return []


def check_make_command(command: Command) -> list[str]:
    targets = [t for t in command.tokens if not t.startswith("-") and "=" not in t]
    return [
        f"{command.where()}: the Makefile has no target {t!r}"
        for t in targets[:1]
        if t not in make_targets()
    ]


def check_doc(path: Path) -> list[str]:
    """Every problem in one markdown file."""
    doc = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)
    problems: list[str] = []
    for command in commands(path, "kvmesh"):
        problems += check_kvmesh_command(command)
    for command in commands(path, "make"):
        problems += check_make_command(command)
    for line, flag in bare_flags(path):
        problems += check_bare_flag(doc, line, flag)
    return problems
