"""docker-compose.yml: valid against the Compose Specification, and in step with the config
(services/runtime/config/).

No Docker engine is needed: the schema is the official one vendored in the
check-jsonschema package, and the rest compares the file with the config
dataclasses.
"""

from __future__ import annotations

import copy
import json
from importlib import resources
from typing import Any

import jsonschema
import pytest

from kvmesh.services.runtime.config import SERVICE_CONFIGS, env_name
from kvmesh.services.runtime.healthcheck import Endpoint, service_endpoint
from tests.deploy.deploy_facts import (
    COMPOSE_USER_ENV,
    DOCUMENTED_EXTRA_ENV,
    MissingComposeVariable,
    addr_target_service,
    all_config_env_names,
    build_config,
    declared_ports,
    env_names_read_by,
    interpolate_defaults,
)

OBSERVABILITY = {"prometheus", "grafana", "jaeger"}

# Which service must be healthy before which: the address each one dials.
REQUIRED_DEPENDENCIES = {
    "scheduler": {"worker"},
    "detokenizer": {"scheduler"},
    "gateway": {"scheduler", "detokenizer"},
}


@pytest.fixture(scope="module")
def compose_validator() -> jsonschema.protocols.Validator:
    schema_file = resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
    schema = json.loads(schema_file.read_text())
    validator_class = jsonschema.validators.validator_for(schema)
    validator_class.check_schema(schema)
    return validator_class(schema)


def _environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):  # the KEY=VALUE list form
        env = dict(item.split("=", 1) for item in env)
    return {k: interpolate_defaults("" if v is None else str(v)) for k, v in env.items()}


def _published(port: str | int) -> tuple[int, int]:
    """'8000:8000' -> (host 8000, container 8000); IPs and /tcp are not used here."""
    host, _, container = str(port).partition(":")
    return int(host), int(container or host)


def _healthcheck_endpoint(test: list[str]) -> Endpoint:
    prefix = ["CMD", "python", "-m", "kvmesh.services.runtime.healthcheck"]
    assert test[: len(prefix)] == prefix, f"health check is not the healthcheck module: {test}"
    kind, target, *rest = test[len(prefix) :]
    assert not rest, test
    return Endpoint(kind, target)


def test_compose_file_matches_the_compose_specification(
    compose: dict[str, Any], compose_validator: jsonschema.protocols.Validator
) -> None:
    errors = [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in compose_validator.iter_errors(compose)
    ]
    assert errors == []


@pytest.mark.parametrize(
    ("mistake", "path", "value"),
    [
        (
            "misspelled condition",
            ("services", "gateway", "depends_on", "scheduler", "condition"),
            "service_healty",
        ),
        ("ports as a mapping", ("services", "worker", "ports"), {"50053": 50053}),
        ("nested environment value", ("services", "worker", "environment"), {"A": {"b": 1}}),
        ("misspelled key", ("services", "worker", "helthcheck"), {"test": ["CMD", "true"]}),
    ],
)
def test_schema_check_rejects_real_mistakes(
    compose: dict[str, Any],
    compose_validator: jsonschema.protocols.Validator,
    mistake: str,
    path: tuple[str, ...],
    value: Any,
) -> None:
    broken = copy.deepcopy(compose)
    node = broken
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    assert not compose_validator.is_valid(broken), mistake


