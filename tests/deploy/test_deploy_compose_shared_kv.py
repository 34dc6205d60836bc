"""docker-compose.yml's shared-filesystem tier: off by default, and when turned on, the
kvstore's directory is a mounted volume (with a fixed name, so stacks on one host share
it) that the image made writable by the kvstore's user."""

from __future__ import annotations

import re
import shlex
from typing import Any

from dockerfile_parse import DockerfileParser

from kvmesh.services.runtime.config import KVStoreConfig
from tests.deploy.deploy_facts import (
    COMPOSE_USER_ENV,
    DOCKERFILE,
    build_config,
    interpolate_defaults,
)

ENABLED = COMPOSE_USER_ENV | {"KVMESH_KVSTORE_SHARED_FS_PATH": "/var/lib/kvmesh/kv-shared"}


def _kvstore_config(compose: dict[str, Any], environ: dict[str, str]) -> KVStoreConfig:
    env = compose["services"]["kvstore"]["environment"]
    return build_config(
        "kvstore", {k: interpolate_defaults(str(v), environ) for k, v in env.items()}
    )


def test_the_tier_is_off_until_its_variable_is_set(compose: dict[str, Any]) -> None:
    assert _kvstore_config(compose, COMPOSE_USER_ENV).kvstore_shared_fs_path == ""


def test_turned_on_the_tier_writes_to_a_named_volume(compose: dict[str, Any]) -> None:
    config = _kvstore_config(compose, ENABLED)
    mounts = dict(reversed(m.split(":")[:2]) for m in compose["services"]["kvstore"]["volumes"])
    volume = mounts[config.kvstore_shared_fs_path]
    # A fixed name (not prefixed by the compose project): other stacks can mount it.
    assert compose["volumes"][volume]["name"] == "kvmesh-kv-shared"
    assert config.kvstore_shared_fs_bytes < 64 << 30  # a laptop's disk, not the default


def test_the_image_makes_the_mount_point_the_kvstore_users(compose: dict[str, Any]) -> None:
    config = _kvstore_config(compose, ENABLED)
    parsed = DockerfileParser(path=str(DOCKERFILE))
    runtime = parsed.structure[
        max(i for i, ins in enumerate(parsed.structure) if ins["instruction"] == "FROM") :
    ]
    (user,) = [ins["value"] for ins in runtime if ins["instruction"] == "USER"]
    uid, gid = user.split(":")
    commands = [ins["value"] for ins in runtime if ins["instruction"] == "RUN"]
    made = [
        shlex.split(part)
        for command in commands
        for part in re.split(r"&&", command)
        if part.split()[:2] == ["install", "-d"]
    ]
    assert ["install", "-d", "-o", uid, "-g", gid, config.kvstore_shared_fs_path] in made
