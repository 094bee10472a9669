"""deploy/k8s (and deploy/k8s-pd, PD's prefill and decode pools over the same Services and expert pool): every
manifest validates against the Kubernetes schema (kubernetes-validate's bundled copy, no network), each pool is a
workload scaled by its own HPA on a gauge that /metrics exports, the pools meet at the leader's store, and the
probes ask the leader's /health."""
from __future__ import annotations

import contextlib
import copy
import io
import re
from pathlib import Path
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml
from prometheus_client import CollectorRegistry

from launch.frontend.metrics import _EngineSeries
from tests.launch.frontend.test_http_metrics import make_comm, make_stats

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
PD = K8S.parent / "k8s-pd"
# what each deployment applies (deploy/README.md): PD swaps the attention pool and the adapter rules for its own
DEPLOYMENTS = {"colocated": [K8S], "pd": [PD, K8S / "services.yaml", K8S / "expert-pool.yaml"]}
ROLES = {"colocated": {"attention", "expert"}, "pd": {"attention", "decode", "expert"}}
K8S_VERSION = "1.30"     # a version whose schema kubernetes-validate bundles (1.25 to 1.37 in 1.37.0)
ENTRY = "launch.serve"
POD_NAME = "statefulset.kubernetes.io/pod-name"


def load_docs(parts: list[Path]) -> list[tuple[str, dict]]:
    """(path relative to its directory, document) of every manifest in parts (directories, searched recursively,
    and files)."""
    docs = []
    for part in parts:
        base = part if part.is_dir() else part.parent
        for path in sorted(part.rglob("*.yaml")) if part.is_dir() else [part]:
            with open(path) as f:
                docs += [(path.relative_to(base).as_posix(), d) for d in yaml.safe_load_all(f) if d is not None]
    return docs


