"""deploy/k8s, validated offline: every overlay rendered by `kubectl kustomize`, the built-in kinds checked by
kubernetes-validate (strict), the custom resources against the upstream CRD schemas kept in deploy/k8s/schemas,
the alert rules by `promtool check rules`, and the rendered objects against each other and against the code:
ports, labels, selectors, Secret keys, pools.yaml vs. the pod's accelerators and mounts, KEDA's streams vs. the
store's key names, metric names vs. what the code registers. What needs a cluster is listed in docs/deploy.md.
"""

from __future__ import annotations

import base64
import copy
import functools
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ["dev-cpu", "gke-gpu", "gke-tpu-single-host", "gke-tpu-multihost"]
# kubectl here is 1.32; kubernetes-validate carries schemas for 1.25-1.37. GKE's regular channel is 1.32/1.33.
K8S_VERSION = "1.32.0"
SCHEMAS = K8S / "schemas"
NAMESPACE = "meshserve"
# The image tag each Dockerfile ACCELERATOR builds (deploy/Dockerfile's header), and the JAX platform it runs.
TAGS = {"cpu": "latest", "cuda": "cuda", "tpu": "tpu"}
PLATFORMS = {"cpu": "cpu", "cuda": "cuda", "tpu": "tpu"}
ACCELERATOR_RESOURCES = {"nvidia.com/gpu": "cuda", "google.com/tpu": "tpu"}


# -- rendering ---------------------------------------------------------------------------------------------------


def _kubectl() -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: `kubectl kustomize` renders the overlays")
    return kubectl


