"""deploy/kubernetes: every manifest checked against the Kubernetes JSON schema (strict: no
unknown field; kubernetes-validate bundles the schemas, no network), then what the schema
cannot see: one Service per role, GPU requests, gRPC health probes, the admin token from a
Secret, and engine addresses that name exactly the StatefulSet's pods."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

# the test extra installs it; a bare checkout on a GPU host may lack it
kubernetes_validate = pytest.importorskip("kubernetes_validate")

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"
VERSION = "1.30.0"  # the oldest Kubernetes the manifests are for (gRPC probes are GA)


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    files = sorted(p.name for p in DEPLOY.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(kustomization["resources"]) == files  # every manifest is applied
    return [d for f in kustomization["resources"]
            for d in yaml.safe_load_all((DEPLOY / f).read_text()) if d]


def by_kind(docs, kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def container(workload: dict) -> dict:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    return c


def env_of(workload: dict, config: dict) -> dict[str, str | dict]:
    """The container's environment: the ConfigMap, then its own env over it."""
    c = container(workload)
    assert c["envFrom"] == [{"configMapRef": {"name": config["metadata"]["name"]}}]
    env = dict(config["data"])
    env.update({e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])})
    return env


def test_manifests_match_the_kubernetes_schema(docs):
    for doc in docs:
        kubernetes_validate.validate(doc, VERSION, strict=True)


def test_the_schema_check_catches_mistakes(docs):
    engine = by_kind(docs, "StatefulSet")["loramux-engine"]
    bad = yaml.safe_load(yaml.safe_dump(engine))
    bad["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, VERSION, strict=True)
    bad = yaml.safe_load(yaml.safe_dump(engine))
    container(bad)["livenesProbe"] = container(bad).pop("livenessProbe")  # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, VERSION, strict=True)


def test_roles_services_probes_and_secrets(docs):
    services, deployments = by_kind(docs, "Service"), by_kind(docs, "Deployment")
    config = by_kind(docs, "ConfigMap")["loramux-config"]
    engine = by_kind(docs, "StatefulSet")["loramux-engine"]
    workloads = {"loramux-engine": engine, **deployments}
    assert set(workloads) == {"loramux-engine", "loramux-control", "loramux-gateway"}
    for name, workload in workloads.items():  # a Service per role, selecting its pods
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert services[name]["spec"]["selector"].items() <= labels.items(), name
        ports = {p["name"]: p["containerPort"] for p in container(workload)["ports"]}
        for p in services[name]["spec"]["ports"]:
            assert ports[p.get("targetPort", p["name"])] == p["port"], (name, p)
        module = container(workload)["command"][2]
        assert importlib.util.find_spec(module) is not None, module
    assert services["loramux-engine"]["spec"]["clusterIP"] == "None"  # per-pod DNS names
    for name in ("loramux-control", "loramux-gateway"):  # gRPC health: ready, and alive
        c = container(deployments[name])
        port = int(env_of(deployments[name], config)[
            "LORAMUX_CONTROL_LISTEN" if name == "loramux-control" else "LORAMUX_GATEWAY_LISTEN"
        ].rsplit(":", 1)[1])
        assert c["readinessProbe"]["grpc"] == {"port": port}
        assert c["livenessProbe"]["grpc"] == {"port": port, "service": "liveness"}
    c = container(engine)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["exec"]["command"][:3] == ["python", "-m", "loramux_core.probe"]
    # the engine heartbeats while it warms up: alive (start-up, liveness) is a heartbeat,
    # ready is one that says SERVING; start-up has 10 minutes for the warm-up
    assert "--serving" in c["readinessProbe"]["exec"]["command"]
    assert "--serving" not in c["livenessProbe"]["exec"]["command"]
    assert "--serving" not in c["startupProbe"]["exec"]["command"]
    startup = c["startupProbe"]
    assert startup["failureThreshold"] * startup["periodSeconds"] >= 600
    token = env_of(deployments["loramux-control"], config)["LORAMUX_ADMIN_TOKEN"]
    secret = by_kind(docs, "Secret")[token["secretKeyRef"]["name"]]
    assert token["secretKeyRef"]["key"] in secret["stringData"]
    for workload in workloads.values():  # the ZMQ keys from their Secret, private to each pod
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        assert volumes["keys-secret"]["secret"] == {"secretName": "loramux-zmq-keys",
                                                    "defaultMode": 0o400}
        assert env_of(workload, config)["LORAMUX_ZMQ_KEYS"] == "/keys"


def test_engine_addresses_name_every_statefulset_pod(docs):
    config = by_kind(docs, "ConfigMap")["loramux-config"]["data"]
    engine = by_kind(docs, "StatefulSet")["loramux-engine"]["spec"]
    pods = [f"loramux-engine-{i}.{engine['serviceName']}" for i in range(engine["replicas"])]
    assert config["LORAMUX_ENGINE_INPUT"].split(",") == [f"tcp://{p}:5555" for p in pods]
    assert config["LORAMUX_ENGINE_OUTPUT"].split(",") == [f"tcp://{p}:5556" for p in pods]
    from loramux_services.common.replicas import addresses
    assert len(addresses(config["LORAMUX_ENGINE_INPUT"], config["LORAMUX_ENGINE_OUTPUT"])) == 2
