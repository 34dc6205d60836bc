"""Every gRPC port and channel of the stack is opened by services/runtime/grpc_server.py.

That module applies the internal token and TLS (services/runtime/grpc_security.py); a
server or channel made anywhere else would bypass them. Tests are exempt:
they play outsiders on purpose; so are benchmarks, which time raw gRPC
transports against the stack's (never part of a running stack).
"""

from __future__ import annotations

import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SINGLE_POINT = REPO_ROOT / "services" / "runtime" / "grpc_server.py"
# Opening a port or a channel, by any import style (grpc.aio.server, aio.insecure_channel, ...).
OPENS = re.compile(
    r"\b(insecure_channel|secure_channel|add_insecure_port|add_secure_port)\s*\("
    r"|\b(?:grpc|aio)\.server\s*\("
)
EXEMPT_DIRS = {"tests", "benchmarks", ".venv", ".git", "build", "node_modules"}


def _code_files() -> list[Path]:
    return [
        path
        for path in REPO_ROOT.rglob("*.py")
        if not EXEMPT_DIRS & set(path.relative_to(REPO_ROOT).parts)
        and not path.name.endswith(("_pb2.py", "_pb2_grpc.py"))  # generated stubs
    ]


def test_no_port_or_channel_is_opened_outside_the_grpc_server_module() -> None:
    offenders = [
        f"{path.relative_to(REPO_ROOT)}:{number}: {line.strip()}"
        for path in _code_files()
        if path != SINGLE_POINT
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if OPENS.search(line)
    ]
    assert offenders == [], "open ports and channels through services/runtime/grpc_server.py"


def test_the_pattern_sees_every_way_to_open_one() -> None:
    # Guards the pattern itself, and that the single point is where it matches.
    openings = [
        "grpc.aio.server(interceptors=[])",
        "aio.server()",
        "grpc.server(executor)",
        "server.add_insecure_port(address)",
        "server.add_secure_port(address, credentials)",
        "grpc.aio.insecure_channel(address)",
        "grpc.secure_channel(address, credentials)",
    ]
    assert all(OPENS.search(line) for line in openings)
    assert not OPENS.search("internal_channel(address, security)")
    assert len(OPENS.findall(SINGLE_POINT.read_text())) >= 6
