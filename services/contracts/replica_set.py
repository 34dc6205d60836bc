"""The engine replicas of one deployment, as the launcher publishes them to the gateway.

A replica is a scheduler, its worker and its detokenizer (which follows that
scheduler's outputs): the gateway submits to the scheduler and reads the
detokenizer, so it needs both addresses and nothing else.

``kvmesh up`` writes the set as a small JSON file and rewrites it whole
(write a sibling, then rename: a reader sees the old set or the new one,
never half of either); the gateway's file discovery polls it. A file rather
than a call into the launcher: the launcher stays a plain supervisor with no
server of its own, and the gateway learns the set even if it starts first or
restarts alone.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True, order=True)
class ReplicaAddress:
    """Where one engine replica listens; ``name`` is its stable label (metrics, logs)."""

    name: str
    scheduler_addr: str
    detokenizer_addr: str


def write_replica_set(path: Path, replicas: Iterable[ReplicaAddress]) -> None:
    """Replace the set at ``path`` atomically."""
    text = json.dumps({"replicas": [asdict(r) for r in sorted(replicas)]}, indent=1)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def read_replica_set(path: Path) -> frozenset[ReplicaAddress]:
    """The set at ``path``; ValueError if the file is not one."""
    try:
        entries = json.loads(path.read_text())["replicas"]
        return frozenset(ReplicaAddress(**entry) for entry in entries)
    except (KeyError, TypeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not a replica set: {error}") from error