@functools.cache
def _render_dir(path: str) -> tuple[str, ...]:
    out = subprocess.run(
        [_kubectl(), "kustomize", path], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, f"kubectl kustomize {path}:\n{out.stderr}"
    return tuple(json.dumps(d) for d in yaml.safe_load_all(out.stdout) if d)


def render(path: Path) -> list[dict]:
    return [json.loads(d) for d in _render_dir(str(path))]


@functools.cache
def _all_components_text() -> tuple[str, ...]:
    """gke-gpu plus every component no overlay of its kind uses (kube-prometheus-stack's objects, the dashboard,
    the development Redis and its NetworkPolicy), in a kustomization the test writes to a temporary folder."""
    folder = Path(tempfile.mkdtemp(prefix="meshserve-k8s-"))
    to_k8s = os.path.relpath(K8S, folder)  # kustomize takes relative folder paths only
    try:
        gpu = yaml.safe_load((K8S / "overlays" / "gke-gpu" / "kustomization.yaml").read_text())
        comps = sorted(p.name for p in (K8S / "components").iterdir() if (p / "kustomization.yaml").exists())
        kust = {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "namespace": NAMESPACE,
            "labels": gpu["labels"],
            "resources": [f"{to_k8s}/overlays/gke-gpu"],
            "components": [
                f"{to_k8s}/components/{c}" for c in comps if f"../../components/{c}" not in gpu["components"]
            ],
            "secretGenerator": [
                {
                    "name": "meshserve-api",
                    "literals": [
                        "redis-url=redis://meshserve-redis:6379/0",
                        "redis-address=meshserve-redis:6379",
                        "redis-password=",
                    ],
                    "options": {"disableNameSuffixHash": True},
                }
            ],
        }
        (folder / "kustomization.yaml").write_text(yaml.safe_dump(kust))
        return _render_dir(str(folder))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def rendered(name: str) -> list[dict]:
    if name == "all-components":
        return [json.loads(d) for d in _all_components_text()]
    return render(K8S / "overlays" / name)


RENDERINGS = [*OVERLAYS, "all-components"]


def by_kind(docs: list[dict]) -> dict[str, dict[str, dict]]:
    out: dict[str, dict[str, dict]] = {}
    for d in docs:
        out.setdefault(d["kind"], {})[d["metadata"]["name"]] = d
    return out


def pod_templates(doc: dict) -> list[dict]:
    """The pod templates of a workload (a LeaderWorkerSet has two)."""
    spec = doc.get("spec", {})
    if doc["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        return [spec["template"]]
    if doc["kind"] == "LeaderWorkerSet":
        lwt = spec["leaderWorkerTemplate"]
        return [lwt[k] for k in ("leaderTemplate", "workerTemplate") if k in lwt]
    return []


def workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if pod_templates(d)]


def matches(selector: dict, labels: dict) -> bool:
    """A Kubernetes LabelSelector (matchLabels + matchExpressions) against a label set."""
    if not selector:
        return False
    for k, v in selector.get("matchLabels", {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def pods_selected(docs: list[dict], selector: dict) -> list[dict]:
    return [
        t for w in workloads(docs) for t in pod_templates(w) if matches(selector, t["metadata"]["labels"])
    ]


def component_pods(docs: list[dict], component: str) -> list[dict]:
    return [
        t
        for w in workloads(docs)
        for t in pod_templates(w)
        if t["metadata"]["labels"].get("app.kubernetes.io/component") == component
    ]


def container_ports(pod: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


# -- every overlay renders --------------------------------------------------------------------------------------


def test_the_overlays_are_the_four_documented_ones():
    found = {p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").exists()}
    assert found == set(OVERLAYS)
    docs = (ROOT / "docs" / "deploy.md").read_text()
    for name in OVERLAYS:
        assert f"deploy/k8s/overlays/{name}" in docs, f"docs/deploy.md does not show overlay {name}"


@pytest.mark.parametrize("name", RENDERINGS)
def test_kustomize_renders(name):
    kinds = by_kind(rendered(name))
    assert "meshserve-api" in kinds["Deployment"] and "Namespace" in kinds
    assert any(w["metadata"]["name"] == "meshserve-worker" for w in workloads(rendered(name)))


def test_every_component_and_worker_folder_is_rendered_somewhere():
    used = set()
    for kust in (K8S / "overlays").glob("*/kustomization.yaml"):
        spec = yaml.safe_load(kust.read_text())
        used |= {(kust.parent / p).resolve() for p in spec.get("resources", []) + spec.get("components", [])}
    components = {p.resolve() for p in (K8S / "components").iterdir() if p.is_dir()}
    rendered("all-components")  # renders every component
    workers = {p.resolve() for p in (K8S / "workers").iterdir() if p.is_dir()}
    assert workers <= used, f"worker folders no overlay uses: {workers - used}"
    assert components - used <= {
        (K8S / "components" / c).resolve() for c in ("prometheus-operator", "grafana-dashboards")
    }


# -- built-in kinds: kubernetes-validate --strict ---------------------------------------------------------------


def _custom_kinds() -> dict[tuple[str, str], dict]:
    out = {}
    for path in SCHEMAS.glob("*.json"):
        schema = json.loads(path.read_text())
        gvk = schema["x-kubernetes-group-version-kind"]
        out[(gvk["apiVersion"], gvk["kind"])] = schema
    return out


def _kubernetes_validate():
    return pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate is not installed (pip install kubernetes-validate)"
    )


@pytest.mark.parametrize("name", RENDERINGS)
def test_builtin_kinds_validate_strictly(name):
    kv = _kubernetes_validate()
    custom = _custom_kinds()
    checked = 0
    for doc in rendered(name):
        if (doc["apiVersion"], doc["kind"]) in custom:
            continue
        # Raises on an unknown field, a wrong type, a missing required field.
        kv.validate(doc, K8S_VERSION, strict=True)
        checked += 1
    assert checked >= 10


def test_the_strict_check_can_fail():
    kv = _kubernetes_validate()
    api = copy.deepcopy(by_kind(rendered("dev-cpu"))["Deployment"]["meshserve-api"])
    kv.validate(api, K8S_VERSION, strict=True)
    typo = copy.deepcopy(api)
    typo["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(typo, K8S_VERSION, strict=True)
    wrong_type = copy.deepcopy(api)
    wrong_type["spec"]["replicas"] = "two"
    with pytest.raises(kv.ValidationError):
        kv.validate(wrong_type, K8S_VERSION, strict=True)


# -- custom resources against the kept CRD schemas --------------------------------------------------------------


def _strict(schema):
    """What `kubectl apply --validate=strict` adds to a CRD schema: unknown fields are errors (deploy/k8s/schemas
    /README.md)."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if isinstance(schema, str) and schema.startswith("^(?i)"):
        return "(?i)^" + schema[5:]  # a Go pattern: Python's re wants the inline flag first
    if not isinstance(schema, dict):
        return schema
    out = {
        k: (_strict(v) if k != "properties" else {n: _strict(s) for n, s in v.items()})
        for k, v in schema.items()
    }
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@functools.cache
def _validator(api_version: str, kind: str) -> jsonschema.Validator:
    schema = _strict(_custom_kinds()[(api_version, kind)])
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    cls.check_schema(schema)
    return cls(schema)


def cr_errors(doc: dict) -> list[str]:
    errors = [
        f"{doc['kind']}/{doc['metadata']['name']} {'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in _validator(doc["apiVersion"], doc["kind"]).iter_errors(doc)
    ]
    if doc["kind"] == "LeaderWorkerSet":
        kv = _kubernetes_validate()
        for template in pod_templates(doc):  # the CRD's pod templates are core/v1 PodTemplateSpecs
            pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}}
            try:
                kv.validate({**pod_template, "template": template}, K8S_VERSION, strict=True)
            except kv.ValidationError as e:
                errors.append(f"LeaderWorkerSet pod template: {e.message}")
    return errors


def test_every_schema_names_its_upstream_source():
    readme = (SCHEMAS / "README.md").read_text()
    for path in SCHEMAS.glob("*.json"):
        schema = json.loads(path.read_text())
        commit = re.search(r"at commit ([0-9a-f]{40})", schema["$comment"]).group(1)
        assert commit in readme and f"`{path.name}`" in readme


@pytest.mark.parametrize("name", RENDERINGS)
def test_custom_resources_match_their_crd_schemas(name):
    custom = _custom_kinds()
    docs = [d for d in rendered(name) if (d["apiVersion"], d["kind"]) in custom]
    errors = [msg for d in docs for msg in cr_errors(d)]
    assert not errors, "\n".join(errors)
    if name != "dev-cpu":
        assert {"ScaledObject", "TriggerAuthentication"} <= {d["kind"] for d in docs}


def test_every_rendered_kind_has_a_schema():
    kv = _kubernetes_validate()
    custom = _custom_kinds()
    for name in RENDERINGS:
        for doc in rendered(name):
            if (doc["apiVersion"], doc["kind"]) not in custom:
                kv.validate(doc, K8S_VERSION, strict=True)  # SchemaNotFoundError for an unknown kind


def test_the_custom_resource_check_can_fail():
    docs = by_kind(rendered("all-components"))
    scaled = copy.deepcopy(docs["ScaledObject"]["meshserve-worker-sdxl"])
    assert not cr_errors(scaled)
    scaled["spec"]["triggers"][0]["metdata"] = scaled["spec"]["triggers"][0].pop("metadata")
    assert len(cr_errors(scaled)) >= 2  # unknown field and missing required `metadata`
    monitoring = copy.deepcopy(docs["PodMonitoring"]["meshserve-worker"])
    monitoring["spec"]["endpoints"][0]["intervall"] = "15s"
    assert cr_errors(monitoring)
    rule = copy.deepcopy(docs["PrometheusRule"]["meshserve"])
    rule["spec"]["groups"][0]["rules"][0]["for"] = "two minutes"
    assert cr_errors(rule)
    gke_rules = copy.deepcopy(docs["Rules"]["meshserve"])
    assert not cr_errors(gke_rules)
    del gke_rules["spec"]["groups"][0]["interval"]  # required by managed Prometheus' rule evaluator
    assert cr_errors(gke_rules)
    lws = copy.deepcopy(by_kind(rendered("gke-tpu-multihost"))["LeaderWorkerSet"]["meshserve-worker"])
    assert not cr_errors(lws)
    lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Always"
    lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["imagePullPolice"] = "x"
    messages = cr_errors(lws)
    assert any("restartPolicy" in m for m in messages) and any("pod template" in m for m in messages)


# -- alert rules and dashboards ---------------------------------------------------------------------------------


def _prometheus_rule() -> dict:
    return by_kind(rendered("all-components"))["PrometheusRule"]["meshserve"]


def test_prometheusrule_and_gke_rules_hold_the_compose_rules():
    compose_rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "rules.yml").read_text())
    assert _prometheus_rule()["spec"]["groups"] == compose_rules["groups"]
    for name in ("gke-gpu", "gke-tpu-single-host", "gke-tpu-multihost"):
        assert by_kind(rendered(name))["Rules"]["meshserve"]["spec"]["groups"] == compose_rules["groups"]


def test_alerts_cover_what_the_issue_asks_for():
    exprs = {r["alert"]: r["expr"] for g in _prometheus_rule()["spec"]["groups"] for r in g["rules"]}
    assert any("meshserve_worker_queue_wait_seconds_bucket" in e and "0.95" in e for e in exprs.values())
    assert any("meshserve_jobs_dead_lettered_total" in e for e in exprs.values())
    assert any('meshserve_pools{ready="true"}' in e and "meshserve_queue_depth" in e for e in exprs.values())
    assert any("meshserve_worker_compile_seconds_count" in e for e in exprs.values())  # compilation storms


def _promtool() -> str:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    return promtool


def test_alert_rules_pass_promtool(tmp_path):
    promtool = _promtool()
    as_file = tmp_path / "prometheusrule.yml"
    as_file.write_text(yaml.safe_dump({"groups": _prometheus_rule()["spec"]["groups"]}))
    for path in (ROOT / "deploy" / "prometheus" / "rules.yml", as_file):
        out = subprocess.run(
            [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stdout + out.stderr
    broken = tmp_path / "broken.yml"
    groups = copy.deepcopy(_prometheus_rule()["spec"]["groups"])
    groups[0]["rules"][0]["expr"] = "max(meshserve_pools{ready=true}"  # unquoted label value, unclosed paren
    broken.write_text(yaml.safe_dump({"groups": groups}))
    out = subprocess.run(
        [promtool, "check", "rules", str(broken)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode != 0


def _dashboard_configmap() -> dict:
    return by_kind(rendered("all-components"))["ConfigMap"]["meshserve-grafana-dashboards"]


def test_dashboard_configmap_holds_the_compose_dashboard():
    cm = _dashboard_configmap()
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    compose_dashboard = (ROOT / "deploy" / "grafana" / "dashboards" / "meshserve.json").read_text()
    assert cm["data"]["meshserve.json"] == compose_dashboard


def _queried_metrics() -> set[str]:
    names = set()
    for group in _prometheus_rule()["spec"]["groups"]:
        for rule in group["rules"]:
            names |= set(re.findall(r"\bmeshserve_[a-z_]+", rule["expr"]))
    dashboard = json.loads(_dashboard_configmap()["data"]["meshserve.json"])
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            names |= set(re.findall(r"\bmeshserve_[a-z_]+", target["expr"]))
    return names


def _registered_metric_names() -> set[str]:
    from prometheus_client import REGISTRY

    import meshserve.service.metrics  # noqa: F401 - registers the API's metrics (and its scrape-time collector)
    import meshserve.workers.metrics  # noqa: F401 - registers the worker's metrics

    # A labelled metric has no samples before its first use: derive the series names from the family's type.
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "info": ["_info"]}
    return {family.name + s for family in REGISTRY.collect() for s in suffixes.get(family.type, [""])}


def test_alerts_and_dashboards_query_only_metrics_the_code_exports():
    used = _queried_metrics()
    assert len(used) >= 15
    missing = sorted(used - _registered_metric_names())
    assert not missing, f"alerts/dashboards query metrics no code exports: {missing}"


# -- consistency: labels, selectors, ports ----------------------------------------------------------------------


@pytest.mark.parametrize("name", RENDERINGS)
def test_labels_namespace_and_selectors(name):
    docs = rendered(name)
    for d in docs:
        assert d["metadata"].get("labels", {}).get("app.kubernetes.io/part-of") == "meshserve", d["metadata"]
        if d["kind"] != "Namespace":
            assert d["metadata"]["namespace"] == NAMESPACE, d["metadata"]["name"]
    for w in workloads(docs):
        if w["kind"] != "LeaderWorkerSet":
            assert matches(w["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"]), w["metadata"]
    for component in ("api", "worker"):
        assert component_pods(docs, component), component
    kinds = by_kind(docs)
    for svc in kinds["Service"].values():
        pods = pods_selected(docs, {"matchLabels": svc["spec"]["selector"]})
        assert pods, f"Service {svc['metadata']['name']} selects no pod"
        for port in svc["spec"]["ports"]:
            for pod in pods:
                assert port["targetPort"] in container_ports(pod), (svc["metadata"]["name"], port)
    for pdb in kinds["PodDisruptionBudget"].values():
        assert pods_selected(docs, pdb["spec"]["selector"]), pdb["metadata"]["name"]
    for hpa in kinds["HorizontalPodAutoscaler"].values():
        ref = hpa["spec"]["scaleTargetRef"]
        assert ref["name"] in kinds[ref["kind"]]


@pytest.mark.parametrize("name", RENDERINGS)
def test_monitors_select_pods_and_ports_that_exist(name):
    kinds = by_kind(rendered(name))
    docs = rendered(name)
    for sm in kinds.get("ServiceMonitor", {}).values():
        services = [
            s for s in kinds["Service"].values() if matches(sm["spec"]["selector"], s["metadata"]["labels"])
        ]
        assert services, sm["metadata"]["name"]
        for ep in sm["spec"]["endpoints"]:
            assert all(ep["port"] in {p["name"] for p in s["spec"]["ports"]} for s in services)
    monitors = [(m, m["spec"]["podMetricsEndpoints"]) for m in kinds.get("PodMonitor", {}).values()]
    monitors += [(m, m["spec"]["endpoints"]) for m in kinds.get("PodMonitoring", {}).values()]
    for monitor, endpoints in monitors:
        pods = pods_selected(docs, monitor["spec"]["selector"])
        assert pods, monitor["metadata"]["name"]
        for ep in endpoints:
            assert all(ep["port"] in container_ports(p) for p in pods)
    if name != "dev-cpu":
        scraped = {m["metadata"]["name"] for m, _ in monitors} | set(kinds.get("ServiceMonitor", {}))
        assert {"meshserve-api", "meshserve-worker"} <= scraped


@pytest.mark.parametrize("name", ["dev-cpu", "all-components"])
def test_only_the_api_workers_and_keda_reach_redis(name):
    docs = rendered(name)
    (policy,) = by_kind(docs)["NetworkPolicy"].values()
    (redis,) = pods_selected(docs, policy["spec"]["podSelector"])
    assert redis["metadata"]["labels"]["app.kubernetes.io/component"] == "redis"
    (rule,) = policy["spec"]["ingress"]
    assert [p["port"] for p in rule["ports"]] == [container_ports(redis)["redis"]]
    in_namespace = [p["podSelector"] for p in rule["from"] if "namespaceSelector" not in p]
    admitted = {
        t["metadata"]["labels"]["app.kubernetes.io/component"]
        for t in (tpl for w in workloads(docs) for tpl in pod_templates(w))
        if any(matches(s, t["metadata"]["labels"]) for s in in_namespace)
    }
    assert admitted == {"api", "worker"}
    keda = [p for p in rule["from"] if "namespaceSelector" in p]
    assert keda and keda[0]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] == "keda"
    args = redis["spec"]["containers"][0]["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    assert by_kind(docs)["StatefulSet"]["meshserve-redis"]["spec"]["volumeClaimTemplates"]


# -- consistency: the pods -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", RENDERINGS)
def test_every_container_is_locked_down_and_bounded(name):
    for w in workloads(rendered(name)):
        for pod in pod_templates(w):
            spec = pod["spec"]
            assert (
                spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] > 0
            )
            assert spec.get("automountServiceAccountToken") is False
            for c in spec["containers"]:
                sc = c["securityContext"]
                assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
                assert sc["capabilities"]["drop"] == ["ALL"]
                assert {"cpu", "memory"} <= set(c["resources"]["requests"])
                assert "memory" in c["resources"]["limits"]
                assert c.get("livenessProbe") and c.get("readinessProbe"), (w["metadata"]["name"], c["name"])


def _dockerfile_accelerators() -> set[str]:
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    return set(re.findall(r"^\s+(\w+)\) backend=", text, flags=re.M))


def test_dockerfile_builds_the_three_images_the_manifests_use():
    assert _dockerfile_accelerators() == set(TAGS)
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    assert re.search(r"^USER 10001:10001$", text, flags=re.M)
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert compose["services"]["worker-gpu"]["build"]["args"]["ACCELERATOR"] == "cuda"
    assert compose["services"]["worker-gpu"]["image"] == "meshserve:cuda"


@pytest.mark.parametrize("name", RENDERINGS)
def test_api_pods(name):
    (api,) = by_kind(rendered(name))["Deployment"]["meshserve-api"]["spec"]["template"]["spec"]["containers"]
    port = container_ports({"spec": {"containers": [api]}})["http"]
    assert api["args"][:1] == ["api"] and api["args"][api["args"].index("--port") + 1] == str(port)
    assert api["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert api["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "http"}
    env = env_of(api)
    assert env["MESHSERVE_AUTH"]["value"] == "keys"
    assert env["MESHSERVE_REDIS_URL"]["valueFrom"]["secretKeyRef"]["key"] == "redis-url"
    assert api["image"] == "meshserve:latest"


def _documented_secret_keys() -> set[str]:
    text = (ROOT / "docs" / "deploy.md").read_text()
    command = re.search(r"create secret generic meshserve-api(.*?)```", text, flags=re.S)
    assert command, "docs/deploy.md must show `kubectl create secret generic meshserve-api ...`"
    return set(re.findall(r"--from-literal=([a-z-]+)=", command.group(1)))


@pytest.mark.parametrize("name", RENDERINGS)
def test_secret_references_have_their_keys(name):
    docs = rendered(name)
    kinds = by_kind(docs)
    refs = set()
    for w in workloads(docs):
        for pod in pod_templates(w):
            for c in pod["spec"]["containers"]:
                for e in c.get("env", []):
                    ref = e.get("valueFrom", {}).get("secretKeyRef")
                    if ref:
                        refs.add((ref["name"], ref["key"], bool(ref.get("optional"))))
    for auth in kinds.get("TriggerAuthentication", {}).values():
        refs |= {(r["name"], r["key"], False) for r in auth["spec"]["secretTargetRef"]}
    assert refs
    secrets = kinds.get("Secret", {})
    documented = _documented_secret_keys()
    for secret_name, key, optional in refs:
        assert secret_name == "meshserve-api"  # the fixed name docs/deploy.md creates
        assert key in documented, f"{key} is not in docs/deploy.md's `kubectl create secret` command"
        # dev-cpu generates the Secret (an optional key, the admin key, may be left out of it); the GKE overlays
        # expect it created out of band.
        if secrets and not optional:
            assert key in secrets[secret_name]["data"]
    if name == "dev-cpu":
        (secret,) = secrets.values()
        url = base64.b64decode(secret["data"]["redis-url"]).decode()
        address = base64.b64decode(secret["data"]["redis-address"]).decode()
        assert url.startswith(f"redis://{address}/")
        service, port = address.split(":")
        assert service in kinds["Service"] and int(port) in [
            p["port"] for p in kinds["Service"][service]["spec"]["ports"]
        ]


def _pools(docs: list[dict], pod: dict):
    """The pool config a worker pod mounts at /etc/meshserve (validated as the worker validates it)."""
    from meshserve.workers.config import WorkerConfig

    (container,) = pod["spec"]["containers"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    config_path = next(a for a in container.get("args", []) if "pools.yaml" in a)
    config_path = re.search(r"(/\S+pools\.yaml)", config_path).group(1)
    vol = next(n for n, m in mounts.items() if config_path.startswith(m + "/"))
    cm = by_kind(docs)["ConfigMap"][volumes[vol]["configMap"]["name"]]
    return WorkerConfig.model_validate(yaml.safe_load(cm["data"][Path(config_path).name])), mounts, volumes


def _accelerator(container: dict) -> tuple[str, int]:
    limits = container["resources"]["limits"]
    for resource, accelerator in ACCELERATOR_RESOURCES.items():
        if resource in limits:
            assert container["resources"]["requests"][resource] == limits[resource]
            return accelerator, int(limits[resource])
    return "cpu", 0


@pytest.mark.parametrize("name", RENDERINGS)
def test_worker_pods_match_their_pools(name):
    docs = rendered(name)
    kinds = by_kind(docs)
    workers = [w for w in workloads(docs) if w["metadata"]["name"] == "meshserve-worker"]
    assert len(workers) == 1
    (worker,) = workers
    hosts = worker["spec"]["leaderWorkerTemplate"]["size"] if worker["kind"] == "LeaderWorkerSet" else 1
    for pod in pod_templates(worker):
        cfg, mounts, volumes = _pools(docs, pod)
        (container,) = pod["spec"]["containers"]
        env = env_of(container)
        accelerator, per_pod = _accelerator(container)
        assert container["image"] == f"meshserve:{TAGS[accelerator]}"
        assert env["JAX_PLATFORMS"]["value"] == PLATFORMS[accelerator]
        devices = sorted(d for p in cfg.pools for d in p.device_ids)
        if accelerator != "cpu":
            # Every device of the pod (times the hosts of a multi-host group) is in exactly one pool.
            assert devices == list(range(per_pod * hosts)), (devices, per_pod, hosts)
        selectors = pod["spec"].get("nodeSelector", {})
        if accelerator == "tpu":
            topology = selectors["cloud.google.com/gke-tpu-topology"]
            assert math.prod(int(x) for x in topology.split("x")) == per_pod * hosts
            assert selectors["cloud.google.com/gke-tpu-accelerator"].startswith("tpu-")
        if accelerator == "cuda":
            assert selectors["cloud.google.com/gke-accelerator"] in {"nvidia-l4", "nvidia-h100-80gb"}
        # Ports and probes agree with pools.yaml.
        assert container_ports(pod)["metrics"] == cfg.metrics_port
        assert container["livenessProbe"]["tcpSocket"]["port"] == "metrics"
        probe = container["readinessProbe"]["exec"]["command"][-1]
        assert f"127.0.0.1:{cfg.metrics_port}/metrics" in probe
        # The drain ends before Kubernetes' SIGKILL.
        assert cfg.drain_seconds < pod["spec"]["terminationGracePeriodSeconds"]
        # Writable places: the compilation cache and MESHSERVE_CACHE are on volumes (the root fs is read-only):
        # the pod's emptyDirs, or a claim it mounts writable (components/shared-compilation-cache).
        writable = {
            m
            for n, m in mounts.items()
            if "emptyDir" in volumes[n]
            or (
                "persistentVolumeClaim" in volumes[n]
                and not volumes[n]["persistentVolumeClaim"].get("readOnly")
            )
        }
        assert any(cfg.compilation_cache_dir.startswith(m + "/") for m in writable)
        assert env["MESHSERVE_CACHE"]["value"] in writable and "/tmp" in writable
        for model in cfg.models.values():
            if model.path is not None:
                claim_mounts = [m for n, m in mounts.items() if "persistentVolumeClaim" in volumes[n]]
                assert any(model.path.startswith(m + "/") for m in claim_mounts), model.path
                for n in mounts:
                    if "persistentVolumeClaim" in volumes[n]:
                        assert (
                            volumes[n]["persistentVolumeClaim"]["claimName"] in kinds["PersistentVolumeClaim"]
                        )
        assert env["MESHSERVE_REDIS_URL"]["valueFrom"]["secretKeyRef"]["key"] == "redis-url"
        assert pod["spec"]["serviceAccountName"] in kinds["ServiceAccount"]


def test_multihost_group_is_one_slice_restarted_together():
    (lws,) = by_kind(rendered("gke-tpu-multihost"))["LeaderWorkerSet"].values()
    lwt = lws["spec"]["leaderWorkerTemplate"]
    assert lwt["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert lwt["leaderTemplate"] == lwt["workerTemplate"]
    (container,) = lwt["leaderTemplate"]["spec"]["containers"]
    script = container["args"][0]
    coordinator_port = container_ports(lwt["leaderTemplate"])["coordinator"]
    assert f'MESHSERVE_COORDINATOR="$LWS_LEADER_ADDRESS:{coordinator_port}"' in script
    assert 'MESHSERVE_NUM_PROCESSES="$LWS_GROUP_SIZE"' in script
    assert 'MESHSERVE_PROCESS_ID="$LWS_WORKER_INDEX"' in script
    assert script.rstrip().endswith("exec meshserve worker --config /etc/meshserve/pools.yaml")


# -- KEDA: one ScaledObject per model, on the service's stream names ---------------------------------------------


def _store(docs: list[dict]):
    """The store with the key prefix the rendered pods use (MESHSERVE_KEY_PREFIX, else the settings' default);
    only its key names are used, no connection is made."""
    from meshserve.service.settings import Settings
    from meshserve.service.store import Store

    prefixes = {
        env_of(c).get("MESHSERVE_KEY_PREFIX", {}).get("value", Settings.model_fields["key_prefix"].default)
        for w in workloads(docs)
        for t in pod_templates(w)
        for c in t["spec"]["containers"]
        if t["metadata"]["labels"]["app.kubernetes.io/component"] in ("api", "worker")
    }
    (prefix,) = prefixes  # the API and every worker must agree on it
    return Store(Settings(redis_url="redis://127.0.0.1:6379/0", key_prefix=prefix))


@pytest.mark.parametrize("name", [n for n in RENDERINGS if n != "dev-cpu"])
def test_keda_scales_each_model_on_its_streams(name):
    from meshserve.service.contract import PRIORITY_ORDER
    from meshserve.service.store import GROUP

    docs = rendered(name)
    kinds = by_kind(docs)
    store = _store(docs)
    served: dict[str, set[str]] = {}
    for so in kinds["ScaledObject"].values():
        ref = so["spec"]["scaleTargetRef"]
        (target,) = [
            w for w in workloads(docs) if w["kind"] == ref["kind"] and w["metadata"]["name"] == ref["name"]
        ]
        assert ref["apiVersion"] == target["apiVersion"]
        cfg, _, _ = _pools(docs, pod_templates(target)[0])
        triggers = so["spec"]["triggers"]
        assert {t["type"] for t in triggers} == {"redis-streams"}
        streams = {t["metadata"]["stream"] for t in triggers}
        models = {m for m in cfg.models if {store.stream_key(m, p) for p in PRIORITY_ORDER} == streams}
        assert len(models) == 1, f"{so['metadata']['name']}: streams {streams} are not one model's"
        (model,) = models
        served.setdefault(model, set()).add(so["metadata"]["name"])
        for mode in ("lagCount", "pendingEntriesCount"):  # queued and running, on every priority
            assert {t["metadata"]["stream"] for t in triggers if mode in t["metadata"]} == streams
        for t in triggers:
            assert t["metadata"]["consumerGroup"] == GROUP
            assert t["authenticationRef"]["name"] in kinds["TriggerAuthentication"]
            if "lagCount" in t["metadata"]:
                assert t["metadata"]["activationLagCount"] == "0"
        modifiers = so["spec"]["advanced"]["scalingModifiers"]
        assert set(re.findall(r"[a-z_]+", modifiers["formula"])) == {t["name"] for t in triggers}
        # The per-replica target is the jobs one replica runs at once: max_batch summed over its pools.
        assert int(modifiers["target"]) == sum(p.max_batch for p in cfg.pools if model in p.models)
        # With no ready pool the API refuses jobs, so a model at zero workers would never scale up.
        assert so["spec"]["minReplicaCount"] >= 1
    assert all(len(objs) == 1 for objs in served.values())
    # KEDA reads the database the service writes to (the redis-url's path; docs/deploy.md uses /0).
    db_indexes = {
        t["metadata"]["databaseIndex"]
        for so in kinds["ScaledObject"].values()
        for t in so["spec"]["triggers"]
    }
    urls = [base64.b64decode(s["data"]["redis-url"]).decode() for s in kinds.get("Secret", {}).values()]
    urls += re.findall(r"redis-url=(\S+)", (ROOT / "docs" / "deploy.md").read_text())
    assert urls and {u.rsplit("/", 1)[1] for u in urls} == db_indexes == {"0"}
    for auth in kinds["TriggerAuthentication"].values():
        assert {r["parameter"] for r in auth["spec"]["secretTargetRef"]} == {"address", "password"}


# -- the worker's readiness probe, run against a real /metrics page ----------------------------------------------


def _serve_registry(registry) -> tuple[HTTPServer, int]:
    from prometheus_client import generate_latest

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


def test_worker_readiness_probe_reads_pool_readiness():
    from prometheus_client import CollectorRegistry, Gauge

    from meshserve.workers.metrics import POOL_READY

    (pod,) = pod_templates(by_kind(rendered("dev-cpu"))["Deployment"]["meshserve-worker"])
    command = pod["spec"]["containers"][0]["readinessProbe"]["exec"]["command"]
    assert command[:2] == ["python", "-c"]
    registry = CollectorRegistry()
    # The worker's own gauge name and labels, in a private registry.
    ready = Gauge(POOL_READY._name, POOL_READY._documentation, POOL_READY._labelnames, registry=registry)
    server, port = _serve_registry(registry)
    script = command[2].replace("127.0.0.1:9400", f"127.0.0.1:{port}")

    def probe() -> int:
        return subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=30).returncode

    try:
        assert probe() == 1  # no pool registered yet
        ready.labels("sdxl-0").set(0)
        ready.labels("sdxl-1").set(1)
        assert probe() == 1  # one pool still warming up
        ready.labels("sdxl-0").set(1)
        assert probe() == 0
    finally:
        server.shutdown()
