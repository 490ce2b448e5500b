"""docker-compose.yml: validated as a file, then each CPU-profile service's command run as a
local process with the compose environment (container hostnames, ports and volumes mapped
to loopback, free ports and temporary directories), checked to serve together: control
plane, gateway and two engine replicas."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from loramux import AdminClient, GenerateClient

from loramux_services.launcher import free_port

REPO = Path(__file__).resolve().parents[1]
_VAR = re.compile(r"\$\{([A-Z0-9_]+)(:-([^}]*)|:\?([^}]*))?\}")
# the only variables compose requires (`${NAME:?why}`), and what the local run uses
REQUIRED = {"LORAMUX_ADMIN_TOKEN": "compose-test-token"}
REPLICAS = (("engine-0", "engine-cpu-0"), ("engine-1", "engine-cpu-1"))  # GPU, CPU service
ENGINES = tuple(name for pair in REPLICAS for name in pair)


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def interpolate(value: str) -> str:
    def sub(m):
        if m.group(4) is not None:
            return REQUIRED[m.group(1)]
        assert m.group(2) is not None, f"${{{m.group(1)}}} has no default"
        return m.group(3)  # the compose defaults, whatever this machine's environment says
    return _VAR.sub(sub, value)


def test_compose_file_is_valid(compose):
    services = compose["services"]
    assert {"keys", "setup", *ENGINES, "control", "gateway"} <= set(services)
    assert set(compose["volumes"]) >= {"models", "adapters", "state", "zmq-keys"}
    for i, (gpu_name, cpu_name) in enumerate(REPLICAS):
        gpu, cpu = services[gpu_name], services[cpu_name]
        device = gpu["deploy"]["resources"]["reservations"]["devices"][0]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        assert interpolate(gpu["environment"]["CUDA_VISIBLE_DEVICES"]) == str(i)  # GPU i
        assert gpu["profiles"] == ["gpu"] and cpu["profiles"] == ["cpu"]
        assert "deploy" not in cpu
        assert cpu["networks"]["default"]["aliases"] == [gpu_name]
        assert cpu["depends_on"]["setup"]["condition"] == "service_completed_successfully"
    for name in ("control", "gateway"):  # both know both replicas, in replica order
        env = services[name]["environment"]
        assert env["LORAMUX_ENGINE_INPUT"] == "tcp://engine-0:5555,tcp://engine-1:5555"
        assert env["LORAMUX_ENGINE_OUTPUT"] == "tcp://engine-0:5556,tcp://engine-1:5556"
    for name in (*ENGINES, "control", "gateway"):
        svc = services[name]
        assert svc["healthcheck"]["test"][0] == "CMD", name
        assert svc["restart"] == "unless-stopped", name  # a process that dies comes back
        if name in ENGINES:  # healthy: serving, not only alive (it heartbeats warming up)
            assert svc["healthcheck"]["test"][-1] == "--serving", name
            assert _seconds(svc["healthcheck"]["start_period"]) >= 300, name
        for vol in svc["volumes"]:
            assert vol.split(":")[0] in compose["volumes"], (name, vol)
    deps = services["gateway"]["depends_on"]
    assert deps["control"]["condition"] == "service_healthy"
    assert all(deps[name]["condition"] == "service_healthy" for name in ENGINES)
    for name in (*ENGINES, "control", "gateway"):  # ZMQ keys, read-only
        svc = services[name]
        assert svc["depends_on"]["keys"]["condition"] == "service_completed_successfully", name
        assert "zmq-keys:/keys:ro" in svc["volumes"] and svc["environment"]["LORAMUX_ZMQ_KEYS"] == "/keys"
        assert "LORAMUX_INSECURE_ZMQ" not in svc["environment"], name
    assert services["keys"]["volumes"] == ["zmq-keys:/keys"]
    text = (REPO / "docker-compose.yml").read_text()
    for m in _VAR.finditer(text):
        assert m.group(2) is not None, f"{m.group(0)} has no default"
        assert m.group(4) is None or m.group(1) in REQUIRED, m.group(0)
    control = services["control"]
    assert control["environment"]["LORAMUX_ADMIN_TOKEN"].startswith("${LORAMUX_ADMIN_TOKEN:?")
    assert [interpolate(p) for p in control["ports"]] == ["127.0.0.1:50052:50052"]
    for name in ("control", "gateway"):  # TLS off unless the operator sets the files
        env = services[name]["environment"]
        assert interpolate(env["LORAMUX_TLS_CERT"]) == "" and "tls:/tls:ro" in services[name]["volumes"]


def _docker_compose() -> list[str] | None:
    for cmd in (["docker", "compose"], ["docker-compose"]):
        try:
            if subprocess.run([*cmd, "version"], capture_output=True, timeout=30).returncode == 0:
                return cmd
        except (OSError, subprocess.TimeoutExpired):
            continue
    return None


def test_docker_compose_config():
    """The real `docker compose config`: it refuses to render without the admin token and
    publishes the admin port on the loopback only."""
    cmd = _docker_compose()
    if cmd is None:
        pytest.skip("docker compose is not installed")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAMUX_")}
    out = subprocess.run([*cmd, "--profile", "cpu", "config", "--format", "json"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "LORAMUX_ADMIN_TOKEN" in out.stderr, out.stderr
    out = subprocess.run([*cmd, "--profile", "cpu", "config", "--format", "json"], cwd=REPO,
                         env={**env, **REQUIRED}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    ports = json.loads(out.stdout)["services"]["control"]["ports"]
    assert [(p["host_ip"], p["target"]) for p in ports] == [("127.0.0.1", 50052)]


class LocalCompose:
    """Runs compose services as local processes: hostnames -> 127.0.0.1, every (host, port)
    -> a free local port (a service's own 0.0.0.0/127.0.0.1 is its network name, so two
    replicas on the same container port get two local ports), container paths ->
    directories under `root`."""

    def __init__(self, compose: dict, root: Path):
        self.compose = compose
        self.ports: dict[tuple[str, str], str] = {}
        self.paths = {p: str(root / p.strip("/")) for p in ("/models", "/adapters", "/state", "/keys")}
        for p in self.paths.values():
            os.makedirs(p, exist_ok=True)
        self.procs: list[subprocess.Popen] = []
        self.logs = root

    def host(self, service: str | None) -> str:
        """The name other containers reach `service` by."""
        if service is None:
            return ""
        aliases = self.compose["services"][service].get("networks", {}).get("default", {})
        return (aliases or {}).get("aliases", [service])[0]

    def port(self, host: str, port: str) -> str:
        return self.ports.setdefault((host, port), str(free_port()))

    def map(self, value: str, service: str | None = None) -> str:
        value = interpolate(str(value))
        own = self.host(service)

        def address(m):
            host = own if m.group(2) in ("0.0.0.0", "127.0.0.1") else m.group(2)
            return f"{m.group(1)}127.0.0.1:{self.port(host, m.group(3))}"
        value = re.sub(r"(//|^|,)([a-z0-9.-]+):(\d{4,5})\b", address, value)
        for container, local in self.paths.items():
            value = re.sub(rf"(?<![\w/]){re.escape(container)}(?=/|:|$)", local, value)
        return value

    def env(self, name: str) -> dict:
        env = {k: self.map(v, name) for k, v in self.compose["services"][name].get("environment", {}).items()}
        for key, value in env.items():  # a bare port number (the metrics port): a free one too
            if key.endswith("_PORT") and value.isdigit():
                env[key] = self.port(self.host(name), value)
        return {**os.environ, **env, "OMP_NUM_THREADS": "1"}

    def argv(self, cmd: list[str], service: str) -> list[str]:
        cmd = [self.map(c, service) for c in cmd]
        return [sys.executable if c == "python" else c for c in cmd]

    def start(self, name: str) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "wb")
        proc = subprocess.Popen(self.argv(self.compose["services"][name]["command"], name),
                                env=self.env(name), stdout=log, stderr=log, cwd=REPO)
        self.procs.append(proc)
        return proc

    def healthy(self, name: str, timeout_s: float = 90.0) -> None:
        test = self.compose["services"][name]["healthcheck"]["test"]
        assert test[0] == "CMD"
        deadline = time.monotonic() + timeout_s
        while subprocess.run(self.argv(test[1:], name), env=self.env(name), cwd=REPO,
                             capture_output=True).returncode != 0:
            assert time.monotonic() < deadline, (self.logs / f"{name}.log").read_text()[-3000:]
            time.sleep(0.5)

    def close(self) -> None:
        for p in reversed(self.procs):
            p.terminate()
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.mark.timeout(300)
def test_compose_services_serve_together(compose, tmp_path):
    local = LocalCompose(compose, tmp_path)
    try:
        for name in ("keys", "setup"):
            assert local.start(name).wait(120) == 0, (tmp_path / f"{name}.log").read_text()
        services = ("engine-cpu-0", "engine-cpu-1", "control", "gateway")
        for name in services:  # as compose would, all at once
            local.start(name)
        for name in services:
            local.healthy(name)
        env = local.env("gateway")
        gateway = env["LORAMUX_GATEWAY_LISTEN"]
        control = local.env("control")["LORAMUX_CONTROL_LISTEN"]
        with AdminClient(control, token=REQUIRED["LORAMUX_ADMIN_TOKEN"]) as admin:
            a = admin.load("demo-a", local.map("/models/demo/adapters/demo-a"))
            assert a.path.startswith(local.paths["/models"]) and a.rank == 8
            assert [(r.replica, r.up, r.placed) for r in a.replicas] == [(0, True, True), (1, True, True)]
        with GenerateClient(gateway) as gen:
            for _ in range(2):
                out = gen.generate("hello", "demo-a", temperature=0.0, max_tokens=5)
                assert len(out.token_ids) == 5 or out.finish_reason == "eos"
    finally:
        local.close()


def _seconds(duration: str) -> int:
    """A compose duration in seconds ("300s", "5m")."""
    return int(duration[:-1]) * {"s": 1, "m": 60}[duration[-1]]
