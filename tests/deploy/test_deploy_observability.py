"""Compose's observability stack: Prometheus scrapes every service, Grafana's
dashboard loads and queries only metrics the code defines, traces reach Jaeger.

The metric names are read from the code itself (every prometheus_client
Counter/Gauge/Histogram constructed in the service packages), so a renamed
metric makes the dashboard panel that still queries the old name fail here.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from kvmesh.services.runtime.config import SERVICE_CONFIGS
from tests.deploy.deploy_facts import REPO_ROOT, build_config, declared_ports, interpolate_defaults

DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "dashboards" / "kvmesh.json"
PROVISIONING = REPO_ROOT / "deploy" / "grafana" / "provisioning"
PROMETHEUS_CONFIG = REPO_ROOT / "deploy" / "prometheus" / "prometheus.yml"
METRIC_PACKAGES = ("gateway", "scheduler", "worker", "detokenizer", "kvstore", "services")
METRIC_CONSTRUCTORS = {"Counter", "Gauge", "Histogram", "Summary", "counter", "gauge", "histogram"}
METRIC_TOKEN = re.compile(r"\b(?:vllm|kvmesh)[:_][A-Za-z0-9_:]*")
GRID_COLUMNS = 24

# What the dashboard must show, each by one metric family.
REQUIRED_FAMILIES = {
    "throughput": "vllm:generation_tokens_total",
    "time to first token": "vllm:time_to_first_token_seconds_bucket",
    "inter-token latency": "vllm:inter_token_latency_seconds_bucket",
    "KV usage": "vllm:kv_cache_usage_perc",
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
    "preemptions": "vllm:num_preemptions_total",
    "prefix hits": "vllm:prefix_cache_hits_total",
    "prefix queries": "vllm:prefix_cache_queries_total",
    "routing decisions": "kvmesh_router_decisions_total",
    "routable replicas": "kvmesh_router_routable_replicas",
}


def _metric_definitions() -> dict[str, str]:
    """Every metric the code constructs: name -> constructor kind."""
    defined: dict[str, str] = {}
    for package in METRIC_PACKAGES:
        for path in (REPO_ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.Call) or not node.args:
                    continue
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                first = node.args[0]
                if name in METRIC_CONSTRUCTORS and isinstance(first, ast.Constant):
                    defined[first.value] = name.lower()
    return defined


def _exposed_series(definitions: dict[str, str]) -> set[str]:
    """The series names Prometheus stores for those metrics (prometheus_client's suffixes)."""
    series = set()
    for name, kind in definitions.items():
        if kind == "counter":
            series.add(name.removesuffix("_total") + "_total")
        elif kind in ("histogram", "summary"):
            series.update(name + suffix for suffix in ("_bucket", "_sum", "_count"))
        else:
            series.add(name)
    return series


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def _exprs(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in _panels(dashboard) for t in p["targets"]]


def _provisioned(kind: str) -> list[dict[str, Any]]:
    (path,) = (PROVISIONING / kind).glob("*.yml")
    return yaml.safe_load(path.read_text())["datasources" if kind == "datasources" else "providers"]


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """Bind mounts: container path -> repository path."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target, *_ = volume.split(":")
        mounts[target] = source
    return mounts


def _published_ports(service: dict[str, Any]) -> set[int]:
    return {int(str(p).rpartition(":")[2]) for p in service["ports"]}


# ---- the dashboard ---------------------------------------------------------


def test_code_defines_the_metrics_the_scan_relies_on() -> None:
    definitions = _metric_definitions()
    # One of each constructor style: module-level, and the scheduler's helpers.
    assert definitions["vllm:time_to_first_token_seconds"] == "histogram"
    assert definitions["vllm:num_requests_waiting"] == "gauge"
    assert definitions["kvmesh:worker_tokens_computed_total"] == "counter"


def test_dashboard_has_identity_and_panels_with_datasource_targets_and_place(
    dashboard: dict[str, Any],
) -> None:
    assert dashboard["uid"] and dashboard["title"] and isinstance(dashboard["schemaVersion"], int)
    uids = {d["uid"]: d["type"] for d in _provisioned("datasources")}
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in _panels(dashboard):
        title = panel["title"]
        assert uids.get(panel["datasource"]["uid"]) == panel["datasource"]["type"], title
        assert panel["targets"], title
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), title
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"], title
            assert target["expr"].strip(), title
        grid = panel["gridPos"]
        assert all(isinstance(grid[k], int) for k in ("h", "w", "x", "y")), title
        assert grid["w"] > 0 and grid["h"] > 0 and grid["x"] + grid["w"] <= GRID_COLUMNS, title


def test_panels_do_not_overlap(dashboard: dict[str, Any]) -> None:
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, (panel["title"], cells.get((x, y)))
                cells[(x, y)] = panel["title"]


def test_every_query_is_balanced_and_references_only_defined_metrics(
    dashboard: dict[str, Any],
) -> None:
    series = _exposed_series(_metric_definitions())
    for expr in _exprs(dashboard):
        for open_, close in ("()", "[]", "{}"):
            assert expr.count(open_) == expr.count(close), expr
        names = METRIC_TOKEN.findall(expr)
        assert names, f"no kvmesh or vllm metric in {expr}"
        for name in names:
            assert name in series, f"{name} is defined nowhere in the code ({expr})"


def test_quantiles_are_taken_over_histogram_buckets_by_le(dashboard: dict[str, Any]) -> None:
    quantile_exprs = [e for e in _exprs(dashboard) if e.startswith("histogram_quantile")]
    assert quantile_exprs
    for expr in quantile_exprs:
        assert "by (le)" in expr, expr
        assert all(name.endswith("_bucket") for name in METRIC_TOKEN.findall(expr)), expr


def test_dashboard_shows_what_an_operator_needs(dashboard: dict[str, Any]) -> None:
    referenced = {name for expr in _exprs(dashboard) for name in METRIC_TOKEN.findall(expr)}
    missing = {topic for topic, name in REQUIRED_FAMILIES.items() if name not in referenced}
    assert missing == set()


# ---- the compose stack around it --------------------------------------------


def test_prometheus_scrapes_every_service_metrics_port(compose: dict[str, Any]) -> None:
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    targets = {
        target
        for job in config["scrape_configs"]
        for group in job["static_configs"]
        for target in group["targets"]
    }
    expected = {f"{name}:{declared_ports(name).metrics}" for name in SERVICE_CONFIGS}
    assert targets == expected
    # Container names resolve on compose's network: each target is a container.
    assert {t.partition(":")[0] for t in targets} <= set(compose["services"])


def test_observability_containers_mount_the_files_in_the_repository(
    compose: dict[str, Any],
) -> None:
    for name in ("prometheus", "grafana"):
        for source in _mounts(compose["services"][name]).values():
            assert (REPO_ROOT / source).exists(), (name, source)
            assert source.startswith("./deploy/"), (name, source)
    prometheus = compose["services"]["prometheus"]
    config_flag = next(a for a in prometheus["command"] if a.startswith("--config.file="))
    mounted = _mounts(prometheus)[config_flag.partition("=")[2]]
    assert (REPO_ROOT / mounted).resolve() == PROMETHEUS_CONFIG


def test_grafana_loads_the_dashboard_folder_and_reaches_its_datasources(
    compose: dict[str, Any],
) -> None:
    services = compose["services"]
    grafana = _mounts(services["grafana"])
    assert (REPO_ROOT / grafana["/etc/grafana/provisioning"]).resolve() == PROVISIONING
    (provider,) = _provisioned("dashboards")
    dashboards_folder = grafana[provider["options"]["path"]]
    assert (REPO_ROOT / dashboards_folder / DASHBOARD.name).resolve() == DASHBOARD
    for datasource in _provisioned("datasources"):
        url = urlparse(datasource["url"])
        assert url.hostname in services, datasource["name"]
        assert url.port in _published_ports(services[url.hostname]), datasource["name"]


def test_every_service_sends_its_traces_to_jaeger(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name in SERVICE_CONFIGS:
        env = {
            k: interpolate_defaults(str(v))
            for k, v in services[name].get("environment", {}).items()
        }
        endpoint = urlparse(build_config(name, env).otlp_traces_endpoint)
        assert endpoint.hostname == "jaeger", name
        assert endpoint.port in _published_ports(services["jaeger"]), name