def _kvmesh_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The containers that run kvmesh services (not the observability stack)."""
    return {n: s for n, s in compose["services"].items() if n in SERVICE_CONFIGS}


def test_one_container_per_service_plus_the_observability_stack(compose: dict[str, Any]) -> None:
    assert set(compose["services"]) == set(SERVICE_CONFIGS) | OBSERVABILITY


def test_every_container_runs_its_own_service_from_one_image(compose: dict[str, Any]) -> None:
    images = set()
    for name, service in _kvmesh_services(compose).items():
        assert service["command"] == ["serve", name], name
        images.add(service["image"])
        assert service.get("restart") in ("always", "unless-stopped", "on-failure"), name
    assert len(images) == 1


def test_published_ports_are_the_declared_defaults(compose: dict[str, Any]) -> None:
    for name, service in _kvmesh_services(compose).items():
        published = [_published(p) for p in service["ports"]]
        assert all(host == container for host, container in published), (name, published)
        assert {c for _, c in published} == declared_ports(name).all, name


def test_health_checks_probe_each_service_readiness_endpoint(compose: dict[str, Any]) -> None:
    for name, service in _kvmesh_services(compose).items():
        endpoint = _healthcheck_endpoint(service["healthcheck"]["test"])
        # What `python -m kvmesh.services.runtime.healthcheck service NAME` would probe by default:
        # gRPC health on the service's port, or the gateway's /ready.
        assert endpoint == service_endpoint(name, {}), name


def test_dependencies_exist_and_wait_for_health(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name, service in services.items():
        depends_on = service.get("depends_on", {})
        assert isinstance(depends_on, dict), f"{name}: use the long form with a condition"
        for target, spec in depends_on.items():
            assert target in services, f"{name} depends on unknown {target}"
            assert spec.get("condition") == "service_healthy", (name, target)
            assert "healthcheck" in services[target], f"{target} has no health check"
        assert REQUIRED_DEPENDENCIES.get(name, set()) <= set(depends_on), name


def test_dependencies_have_no_cycle(compose: dict[str, Any]) -> None:
    services = compose["services"]
    started: list[str] = []
    remaining = dict(services)
    while remaining:
        ready = [n for n, s in remaining.items() if set(s.get("depends_on", {})) <= set(started)]
        assert ready, f"dependency cycle among {sorted(remaining)}"
        started.extend(sorted(ready))
        for n in ready:
            del remaining[n]


def test_environment_sets_only_real_kvmesh_options(compose: dict[str, Any]) -> None:
    known = all_config_env_names() | DOCUMENTED_EXTRA_ENV
    for name, service in compose["services"].items():
        for var in _environment(service):
            if not var.startswith("KVMESH_"):
                continue
            assert var in known, f"{name}: {var} is no KVMESH_ option"
            # Set on a service that never reads it, it does nothing: likely a mistake.
            assert var in env_names_read_by(name) | DOCUMENTED_EXTRA_ENV, f"{name}: {var}"


def test_addresses_point_at_the_dependency_and_its_port(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name, service in services.items():
        for var, value in _environment(service).items():
            target = addr_target_service(var)
            if target is None:
                continue
            host, _, port = value.rpartition(":")
            assert host == target and host in services, f"{name}: {var}={value}"
            assert int(port) == declared_ports(target).grpc, f"{name}: {var}={value}"
            assert target in service.get("depends_on", {}), f"{name} dials {target} unordered"


def test_every_service_dials_its_dependencies_by_container_name(compose: dict[str, Any]) -> None:
    # The config defaults dial 127.0.0.1, which inside a container is itself.
    for name, service in _kvmesh_services(compose).items():
        config = build_config(name, _environment(service))
        for field_name in ("worker_addr", "scheduler_addr", "detokenizer_addr"):
            address = getattr(config, field_name, None)
            if address is not None:
                assert not address.startswith("127.0.0.1"), f"{name}: {field_name}={address}"


def test_every_service_requires_the_internal_token(compose: dict[str, Any]) -> None:
    token_var = env_name("internal_auth_token")
    services = compose["services"]
    carriers = {n for n, s in services.items() if token_var in s.get("environment", {})}
    assert carriers == set(SERVICE_CONFIGS)
    for name in SERVICE_CONFIGS:
        raw = str(services[name]["environment"][token_var])
        # No default: unset or empty, compose refuses to start rather than run open ports.
        for environ in ({}, {token_var: ""}):
            with pytest.raises(MissingComposeVariable):
                interpolate_defaults(raw, environ)
        config = build_config(name, _environment(services[name]))
        assert config.internal_auth_token == COMPOSE_USER_ENV[token_var], name


def test_every_service_listens_on_all_interfaces(compose: dict[str, Any]) -> None:
    for name, service in _kvmesh_services(compose).items():
        # Building the config also checks every value the file sets (types, choices).
        assert build_config(name, _environment(service)).bind_host == "0.0.0.0", name
