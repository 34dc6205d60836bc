"""Free local ports, for a stack whose services each listen on their own."""

from __future__ import annotations

import socket


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 now (the OS picks them; a port can be
    taken again before its service binds it, which the callers' retries absorb)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()
