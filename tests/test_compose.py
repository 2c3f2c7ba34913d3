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


# -- Kubernetes (deploy/k8s): rendered with `kubectl kustomize` when kubectl is there -------------------------

K8S = ROOT / "deploy" / "k8s"


def _render(overlay: Path) -> list[dict]:
    import shutil
    import subprocess

    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    out = subprocess.run(["kubectl", "kustomize", str(overlay)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def test_kustomizations_list_only_files_that_exist():
    for kust in K8S.rglob("kustomization.yaml"):
        spec = yaml.safe_load(kust.read_text())
        paths = list(spec.get("resources", []))
        paths += [f for gen in spec.get("configMapGenerator", []) for f in gen.get("files", [])]
        paths += [p["path"] for p in spec.get("patches", [])]
        for rel in paths:
            assert (kust.parent / rel).exists(), f"{kust.relative_to(ROOT)} names missing {rel}"


@pytest.mark.parametrize("overlay", ["base", "overlays/gpu"])
def test_kustomize_renders_a_consistent_deployment(overlay):
    from meshserve.workers.config import WorkerConfig

    docs = _render(K8S / overlay)
    by_kind = {}
    for d in docs:
        by_kind.setdefault(d["kind"], {})[d["metadata"]["name"]] = d
    assert {"meshserve-api", "meshserve-worker"} <= set(by_kind["Deployment"])
    assert "meshserve-redis" in by_kind["StatefulSet"] and "meshserve-redis" in by_kind["Service"]
    redis_args = by_kind["StatefulSet"]["meshserve-redis"]["spec"]["template"]["spec"]["containers"][0][
        "args"
    ]
    assert redis_args[redis_args.index("--appendonly") + 1] == "yes"

    worker = by_kind["Deployment"]["meshserve-worker"]["spec"]["template"]["spec"]
    (pools_cm,) = [c for name, c in by_kind["ConfigMap"].items() if name.startswith("meshserve-pools")]
    cfg = WorkerConfig.model_validate(yaml.safe_load(pools_cm["data"]["pools.yaml"]))
    # The drain must end before Kubernetes' SIGKILL.
    assert cfg.drain_seconds < worker["terminationGracePeriodSeconds"]
    container = worker["containers"][0]
    assert container["args"][:3] == ["worker", "--config", "/etc/meshserve/pools.yaml"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in worker["volumes"]}
    assert (
        mounts["pools"] == "/etc/meshserve"
        and volumes["pools"]["configMap"]["name"] == pools_cm["metadata"]["name"]
    )
    assert cfg.metrics_port == {p["name"]: p["containerPort"] for p in container["ports"]}["metrics"]
    for name in ("meshserve-api", "meshserve-worker"):
        spec = by_kind["Deployment"][name]["spec"]["template"]["spec"]
        env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
        assert env["MESHSERVE_REDIS_URL"].startswith("redis://meshserve-redis:6379")
    if overlay == "overlays/gpu":
        assert container["image"] == "meshserve:cuda"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == len(cfg.pools[0].device_ids)
        claim = volumes["models"]["persistentVolumeClaim"]["claimName"]
        assert claim in by_kind["PersistentVolumeClaim"]
        assert cfg.models["sdxl"].path.startswith(mounts["models"])