@pytest.fixture(scope="module", params=list(DEPLOYMENTS))
def deployment(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def docs(deployment) -> list[tuple[str, dict]]:
    return load_docs(DEPLOYMENTS[deployment])


def of_kind(docs, kind: str) -> list[dict]:
    return [d for _, d in docs if d["kind"] == kind]


def named(docs, kind: str, name: str) -> dict:
    found = [d for d in of_kind(docs, kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name!r}, found {len(found)}"
    return found[0]


def container(workload: dict) -> dict:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    return c


def serve_args(workload: dict) -> list[str]:
    """The arguments launch.serve gets: what follows `-m launch.serve` in the container's command line."""
    c = container(workload)
    argv = c.get("command", []) + c.get("args", [])
    assert argv[argv.index(ENTRY) - 1] == "-m", f"{workload['metadata']['name']}: not run as -m {ENTRY}"
    return argv[argv.index(ENTRY) + 1:]


def flag(args: list[str], name: str) -> str:
    for i, a in enumerate(args):
        if a == name:
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    raise AssertionError(f"no {name} in {args}")


def pools(docs) -> dict[str, dict]:
    """--role -> the workload that runs that pool."""
    out = {}
    for kind in ("StatefulSet", "Deployment"):
        for w in of_kind(docs, kind):
            role = flag(serve_args(w), "--role")
            assert role not in out, f"two workloads run --role {role}"
            out[role] = w
    return out


def selects(service: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in service["spec"]["selector"].items())


def leader_labels(attention: dict) -> dict:
    """The labels of the attention StatefulSet's pod 0 (the leader)."""
    return {**attention["spec"]["template"]["metadata"]["labels"], POD_NAME: f"{attention['metadata']['name']}-0"}


def exported_gauges() -> dict[str, list]:
    """name -> samples of every gauge family one /metrics scrape yields on hand-made stats (with PD: one prefill
    rank of the two)."""
    pd = {**make_stats()["pd"], "prefill_ranks": 1}
    reg = CollectorRegistry()
    reg.register(_EngineSeries(make_stats(pd=pd), make_comm()))
    return {fam.name: fam.samples for fam in reg.collect() if fam.type == "gauge"}


def test_every_manifest_validates_against_the_kubernetes_schema(docs):
    assert docs, f"no manifests under {K8S}"
    for path, doc in docs:   # strict: a misspelt or misplaced field is an error, not ignored
        assert kubernetes_validate.validate(doc, K8S_VERSION, strict=True) == K8S_VERSION, path


def test_the_schema_check_catches_a_misspelt_field(docs):
    workload = copy.deepcopy(pools(docs)["expert"])
    container(workload)["livenessProbe"]["exec"]["comand"] = ["true"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(workload, K8S_VERSION, strict=True)


def test_each_pool_is_a_workload_scaled_by_its_own_hpa(docs, deployment):
    by_role = pools(docs)
    assert set(by_role) == ROLES[deployment]
    assert by_role["attention"]["kind"] == "StatefulSet"   # pod 0 is the leader and keeps its name
    hpas = of_kind(docs, "HorizontalPodAutoscaler")
    assert len(hpas) == len(by_role)
    targets = {(h["spec"]["scaleTargetRef"]["kind"], h["spec"]["scaleTargetRef"]["name"]) for h in hpas}
    assert targets == {(w["kind"], w["metadata"]["name"]) for w in by_role.values()}
    for h in hpas:
        assert h["apiVersion"] == "autoscaling/v2"
        assert h["spec"]["scaleTargetRef"]["apiVersion"] == "apps/v1"
        assert 1 <= h["spec"]["minReplicas"] <= h["spec"]["maxReplicas"]   # the leader never scales away


def hpa_series(hpa: dict) -> tuple[str, dict]:
    """The series an HPA scales on: the metric's name and its selector's labels beyond service (a pool's)."""
    (m,) = hpa["spec"]["metrics"]
    assert m["type"] == "External" and m["external"]["target"]["type"] == "Value"
    labels = dict(m["external"]["metric"]["selector"]["matchLabels"])
    assert labels.pop("service") == "afserve"
    return m["external"]["metric"]["name"], labels


def test_hpa_metrics_are_the_pool_gauges_that_metrics_exports(docs, deployment):
    gauges = exported_gauges()
    by_target = {h["spec"]["scaleTargetRef"]["name"]: hpa_series(h) for h in of_kind(docs, "HorizontalPodAutoscaler")}
    for name, labels in by_target.values():   # a gauge /metrics exports, with exactly those labels
        assert "_pool_" in name and any(s.labels == labels for s in gauges.get(name, [])), (name, labels)
    assert len({(n, tuple(sorted(lb.items()))) for n, lb in by_target.values()}) == len(by_target)
    for role, w in pools(docs).items():   # each pool scales on its own pool's gauge
        name, labels = by_target[w["metadata"]["name"]]
        if deployment == "pd" and role != "expert":   # the attention StatefulSet is PD's prefill pool
            assert labels == {"pool": {"attention": "prefill", "decode": "decode"}[role]}, (role, labels)
        else:
            assert f"_{role}_pool_" in name and not labels, (role, name)


def test_the_pd_leader_forms_a_job_with_a_decode_pool():
    by_role = pools(load_docs(DEPLOYMENTS["pd"]))
    args = serve_args(by_role["attention"])
    assert 1 <= int(flag(args, "--prefill-ranks")) < int(flag(args, "--attention-ranks"))
    assert flag(serve_args(by_role["decode"]), "--role") == "decode"
    assert flag(args, "--leader-host") == "$(AFSERVE_LEADER_POD)"


def test_prometheus_adapter_serves_the_hpa_metrics_under_their_own_names(docs):
    (cm,) = [d for path, d in docs if path.startswith("prometheus-adapter/") and d["kind"] == "ConfigMap"]
    rules = yaml.safe_load(cm["data"]["config.yaml"])["externalRules"]
    served = {r["name"]["as"]: r for r in rules}
    wanted = {m["external"]["metric"]["name"] for h in of_kind(docs, "HorizontalPodAutoscaler")
              for m in h["spec"]["metrics"]}
    assert set(served) == wanted
    for name, rule in served.items():
        assert rule["seriesQuery"].startswith(name + "{")
        assert rule["resources"]["overrides"]["namespace"] == {"resource": "namespace"}
    for h in of_kind(docs, "HorizontalPodAutoscaler"):   # a pool label an HPA selects on survives the query
        name, labels = hpa_series(h)
        for label in labels:
            assert f'{label}!=""' in served[name]["seriesQuery"], (name, label)
            assert re.search(rf"by \((\w+, )*{label}", served[name]["metricsQuery"]), (name, label)


def test_every_pool_joins_the_leader_store(docs):
    by_role = pools(docs)
    addrs = {role: flag(serve_args(w), "--pool-addr") for role, w in by_role.items()}
    assert len(set(addrs.values())) == 1, addrs
    host, port = addrs["attention"].rsplit(":", 1)
    svc = named(docs, "Service", host)
    assert svc["spec"].get("clusterIP") == "None" and svc["spec"].get("publishNotReadyAddresses") is True
    leader = leader_labels(by_role["attention"])
    assert selects(svc, leader) and POD_NAME in svc["spec"]["selector"]   # the leader and no other pod
    assert int(port) in {p["port"] for p in svc["spec"]["ports"]}
    assert int(port) in {p["containerPort"] for p in container(by_role["attention"])["ports"]}


def test_the_api_service_fronts_the_leader_http_port(docs):
    attention = pools(docs)["attention"]
    args = serve_args(attention)
    assert flag(args, "--host") == "0.0.0.0"
    (api,) = [s for s in of_kind(docs, "Service") if s["spec"].get("clusterIP") != "None"]
    assert selects(api, leader_labels(attention)) and POD_NAME in api["spec"]["selector"]
    assert [p["targetPort"] for p in api["spec"]["ports"]] == [int(flag(args, "--port"))]


def health_url(probe: dict) -> str:
    argv = probe["exec"]["command"]
    assert argv[:3] == ["python", "/opt/afserve/probe.py", "ready"], argv
    return argv[3]


def test_startup_and_readiness_ask_the_leader_health(docs):
    by_role = pools(docs)
    port = int(flag(serve_args(by_role["attention"]), "--port"))
    leader = leader_labels(by_role["attention"])
    for role, w in by_role.items():
        c = container(w)
        for kind in ("startupProbe", "readinessProbe"):
            url = urlsplit(health_url(c[kind]))
            assert (url.path, url.port) == ("/health", port), f"{role} {kind}: {url.geturl()}"
            svc = named(docs, "Service", url.hostname)   # reachable before the leader is ready, and only it
            assert svc["spec"].get("publishNotReadyAddresses") is True and selects(svc, leader)
            assert POD_NAME in svc["spec"]["selector"]
        startup = c["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 15 * 60, f"{role}: weight loading"
        assert c["livenessProbe"]["exec"]["command"] == ["python", "/opt/afserve/probe.py", "alive"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert flag(c["args"], "--nproc-per-node") == "$(AFSERVE_RANKS_PER_POD)" and "AFSERVE_RANKS_PER_POD" in env
    env = {e["name"]: e.get("value") for e in container(by_role["attention"])["env"]}
    assert env["AFSERVE_LEADER_POD"] == leader[POD_NAME]   # the liveness probe checks /health on that pod


def test_manifests_pass_only_flags_that_serve_knows(docs):
    from launch import serve
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        serve.main(["--help"])
    known = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", out.getvalue().partition("options:")[2]))
    assert {"--model", "--port", "--api-key", "--transport"} <= known
    for role, w in pools(docs).items():
        used = {a.split("=")[0] for a in serve_args(w) if a.startswith("--")}
        assert used - known == set(), f"{role}: flags launch/serve.py does not have"


def test_pods_drain_themselves_before_they_stop(docs):
    """A scale-down deletes pods: each first asks the leader's /admin/drain to remove its ranks (preStop), within
    the pod's grace period, with the API key the leader requires."""
    by_role = pools(docs)
    port = int(flag(serve_args(by_role["attention"]), "--port"))
    for role, w in by_role.items():
        argv = container(w)["lifecycle"]["preStop"]["exec"]["command"]
        assert argv[:3] == ["python", "/opt/afserve/probe.py", "drain"], f"{role}: {argv}"
        url = urlsplit(argv[3])
        assert (url.hostname, url.port, url.path) == ("afserve-leader", port, "/admin/drain"), f"{role}: {url}"
        timeout = float(argv[argv.index("--timeout-s") + 1])
        assert timeout < w["spec"]["template"]["spec"]["terminationGracePeriodSeconds"], role
        env = {e["name"]: e for e in container(w)["env"]}
        assert env["AFSERVE_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "afserve-api-key", role
