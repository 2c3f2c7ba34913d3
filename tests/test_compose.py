"""docker-compose.yml against the compose specification's JSON schema (the copy check-jsonschema vendors), and
every file it and the deploy/ configs point at exists and agrees (ports, metric names, mount paths)."""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def validator() -> jsonschema.Validator:
    text = (
        resources.files("check_jsonschema").joinpath("builtin_schemas/vendor/compose-spec.json").read_text()
    )
    schema = json.loads(text)
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def test_compose_file_matches_the_spec(compose, validator):
    errors = sorted(validator.iter_errors(compose), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)


def test_the_schema_check_can_fail(compose, validator):
    broken = json.loads(json.dumps(compose))
    broken["services"]["redis"]["healthcheck"]["intervall"] = "5s"
    broken["services"]["api"]["ports"] = "8000:8000"  # must be a list
    assert len(list(validator.iter_errors(broken))) >= 2


def test_services_and_their_roles(compose):
    services = compose["services"]
    assert {"redis", "api", "worker", "worker-gpu", "prometheus", "grafana"} <= set(services)
    redis = services["redis"]
    assert (
        "--appendonly" in redis["command"]
        and redis["command"][redis["command"].index("--appendonly") + 1] == "yes"
    )
    assert "redis-cli" in redis["healthcheck"]["test"]
    for name in ("api", "worker"):
        svc = services[name]
        assert svc["environment"]["MESHSERVE_REDIS_URL"].startswith("redis://redis:")
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
    assert services["api"]["command"][0] == "api" and services["worker"]["command"][:2] == [
        "worker",
        "--config",
    ]
    assert "profiles" not in services["worker"]  # the CPU worker runs by default
    gpu = services["worker-gpu"]
    assert gpu["profiles"] == ["gpu"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert any(v.endswith(":/models:ro") for v in gpu["volumes"])


def test_the_api_runs_with_keys_and_takes_the_admin_key_from_the_environment(compose):
    env = compose["services"]["api"]["environment"]
    assert env["MESHSERVE_AUTH"] == "keys"
    # Interpolated from .env or the shell, required (`:?`): the key is never written in the file.
    assert env["MESHSERVE_ADMIN_KEY"].startswith("${MESHSERVE_ADMIN_KEY:?")
    assert "msk_" not in env["MESHSERVE_ADMIN_KEY"].split(":?", 1)[0]
    assert env["MESHSERVE_REDIS_URL"].startswith("redis://redis:")


def _host_paths(compose):
    for name, svc in compose["services"].items():
        build = svc.get("build")
        if build:
            yield name, ROOT / build["context"]
            yield name, ROOT / build["context"] / build["dockerfile"]
        for vol in svc.get("volumes", []):
            source = vol.split(":")[0]
            if source.startswith("./"):
                yield name, ROOT / source


def test_every_referenced_path_exists(compose):
    missing = [f"{svc}: {path.relative_to(ROOT)}" for svc, path in _host_paths(compose) if not path.exists()]
    assert not missing, missing
    assert len(list(_host_paths(compose))) >= 8


def test_dockerfile_copies_what_exists():
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    sources = [
        line.split()[1] for line in text.splitlines() if line.startswith("COPY ") and "--from" not in line
    ]
    for src in sources:
        assert list(ROOT.glob(src)) or src.endswith("*"), f"Dockerfile copies missing {src}"
    assert 'ENTRYPOINT ["meshserve"]' in text


def test_worker_configs_mounted_by_compose_validate_and_expose_the_scraped_port(compose):
    from meshserve.workers.config import load_config

    prom = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in prom["scrape_configs"]}
    worker_port = jobs["meshserve-worker"]["dns_sd_configs"][0]["port"]
    assert set(jobs["meshserve-worker"]["dns_sd_configs"][0]["names"]) == {"worker", "worker-gpu"}
    for name in ("worker", "worker-gpu"):
        mount = next(
            v for v in compose["services"][name]["volumes"] if v.endswith(":/etc/meshserve/pools.yaml:ro")
        )
        cfg = load_config(ROOT / mount.split(":")[0])
        assert cfg.metrics_port == worker_port
    api_port = jobs["meshserve-api"]["dns_sd_configs"][0]["port"]
    assert f"{api_port}:{api_port}" in compose["services"]["api"]["ports"]
    assert "--port" in compose["services"]["api"]["command"]
    assert str(api_port) == compose["services"]["api"]["command"][-1]
    # Rule files named in prometheus.yml are mounted there.
    mounts = {
        v.split(":")[1]: v.split(":")[0] for v in compose["services"]["prometheus"]["volumes"] if ":" in v
    }
    for rule_file in prom["rule_files"]:
        assert rule_file in mounts and (ROOT / mounts[rule_file]).is_file()
        yaml.safe_load((ROOT / mounts[rule_file]).read_text())


def test_grafana_provisioning_points_at_the_mounted_dashboards(compose):
    grafana = compose["services"]["grafana"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in grafana["volumes"] if v.startswith("./")}
    provisioning = ROOT / mounts["/etc/grafana/provisioning"]
    providers = yaml.safe_load((provisioning / "dashboards" / "meshserve.yml").read_text())["providers"]
    dash_dir = providers[0]["options"]["path"]
    assert dash_dir in mounts
    dashboards = list((ROOT / mounts[dash_dir]).glob("*.json"))
    assert dashboards
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (ROOT / mounts[dash_dir] / Path(home).name).is_file() and home.startswith(dash_dir)
    datasource = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"][
        0
    ]
    assert datasource["url"] == "http://prometheus:9090"


def _queried_metrics() -> set[str]:
    """Every meshserve_* series the dashboards and alert rules query."""
    names = set()
    for path in (ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"):
        dash = json.loads(path.read_text())
        assert dash["panels"], path
        for panel in dash["panels"]:
            for target in panel.get("targets", []):
                names |= set(re.findall(r"\bmeshserve_[a-z_]+", target["expr"]))
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "rules.yml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            names |= set(re.findall(r"\bmeshserve_[a-z_]+", rule["expr"]))
    return names


def _registered_metric_names() -> set[str]:
    from prometheus_client import REGISTRY

    import meshserve.service.metrics  # noqa: F401 - registers the API's metrics (and its scrape-time collector)
    import meshserve.workers.metrics  # noqa: F401 - registers the worker's metrics

    # A labelled metric has no samples before its first use: derive the series names from the family's type.
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "info": ["_info"]}
    names = set()
    for family in REGISTRY.collect():
        names |= {family.name + s for s in suffixes.get(family.type, [""])}
    return names


def test_dashboards_and_alerts_query_only_metrics_that_exist():
    used = _queried_metrics()
    assert any(n.startswith("meshserve_worker_") for n in used) and "meshserve_queue_depth" in used
    missing = sorted(used - _registered_metric_names())
    assert not missing, f"dashboards/rules query metrics no code exports: {missing}"


# Kubernetes (deploy/k8s) is validated by tests/deploy/test_k8s.py.
