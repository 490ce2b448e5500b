"""TLS on the gateway's and the control plane's ports, end to end with real processes.

A CA, a server certificate and client certificates are made here with `cryptography`.
The control plane serves TLS with a bearer token; the gateway serves mutual TLS (gRPC and
the HTTP API). Clients: the sync and asyncio SDK, the `loramux` CLI, the container health
check, and a plain HTTPS client. Refused: plaintext, a server certificate from another CA,
a client without a certificate and one whose certificate another CA signed. A bearer token
on a non-loopback port without TLS stops the process at start."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import ssl
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
from loramux import TLS, AdminClient, GenerateClient, LoramuxError
from loramux.aio import AsyncAdminClient, AsyncGenerateClient

from loramux_engine import Engine, EngineConfig, SamplingParams
from loramux_services.common import tls as server_tls
from loramux_services.launcher import Cluster, ClusterConfig, free_port, wait_serving

pytest.importorskip("cryptography", reason="the test certificates (tests/support/certs.py) "
                    "need the test extra's cryptography package")
from tests.support.certs import CA  # noqa: E402
from tests.support.tiny import AdapterSpec, TinySpec, make_adapter, make_model

REPO = Path(__file__).resolve().parents[1]
TOKEN = "tls-test-token"
PROMPT = [5, 17, 33, 99]
# Services on CPU engines whatever LORAMUX_TEST_DEVICE says (TLS is the subject, not the
# device): the served engines and the in-process reference alike (tests/conftest.py).
pytestmark = [pytest.mark.timeout(300), pytest.mark.engine_device("cpu")]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    ca, other = CA(root / "ca"), CA(root / "other", "another CA")
    return {"ca": ca.pair.cert, "server": ca.issue("server", "loramux.test", server=True),
            "client": ca.issue("client", "operator", server=False),
            "other_ca": other.pair.cert, "other_client": other.issue("client", "x", server=False)}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("tls")
    model = make_model(root / "model", TinySpec())
    make_adapter(root / "adapters" / "a1", model, AdapterSpec(seed=7))
    return {"root": root, "model": str(model), "adapters": str(root / "adapters")}


@pytest.fixture(scope="module")
def cluster(files, pki):
    served = ("--tls-cert", pki["server"].cert, "--tls-key", pki["server"].key)
    cfg = ClusterConfig(model=files["model"], adapter_roots=(files["adapters"],),
                        workdir=str(files["root"] / "run"), auth_token=TOKEN, http_port=0,
                        control_args=served, gateway_args=(*served, "--tls-client-ca", pki["ca"]),
                        engine_args=("--device", "cpu"), env={"OMP_NUM_THREADS": "1"})
    with Cluster(cfg) as c:
        c.start()
        c.wait_ready()
        wait_serving(c.gateway_address, tls=client_tls(pki))
        yield c


def client_tls(pki, **kw) -> TLS:
    return TLS(**{"ca": pki["ca"], "cert": pki["client"].cert, "key": pki["client"].key, **kw})


@pytest.fixture(scope="module")
def want(files):
    with Engine(EngineConfig(model=files["model"])) as eng:
        eng.add_adapter("a1", os.path.join(files["adapters"], "a1"))
        return eng.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=6,
                                                     ignore_eos=True), adapters=["a1"])[0].token_ids


def code_of(fn) -> grpc.StatusCode:
    with pytest.raises(LoramuxError) as info:
        fn()
    return info.value.code


def test_admin_over_tls_with_token(cluster, pki):
    with AdminClient(cluster.control_address, token=TOKEN, tls=TLS(ca=pki["ca"])) as admin:
        assert admin.load("a1", "a1").name == "a1"
    with AdminClient(cluster.control_address, tls=TLS(ca=pki["ca"])) as anon:
        assert code_of(anon.list) == grpc.StatusCode.UNAUTHENTICATED

    async def aio():
        async with AsyncAdminClient(cluster.control_address, token=TOKEN,
                                    tls=TLS(ca=pki["ca"])) as admin:
            return [a.name for a in await admin.list()]
    assert asyncio.run(aio()) == ["a1"]
    refused = [AdminClient(cluster.control_address, token=TOKEN, timeout=30),  # plaintext
               AdminClient(cluster.control_address, token=TOKEN, timeout=30,
                           tls=TLS(ca=pki["other_ca"]))]                    # wrong CA
    for admin in refused:
        with admin:
            assert code_of(admin.list) == grpc.StatusCode.UNAVAILABLE


def test_generate_over_mutual_tls(cluster, pki, want):
    params = dict(temperature=0.0, max_tokens=6, ignore_eos=True)
    with AdminClient(cluster.control_address, token=TOKEN, tls=TLS(ca=pki["ca"])) as admin:
        admin.load("a1", "a1")
    with GenerateClient(cluster.gateway_address, tls=client_tls(pki)) as gen:
        assert gen.generate(PROMPT, "a1", **params).token_ids == want

    async def aio():
        async with AsyncGenerateClient(cluster.gateway_address, tls=client_tls(pki)) as gen:
            return (await gen.generate(PROMPT, "a1", **params)).token_ids
    assert asyncio.run(aio()) == want
    other = pki["other_client"]
    for tls in (TLS(ca=pki["ca"]),                                   # no client certificate
                TLS(ca=pki["ca"], cert=other.cert, key=other.key),   # another CA's client
                None):                                               # plaintext
        with GenerateClient(cluster.gateway_address, tls=tls) as gen:
            assert code_of(lambda: gen.generate(PROMPT, "a1", timeout=30, **params)) == \
                grpc.StatusCode.UNAVAILABLE


def test_http_api_over_mutual_tls(cluster, pki):
    url = f"https://{cluster.http_address}/v1/models"
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"})
    ctx = ssl.create_default_context(cafile=pki["ca"])
    ctx.load_cert_chain(pki["client"].cert, pki["client"].key)
    with urllib.request.urlopen(req, context=ctx, timeout=30) as resp:
        assert resp.status == 200 and "data" in json.loads(resp.read())
    bare = ssl.create_default_context(cafile=pki["ca"])  # no client certificate
    with pytest.raises((ssl.SSLError, ConnectionError, urllib.error.URLError)):
        with urllib.request.urlopen(req, context=bare, timeout=30) as resp:
            resp.read()


def _run(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env_extra or {}),
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "clients" / "python"),
                                          os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_cli_and_health_check_over_tls(cluster, pki):
    client = ["--tls-ca", pki["ca"], "--tls-cert", pki["client"].cert,
              "--tls-key", pki["client"].key]
    out = _run("loramux.cli", "generate", "--gateway", cluster.gateway_address, *client,
               "--max-tokens", "3", "hello")
    assert out.returncode == 0 and "[" in out.stderr, out.stderr
    out = _run("loramux.cli", "adapters", "--control", cluster.control_address, "--token", TOKEN,
               "--tls-ca", pki["ca"], "list")
    assert out.returncode == 0 and [a["name"] for a in json.loads(out.stdout)] == ["a1"], out.stderr
    out = _run("loramux.cli", "generate", "--gateway", cluster.gateway_address,
               "--tls-ca", pki["ca"], "hello")  # no client certificate
    assert out.returncode == 1 and "UNAVAILABLE" in out.stderr, out.stderr
    assert _run("loramux_services.common.healthcheck", cluster.gateway_address, *client).returncode == 0
    env = {"LORAMUX_TLS_CA": pki["ca"]}  # the container way: the CA from the environment
    assert _run("loramux_services.common.healthcheck", cluster.control_address,
                env_extra=env).returncode == 0
    assert _run("loramux_services.common.healthcheck", cluster.control_address).returncode == 1


# ---- a bearer token never crosses a network in plaintext ------------------------------

@pytest.mark.parametrize("listen,loopback", [
    ("127.0.0.1:1", True), ("localhost:1", True), ("[::1]:1", True), ("127.0.0.9:1", True),
    ("0.0.0.0:1", False), ("[::]:1", False), ("10.1.2.3:1", False), ("example.org:1", False)])
def test_loopback_detection(listen, loopback):
    assert server_tls.is_loopback(listen) is loopback


def test_token_transport_rule(pki):
    check = server_tls.check_token_transport
    tls = server_tls.ServerTLS(pki["server"].cert, pki["server"].key)
    check("127.0.0.1:1", "t", None, False)    # loopback
    check("0.0.0.0:1", None, None, False)     # no token
    check("0.0.0.0:1", "t", tls, False)       # TLS
    check("0.0.0.0:1", "t", None, True)       # explicit opt-out
    with pytest.raises(server_tls.TLSConfigError, match="plaintext"):
        check("0.0.0.0:1", "t", None, False)


@pytest.mark.parametrize("module,extra", [
    ("loramux_services.control", ["--db", "unused.sqlite", "--adapter-root", "."]),
    ("loramux_services.gateway", ["--http-port", "1"]),
])
def test_token_on_open_port_without_tls_refused_at_start(module, extra, tmp_path, pki):
    common = ["--model", str(tmp_path), "--engine-input", "tcp://127.0.0.1:1",
              "--engine-output", "tcp://127.0.0.1:2", "--table-address", "tcp://127.0.0.1:3",
              "--insecure-zmq", "--listen", f"0.0.0.0:{free_port()}", "--auth-token", "t"]
    out = _run(module, *common, *extra)
    assert out.returncode == 2 and "would travel in plaintext" in out.stderr, out.stderr
    half = _run(module, *common, *extra, "--tls-cert", pki["server"].cert)
    assert half.returncode == 2 and "--tls-cert and --tls-key go together" in half.stderr
    bad = _run(module, *common, *extra, "--tls-cert", pki["server"].cert, "--tls-key",
               str(tmp_path / "missing.key"))
    assert bad.returncode == 2 and "--tls-key" in bad.stderr


def test_loramux_serve_with_mutual_tls(files, pki, want, tmp_path):
    """`loramux serve` hands the TLS flags to both ports and checks health over mTLS."""
    ports = [free_port() for _ in range(2)]
    args = ["loramux.cli", "serve", "--model", files["model"], "--adapter-root", files["adapters"],
            "--device", "cpu", "--gateway-port", str(ports[0]), "--control-port", str(ports[1]),
            "--metrics-port", "-1", "--http-port", "0", "--workdir", str(tmp_path / "run"),
            "--tls-cert", pki["server"].cert, "--tls-key", pki["server"].key,
            "--tls-client-ca", pki["ca"], "--tls-ca", pki["ca"],
            "--tls-client-cert", pki["client"].cert, "--tls-client-key", pki["client"].key]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_serving(f"127.0.0.1:{ports[0]}", timeout_s=120, tls=client_tls(pki))
        with AdminClient(f"127.0.0.1:{ports[1]}", tls=client_tls(pki)) as admin:
            admin.load("a1", "a1")
        with AdminClient(f"127.0.0.1:{ports[1]}", tls=TLS(ca=pki["ca"]), timeout=30) as anon:
            assert code_of(anon.list) == grpc.StatusCode.UNAVAILABLE  # mTLS on both ports
        with GenerateClient(f"127.0.0.1:{ports[0]}", tls=client_tls(pki)) as gen:
            assert gen.generate(PROMPT, "a1", temperature=0.0, max_tokens=6,
                                ignore_eos=True).token_ids == want
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    assert proc.returncode == 0, out[-3000:]
